"""``EngineConfig``: validated once (a bad value names the field), built from keywords or CLI arguments by field
name, and carrying the loaded model's run options (precision, kernel backend, bounded replay) into the engine's
programs instead of re-defaulting them."""
import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import dsflash
from dsflash.serve.engine import EngineConfig, LLMEngine
from dsflash.serve.engine.config import resolve_backend
from dsflash.serve.engine.backend import make_backend
from dsflash.serve.engine.testing import ToyBackend

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(max_num_seqs=2, max_model_len=64, page_size=16, max_num_batched_tokens=32, decode_steps=2,
             compilation_cache=False)


def test_bad_values_name_the_field():
    for kw, field in ((dict(backend="cuda"), "backend"), (dict(precision="fp8"), "precision"),
                      (dict(bounded_replay="yes"), "bounded_replay"), (dict(max_num_seqs=0), "max_num_seqs"),
                      (dict(page_size=1.5), "page_size"), (dict(num_pages=-1), "num_pages")):
        with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
            EngineConfig(**kw)
    with pytest.raises(ValueError, match="unknown engine options: bogus"):
        EngineConfig.from_kwargs(bogus=1)
    with pytest.raises(ValueError, match="backend"):
        LLMEngine(ToyBackend(), backend="cuda", **SMALL)


def test_from_namespace_takes_fields_by_name():
    args = argparse.Namespace(max_num_seqs=3, backend="xla", host="0.0.0.0", port=1, model="demo")
    c = EngineConfig.from_namespace(args, seed=7)
    assert (c.max_num_seqs, c.backend, c.seed) == (3, "xla", 7)


def test_auto_resolves_to_xla_on_cpu():
    assert resolve_backend("auto") == "xla"
    assert resolve_backend("triton") == "triton" and resolve_backend("xla") == "xla"


def test_loaded_model_run_options_are_carried():
    m = dsflash.load("tiny", backend="triton", precision="bf16", bounded_replay="report", progress=False)
    be = make_backend(m, EngineConfig())            # no compile: the backend the engine would run
    assert (be.backend, be.precision, be.bounded_replay) == ("triton", "bf16", "report")
    o = be._opts()
    assert (o.backend, o.precision, o.bounded_replay) == ("triton", "bf16", "report")
    # "auto" asked of the engine leaves a loaded model's chosen backend alone
    assert make_backend(m, EngineConfig(backend="auto")).backend == "triton"


def test_explicit_override_is_honoured_and_logged(caplog):
    m = dsflash.load("tiny", backend="triton", progress=False)
    with caplog.at_level(logging.WARNING, logger="dsflash.serve.engine"):
        be = make_backend(m, EngineConfig(backend="xla", precision="fp32"))
    assert (be.backend, be.precision) == ("xla", "fp32")
    assert "overrides the loaded model's backend='triton'" in caplog.text
    # a prebuilt backend cannot change: a different explicit setting is an error, not a silent no-op
    from dsflash.serve.engine.backend import ModelBackend
    with pytest.raises(ValueError, match="EngineConfig.precision"):
        make_backend(ModelBackend(m), EngineConfig(precision="bf16"))


def test_llm_keeps_the_models_backend_in_the_runner_options():
    m = dsflash.load("tiny", backend="xla", precision="fp32", progress=False)
    llm = dsflash.LLM(m, **SMALL)
    eng = llm.engine
    assert eng.runner.backend is eng.backend
    assert eng.backend._opts().backend == "xla" and eng.backend._opts().precision == "fp32"
    assert eng.run_options["backend"] == "xla" and eng.run_options["precision"] == "fp32"
    assert "backend xla -> xla" in eng.kernels_line and "moe decode=xla" in eng.kernels_line
    assert "precision=fp32" in eng.kernels_line


def test_serve_help_lists_backend():
    out = subprocess.run([sys.executable, "-m", "dsflash.serve", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0
    assert "--backend" in out.stdout and "auto" in out.stdout


def test_bench_engine_parses_backend():
    from dsflash.bench import engine as bench_engine
    assert bench_engine.parse(["--backend", "xla"]).backend == "xla"
    assert bench_engine.parse([]).backend == "auto"


# ---------------------------------------------------------------------------------------------- one home of defaults
def test_http_sampling_defaults_are_sampling_params_defaults():
    from dsflash.serve.http.app import _sampling_params
    from dsflash.serve.http.protocol import ChatCompletionRequest, CompletionRequest
    from dsflash.serve.types import SamplingParams
    base = SamplingParams(max_tokens=7)
    for req in (CompletionRequest(prompt="hi"), ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])):
        assert _sampling_params(req, 7, None) == base           # a field not sent keeps the SamplingParams default
    sent = CompletionRequest(prompt="hi", temperature=0.0, presence_penalty=0.5, ignore_eos=True, top_k=5)
    sp = _sampling_params(sent, 7, None)
    assert (sp.temperature, sp.presence_penalty, sp.ignore_eos, sp.top_k) == (0.0, 0.5, True, 5)


# ---------------------------------------------------------------------------------------------- the request envelope
def test_envelope_carries_dp_rank_from_async_engine_to_the_engine():
    import asyncio

    from dsflash.serve.async_engine import AsyncEngine
    from dsflash.serve.types import EngineRequest, SamplingParams
    eng = LLMEngine(ToyBackend(), data_parallel_size=2, max_num_seqs=4, max_model_len=64, page_size=8,
                    max_num_batched_tokens=32, decode_steps=2, compilation_cache=False)
    ranks = {}
    add = eng.add

    def recording_add(req):                 # the rank each request was given, as the engine thread adds it
        add(req)
        ranks[req.request_id] = eng.groups[req.request_id][0].rank

    eng.add = recording_add
    ae = AsyncEngine(lambda: eng)
    ae.start()
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def main():
        streams = await ae.add_requests([EngineRequest("pinned", [5, 6, 7], sp, dp_rank=1),
                                         ("plain", [5, 6, 7], sp)])
        outs = [await s.get() for s in streams]
        while not all(s.finished for s in streams):
            for i, s in enumerate(streams):
                if not s.finished:
                    outs[i] = await s.get()
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        ae.shutdown()
    assert ranks["pinned"] == 1 and set(ranks) == {"pinned", "plain"}
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    with pytest.raises(ValueError, match="dp_rank"):
        eng.add(EngineRequest("bad", [5], sp, dp_rank=2))


def test_default_buckets_give_a_lone_prompt_the_whole_token_budget():
    """One waiting prompt used to be prefilled 64 tokens a step in the default (4, 64) bucket, its 3 other rows
    padding (a 1024-token prompt: 16 steps); the (1, rows x tokens) bucket takes it B tokens a step. Both buckets
    have the same rows x tokens (prefill rounds a prompt alike in either: tests/test_model_prefill_chunking.py)."""
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine.testing import ToyBackend
    from dsflash.serve.types import SamplingParams
    assert EngineConfig(max_num_seqs=16, max_num_batched_tokens=256).layout(1, 1).buckets == [(4, 64), (1, 256)]
    assert EngineConfig(max_num_seqs=16, max_num_batched_tokens=258).layout(1, 1).buckets == [(4, 64), (1, 256)]
    assert EngineConfig(max_num_seqs=1, max_num_batched_tokens=256).layout(1, 1).buckets == [(1, 256)]
    assert EngineConfig(max_num_seqs=16, max_num_batched_tokens=256).layout(1, 2).buckets == [(4, 64), (1, 256)]
    assert EngineConfig(max_num_batched_tokens=1024, max_mixed_prefill_tokens=256).layout(1, 1).buckets == \
        [(4, 256), (1, 1024), (4, 64), (1, 256)]                       # the mixed steps' programs
    for bad in (0, -1, 2.5, "64"):
        with pytest.raises(ValueError, match="EngineConfig.max_mixed_prefill_tokens"):
            EngineConfig(max_mixed_prefill_tokens=bad)
    eng = LLMEngine(ToyBackend(), max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=256,
                    speculative=False, enable_prefix_caching=False)
    eng.add_request("a", [3 + i % 50 for i in range(1024)], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.metrics_snapshot()["num_prefill_calls"] == 4            # 1024 tokens / 256, not / 64
