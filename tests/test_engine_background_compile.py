"""Background compile (``EngineConfig.background_compile``, the default): an adaptive engine is ready once its prefill
buckets and the plain recording decode program are compiled; the drafting and tap-free programs compile on daemon
threads and run only once compiled. Until then every decode call is plain (and records the taps), greedy output is
the same, a failed background compile leaves the engine serving without that program, the background compiles are
not counted as compiles of the serving steps, and a process exiting mid-compile waits for it instead of aborting."""
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.engine import runner as R
from dsflash.serve.engine.adaptive import SpeculationPolicy
from dsflash.serve.engine.testing import ToyBackend, ToyConfig, run_greedy

TOY = dict(max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=48, decode_steps=2,
           prefill_buckets=[(4, 12)], enable_prefix_caching=False)
K = ToyConfig().dspark_block_size
PROMPTS = [[3 + i, 7, 9, 11, 5 + 2 * i] for i in range(3)]


def _hold(monkeypatch, fail=()):
    """Background compiles wait for the returned event; those of the draft lengths in ``fail`` then raise."""
    release = threading.Event()
    compile_program = R.Runner._compile_program

    def held(self, key, fn, args):
        assert release.wait(300), "the test never released the background compile"
        if key[1] in fail:
            raise RuntimeError("injected compile failure")
        return compile_program(self, key, fn, args)

    monkeypatch.setattr(R.Runner, "_compile_program", held)
    return release


def _serve(eng, prompts, tag, max_tokens=30, on_decode=None):
    """Greedy requests to the end: (token ids by prompt index, the draft length of every decode call)."""
    calls, decode = [], eng.runner.decode

    def traced(inp, draft_len=None):
        calls.append(draft_len)
        if on_decode is not None:
            on_decode(len(calls))
        return decode(inp, draft_len)

    eng.runner.decode = traced
    try:
        out = run_greedy(eng, prompts, tag, max_tokens)
    finally:
        del eng.runner.decode
    return out, calls


@pytest.fixture(scope="module")
def toy_plain():
    return _serve(LLMEngine(ToyBackend(), speculative_mode="off", **TOY), PROMPTS, "p")[0]


def test_the_engine_serves_plain_until_the_drafting_program_is_compiled_then_drafts(monkeypatch, toy_plain):
    release = _hold(monkeypatch)
    try:
        eng = LLMEngine(ToyBackend(), **TOY)       # adaptive with background compile: the defaults
        r = eng.runner
        assert eng.config.background_compile and eng.config.speculative_mode == "adaptive"
        # ready: the prefill and the plain recording program compiled, the drafting and tap-free ones not yet
        assert sorted(r.compiling) == sorted([K, R.TAP_FREE]) and not eng.programs_ready
        assert r.available(0) and not r.available(K) and not r.available(R.TAP_FREE)
        assert ("decode", 0) in r._compiled and ("decode", K) not in r._compiled
        out, calls = _serve(eng, PROMPTS, "a")   # served while the compiles are held: no step waits for them
        assert calls and set(calls) == {0}, calls
        m = eng.metrics_snapshot()
        assert m["spec_num_drafts"] == 0 and m["spec_calls_before_drafting_compiled"] > 0
        assert m["programs_compiling"] == 2 and not m["programs_ready"]
        assert m["background_programs"][f"draft{K}"]["state"] == 0
    finally:
        release.set()
    assert eng.wait_for_programs(120) and eng.programs_ready and not r.compiling
    out2, calls2 = _serve(eng, PROMPTS, "b")
    first = next(d for d in calls2 if d)           # the policy's start-up measurement of the drafting program
    assert first == K, calls2
    assert out == out2 == toy_plain
    m = eng.metrics_snapshot()
    assert m["spec_num_drafts"] > 0 and m["compiles_after_warmup"] == 0
    assert m["programs_compiling"] == 0 and m["programs_ready"]
    assert {p: b["state"] for p, b in m["background_programs"].items()} == {f"draft{K}": 1, "tap_free": 1}
    assert all(b["compile_s"] > 0 for b in m["background_programs"].values())


def test_without_background_compile_every_program_is_compiled_before_the_engine_is_ready():
    eng = LLMEngine(ToyBackend(), background_compile=False, **TOY)
    r = eng.runner
    assert eng.programs_ready and not r.background and not r.compiling
    assert all(("decode", d) in r._compiled for d in (0, K, R.TAP_FREE))
    # only an adaptive engine has programs its first calls do not need
    eng = LLMEngine(ToyBackend(), speculative_mode="always", **TOY)
    assert eng.programs_ready and not eng.runner.background


def test_a_background_compile_during_a_step_is_not_a_compile_of_the_serving_steps(monkeypatch, toy_plain):
    """The compile events of the background threads are counted apart: ``compiles_after_warmup`` stays 0 although
    here both programs compile inside the first decode call's step."""
    release = _hold(monkeypatch)
    try:
        eng = LLMEngine(ToyBackend(), **TOY)
        n0 = R.background_compile_count()

        def compile_now(n):
            if n == 1:
                release.set()
                assert eng.wait_for_programs(120)

        out, calls = _serve(eng, PROMPTS, "c", on_decode=compile_now)
    finally:
        release.set()
    assert eng.programs_ready and R.background_compile_count() > n0
    assert eng.compiles_after_warmup == 0
    assert out == toy_plain and K in calls


def _plain_policy(block, reprobe_every=6):
    """Both programs measured, drafting 50x plain: only the engine-wide reprobe drafts (long plain stretches, where
    the tap-free program runs when it can)."""
    pol = SpeculationPolicy(block, "adaptive", reprobe_every=reprobe_every, remeasure_every=10**6)
    for c in pol.costs.values():
        c.seconds, c.samples, c.alpha = 1e-3, pol.probe_calls, 0.0
    pol.costs[block].ratio = 50.0
    return pol


@pytest.mark.parametrize("failing", [K, R.TAP_FREE], ids=["drafting", "tap_free"])
def test_a_failed_background_compile_leaves_the_engine_serving_without_that_program(monkeypatch, caplog, failing):
    opts = dict(TOY, max_model_len=160)
    prompts = [[3 + i, 7, 9, 11, 5] for i in range(2)]
    want, _ = _serve(LLMEngine(ToyBackend(), speculative_mode="off", **opts), prompts, "p", max_tokens=80)
    release = _hold(monkeypatch, fail={failing})
    release.set()
    with caplog.at_level(logging.INFO, logger="dsflash.serve.engine"):
        eng = LLMEngine(ToyBackend(), **opts)
        assert eng.wait_for_programs(120)
    r, other = eng.runner, ({K, R.TAP_FREE} - {failing}).pop()
    assert r.background[failing]["state"] == "failed" and "injected" in r.background[failing]["error"]
    assert r.background[other]["state"] == "ready"
    assert not r.available(failing) and r.available(other) and not eng.programs_ready
    failed = [x for x in caplog.records if x.levelno == logging.ERROR and "failed" in x.getMessage()]
    assert len(failed) == 1 and R.program_name(failing) in failed[0].getMessage()
    assert any(x.levelno == logging.INFO and R.program_name(other) in x.getMessage()
               and "compiled in the background" in x.getMessage() for x in caplog.records)
    if failing == R.TAP_FREE:       # a policy that would run tap-free stretches (tests/test_engine_adaptive.py)
        eng.speculation = pol = _plain_policy(eng.k)
        pol.sequential_verify = r.sequential_verify
    out, calls = _serve(eng, prompts, "f", max_tokens=80)
    assert out == want
    if failing == K:                # plain to the end, recording
        assert set(calls) == {0}, calls
    else:                           # drafting at the reprobes, never the tap-free program
        assert K in calls and R.TAP_FREE not in calls and eng.speculation.tap_free_calls == 0, calls
    m = eng.metrics_snapshot()
    name = "tap_free" if failing == R.TAP_FREE else f"draft{K}"
    assert m["background_programs"][name]["state"] == -1 and not m["programs_ready"]
    assert m["compiles_after_warmup"] == 0


def test_stop_background_lets_the_compile_in_flight_finish_and_starts_no_other(monkeypatch):
    release = _hold(monkeypatch)
    try:
        eng = LLMEngine(ToyBackend(), **TOY)
        eng.runner.stop_background()         # (the exit hook's first move) while the drafting program's compile waits
    finally:
        release.set()
    assert eng.wait_for_programs(120)
    b = eng.runner.background
    assert b[K]["state"] == "ready" and b[R.TAP_FREE]["state"] == "failed" and "stopped" in b[R.TAP_FREE]["error"]
    assert eng.runner.available(K) and not eng.runner.available(R.TAP_FREE)


def test_a_process_exiting_mid_compile_waits_for_it_instead_of_aborting():
    """An XLA compile cut off by the interpreter's exit aborts the process (SIGABRT, exit code 134); the runner's
    exit hook waits for the compile in flight and starts no queued one."""
    code = textwrap.dedent("""
        import threading
        from dsflash.serve.engine import LLMEngine, runner as R
        from dsflash.serve.engine.testing import ToyBackend
        in_xla = threading.Event()
        def compile_program(self, key, fn, args):
            lowered = fn.lower(*args)
            in_xla.set()
            return lowered.compile()
        R.Runner._compile_program = compile_program
        eng = LLMEngine(ToyBackend(), max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=48,
                        decode_steps=2, prefill_buckets=[(4, 12)], enable_prefix_caching=False)
        assert in_xla.wait(120) and eng.runner.compiling
        print("exiting", eng.runner.compiling, flush=True)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "exiting" in p.stdout, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])


# ------------------------------------------------------------------ the tiny model at fp32
OPTS = dict(max_num_seqs=4, max_model_len=96, page_size=16, max_num_batched_tokens=64, decode_steps=2,
            prefill_buckets=[(2, 32)], enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tiny_fp32():
    from dsflash.api import Model, _synthetic_tokenizer
    from dsflash.checkpoint.synth import fast_init_params
    from dsflash.config import preset
    from dsflash.serve.engine.backend import ModelBackend
    cfg = preset("tiny")
    return ModelBackend(Model(cfg, fast_init_params(cfg, 0), _synthetic_tokenizer(cfg), name="tiny"), precision="fp32")


@pytest.mark.slow
def test_fp32_greedy_output_is_the_same_with_and_without_background_compile(tiny_fp32, monkeypatch):
    """The tiny model at fp32: an engine whose drafting program becomes available after its fourth decode call
    (plain calls until then, then the policy's drafting measurements) emits the greedy tokens of one that compiled
    every program before serving."""
    import numpy as np
    r = np.random.default_rng(3)
    prompts = [[int(x) for x in r.integers(4, 512, size=int(r.integers(3, 50)))] for _ in range(6)]
    want, ref_calls = _serve(LLMEngine(tiny_fp32, background_compile=False, **OPTS), prompts, "w", max_tokens=16)
    release = _hold(monkeypatch)
    try:
        eng = LLMEngine(tiny_fp32, **OPTS)
        assert not eng.programs_ready

        def compiled_after_four(n):
            if n == 5:
                release.set()
                assert eng.wait_for_programs(600)

        got, calls = _serve(eng, prompts, "g", max_tokens=16, on_decode=compiled_after_four)
    finally:
        release.set()
    assert got == want
    assert set(calls[:4]) == {0} and eng.k in calls[4:], calls
    assert eng.k in ref_calls and eng.compiles_after_warmup == 0
