"""The engine's ``moe_weight_layout="il"`` (routed experts repacked once at load, dsflash/kernels/moe_layout.py): on the
demo model the engine's greedy tokens equal the checkpoint layout's (on CPU the XLA path converts the il weights back
per call: the same floats), the backend reports the layout, and bad settings are errors naming the field."""
import numpy as np
import pytest

import dsflash
from dsflash.kernels import moe_layout
from dsflash.serve.engine import EngineConfig, LLMEngine
from dsflash.serve.engine.backend import ModelBackend
from dsflash.serve.types import SamplingParams
from test_engine_scheduler import run_all

OPTS = dict(max_num_seqs=4, max_model_len=96, page_size=16, max_num_batched_tokens=64, decode_steps=2,
            prefill_buckets=[(2, 32)], enable_prefix_caching=False, speculative_mode="off")


@pytest.fixture(scope="module")
def demo():
    return dsflash.load("demo", backend="xla")


def test_il_layout_engine_greedy_equals_checkpoint_layout(demo):
    rng = np.random.default_rng(5)
    items = [(f"r{i}", [int(t) for t in rng.integers(3, demo.cfg.vocab_size, size=n)],
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for i, n in enumerate((7, 30, 19))]
    want = run_all(LLMEngine(demo, **OPTS), items)
    eng = LLMEngine(demo, moe_weight_layout="il", **OPTS)
    assert eng.run_options["moe_weight_layout"] == "il" and not eng.run_options["dequantized_weights"]
    packed = [n for n, v in eng.backend.params.items() if ".experts." in n and moe_layout.is_il(v)]
    assert packed and all(".experts." in n for n in packed)
    got = run_all(eng, items)
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid


def test_bad_layout_settings_name_the_field(demo):
    with pytest.raises(ValueError, match="moe_weight_layout"):
        EngineConfig(moe_weight_layout="nibbles")
    with pytest.raises(ValueError, match="moe_weight_layout.*single-device"):
        EngineConfig(moe_weight_layout="il", mesh="dep=2")
    with pytest.raises(ValueError, match="moe_weight_layout.*dequantize"):
        ModelBackend(demo, moe_weight_layout="il", dequantize=True)
    be = ModelBackend(demo)                               # built with the checkpoint layout
    with pytest.raises(ValueError, match="moe_weight_layout"):
        LLMEngine(be, moe_weight_layout="il", **OPTS)


def test_auto_layout_is_il_only_on_the_triton_backend(demo, monkeypatch):
    assert ModelBackend(demo, moe_weight_layout="auto").moe_weight_layout == "checkpoint"     # XLA here
    assert LLMEngine(demo, **OPTS).run_options["moe_weight_layout"] == "checkpoint"            # the engine default
    import dsflash.serve.engine.config as C
    monkeypatch.setattr(C, "resolve_backend", lambda name: "triton")     # as on a GPU with jax-triton
    be = ModelBackend(demo, moe_weight_layout="auto")
    assert be.backend == "triton" and be.moe_weight_layout == "il" and not be.dequantized
    assert ModelBackend(demo, moe_weight_layout="auto", dequantize=True).moe_weight_layout == "checkpoint"


def test_il_needs_128_wide_slabs():
    from dsflash.api import Model
    from dsflash.checkpoint.synth import fast_init_params
    from dsflash.config import preset
    cfg = preset("tiny")                                  # moe_intermediate_size 64
    with pytest.raises(ValueError, match="moe_weight_layout.*128"):
        ModelBackend(Model(cfg, fast_init_params(cfg, 0), None, name="tiny"), backend="xla", moe_weight_layout="il")
