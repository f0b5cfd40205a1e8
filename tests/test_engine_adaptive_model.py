"""Adaptive speculation on the real tiny model: switching between the drafting and the plain program (lazy draft
context: the plain one skips the draft's context update, drafting catches it up) keeps greedy output plain
decoding's at fp32 and compiles nothing after warm-up."""
import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.engine.adaptive import SpeculationPolicy
from dsflash.serve.engine.backend import ModelBackend
from dsflash.serve.types import SamplingParams
from test_engine_model import prompts
from test_engine_scheduler import run_all

OPTS = dict(max_num_seqs=4, max_model_len=96, page_size=16, max_num_batched_tokens=64, decode_steps=2,
            prefill_buckets=[(2, 32)], enable_prefix_caching=False)


@pytest.fixture(scope="module")
def model():
    from dsflash.api import Model, _synthetic_tokenizer
    from dsflash.checkpoint.synth import fast_init_params
    from dsflash.config import preset
    cfg = preset("tiny")
    return Model(cfg, fast_init_params(cfg, 0), _synthetic_tokenizer(cfg), name="tiny")


def flip(eng, period):
    """Draft on one decode call in ``period``: drafting resumes after plain calls again and again."""
    eng.speculation = pol = SpeculationPolicy(eng.k, "adaptive")
    calls = iter(range(10**6))
    pol._decide = lambda accepted: eng.k if next(calls) % period == 0 else 0


@pytest.mark.slow
def test_fp32_switching_with_lazy_draft_context_equals_plain(model):
    be = ModelBackend(model, precision="fp32")
    items = [(f"a{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
             for i, p in enumerate(prompts(6, seed=3, lo=3, hi=50))]
    want = run_all(LLMEngine(be, speculative_mode="off", **OPTS), items)
    eng = LLMEngine(be, **OPTS)
    assert eng.runner.lazy_ctx and eng.runner.draft_lengths == (0, eng.k)
    flip(eng, 3)
    got = run_all(eng, items)
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    m = eng.metrics_snapshot()
    assert m["spec_num_drafts"] > 0 and 0.2 < m["spec_drafted_call_fraction"] < 0.5
    assert m["compiles_after_warmup"] == 0
