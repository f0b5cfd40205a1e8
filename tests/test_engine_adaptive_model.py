"""Adaptive speculation on the real tiny model: switching between the drafting and the plain program (lazy draft
context: the plain one skips the draft's context update, drafting catches it up) keeps greedy output plain
decoding's at fp32 and compiles nothing after warm-up; no decode call drafts where that would displace prefill."""
import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.engine.adaptive import SpeculationPolicy
from dsflash.serve.engine.backend import ModelBackend
from dsflash.serve.engine.scheduler import DECODE
from dsflash.serve.types import SamplingParams
from test_engine_model import prompts
from test_engine_scheduler import run_all

# every program compiled before the engine serves (background_compile=False): these tests count which program ran
OPTS = dict(max_num_seqs=4, max_model_len=96, page_size=16, max_num_batched_tokens=64, decode_steps=2,
            prefill_buckets=[(2, 32)], enable_prefix_caching=False, background_compile=False)


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


@pytest.fixture(scope="module")
def fp32(model):
    """(plain engine, adaptive engine) on the tiny model at fp32, compiled once for this module's tests."""
    be = ModelBackend(model, precision="fp32")
    return LLMEngine(be, speculative_mode="off", **OPTS), LLMEngine(be, **OPTS)


@pytest.mark.slow
def test_fp32_switching_with_lazy_draft_context_equals_plain(fp32):
    plain, eng = fp32
    items = [(f"a{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
             for i, p in enumerate(prompts(6, seed=3, lo=3, hi=50))]
    want = run_all(plain, items)
    assert eng.runner.lazy_ctx and eng.runner.draft_lengths == (0, eng.k)
    flip(eng, 3)
    got = run_all(eng, items)
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    m = eng.metrics_snapshot()
    assert m["spec_num_drafts"] > 0 and 0.2 < m["spec_drafted_call_fraction"] < 0.5
    assert m["compiles_after_warmup"] == 0


def _trace_schedule(eng):
    """Per step: (decode rows before it, drafting would shrink its prefill, its decode call's draft length or None,
    its prefill tokens, ``prefill_room`` at its tokens per decode iteration)."""
    sch, trace, schedule = eng.scheduler, [], eng.scheduler.schedule

    def traced():
        rows = any(s.status == DECODE for s in sch.running)
        room = {K1: sch.prefill_room(K1) for K1 in (1, eng.k + 1)}
        plan = schedule()
        n = sum(n for _, n in plan.prefill[1]) if plan.prefill else 0
        trace.append((rows, room[eng.k + 1] < room[1], plan.K1 - 1 if plan.decode else None, n, room[plan.K1]))
        return plan
    sch.schedule = traced
    return trace


@pytest.mark.slow
def test_no_decode_call_drafts_in_a_step_that_prefills(fp32):
    """Issue 23: 8 requests, 4 slots, a 64-token budget; prompts of 50-80 tokens are prefilled while others decode.
    The cost model is forced to favour drafting: every decode call over running rows then drafts except those of a
    step that prefills (adaptive.py "Prefill first": where drafting (block 3: 4 budget tokens a row) would take
    tokens from the prefill, and where the budget has room for both), and greedy output is plain decoding's (fp32,
    sequential verify)."""
    plain, eng = fp32
    items = [(f"p{i}", [5 + (7 * i + j) % 400 for j in range(50 + 4 * i)],
              SamplingParams(max_tokens=6 + 3 * (i % 3), temperature=0.0, ignore_eos=True)) for i in range(8)]
    want = run_all(plain, items)
    eng.speculation = pol = SpeculationPolicy(eng.k, "adaptive")
    pol._decide = lambda accepted: eng.k                 # the costs say: draft
    trace = _trace_schedule(eng)
    got = run_all(eng, items)
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    calls = [(n, displaced, d) for rows, displaced, d, n, _ in trace if rows and d is not None]
    assert all(d == 0 for n, _, d in calls if n), trace
    assert all(d == eng.k for n, _, d in calls if not n), trace
    assert sum(1 for n, *_ in calls if n) >= 2 and sum(d == eng.k for *_, d in calls) >= 2, trace
    assert any(displaced for n, displaced, _ in calls if n), trace         # both cases of the rule ran
    assert any(not displaced for n, displaced, _ in calls if n), trace
    # the room is what the step prefilled (an upper bound in general: here no prefix cache, pages enough)
    assert all(n == room for *_, n, room in trace), trace
    m = eng.metrics_snapshot()
    assert m["spec_calls_plain_for_prefill"] == sum(1 for n, *_ in calls if n) > 0
    assert m["compiles_after_warmup"] == 0


def _forced(eng, items, draft_len):
    """Every decode call with draft length ``draft_len``: token ids and logprobs (chosen + top) per request."""
    eng.speculation._decide = lambda accepted: draft_len
    out = run_all(eng, [(f"{draft_len}-{rid}", p, sp) for rid, p, sp in items])
    return {k.split("-", 1)[1]: (o.outputs[0].token_ids, o.outputs[0].logprobs) for k, o in out.items()}


@pytest.mark.slow
def test_reference_greedy_identical_with_drafting_forced_on_and_off():
    """At "reference" the verify forward used to round some rows differently from the plain one (demo model, 8 slots:
    3 of these 16 requests changed with the draft length); with sequential verify (the CPU default of adaptive
    speculation) each row is the plain program's, so token ids and logprobs are bitwise the same."""
    import dsflash
    import numpy as np
    from dsflash.api import SHIPPED
    eng = LLMEngine(dsflash.load("demo"), max_num_seqs=8, max_model_len=256, page_size=64,
                    max_num_batched_tokens=256, enable_prefix_caching=False, background_compile=False)
    assert eng.config.speculative_mode == "adaptive" and eng.runner.sequential_verify
    rows = np.load(SHIPPED["demo"] + "/heldout_rows.npy")
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
    items = [(str(i), [int(x) for x in rows[i, :40 + (i * 7) % 60]], sp) for i in range(16)]
    plain = _forced(eng, items, 0)
    drafted = _forced(eng, items, eng.k)
    assert eng.metrics_snapshot()["spec_num_accepted_tokens"] > 0
    assert drafted == plain



@pytest.mark.slow
def test_seeded_sampling_identical_with_drafting_forced_on_and_off():
    """A request with a ``seed`` promises its sample whatever else runs; under adaptive speculation the draft
    length follows timings and a verified row's tokens come from the rejection sampler's other draws, so seeded
    sampled rows never draft there (CI caught two P/D servers disagreeing on such a request). Unseeded rows in
    the same calls keep drafting."""
    import dsflash
    import numpy as np
    from dsflash.api import SHIPPED
    eng = LLMEngine(dsflash.load("demo"), max_num_seqs=8, max_model_len=256, page_size=64,
                    max_num_batched_tokens=256, enable_prefix_caching=False, background_compile=False)
    rows = np.load(SHIPPED["demo"] + "/heldout_rows.npy")
    items = []
    for i in range(8):
        seeded = i % 2 == 0
        sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, ignore_eos=True, logprobs=1,
                            seed=1234 + i if seeded else None)
        items.append((str(i), [int(x) for x in rows[i, :40 + (i * 7) % 60]], sp))
    plain = _forced(eng, items, 0)
    drafted = _forced(eng, items, eng.k)
    assert eng.metrics_snapshot()["spec_num_drafts"] > 0        # the unseeded rows drafted
    for i in range(0, 8, 2):
        assert drafted[str(i)] == plain[str(i)], i


@pytest.mark.slow
def test_fp32_tap_free_stretches_keep_greedy_output_and_acceptance(fp32):
    """Long plain stretches run the tap-free plain program (no taps recorded); the calls before each scheduled probe
    record again, so every drafting call's catch-up has the ring it needs: greedy output is plain decoding's, and
    the drafts and their acceptance are an always-recording engine's (``tap_free_plain=False``)."""
    from dsflash.serve.engine.runner import TAP_FREE
    plain, eng = fp32
    items = [(f"t{i}", p, SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True))
             for i, p in enumerate(prompts(6, seed=5, lo=3, hi=30))]
    want = run_all(plain, items)
    res = {}
    for tap_free in (True, False):
        e = eng if tap_free else LLMEngine(eng.backend, tap_free_plain=False, **OPTS)
        assert e.runner.tap_free == tap_free
        e.speculation = pol = SpeculationPolicy(e.k, "adaptive", reprobe_every=5, remeasure_every=10**6)
        pol.sequential_verify = e.runner.sequential_verify
        for c in pol.costs.values():      # measured; drafting 50x plain: only the engine-wide reprobe drafts
            c.seconds, c.samples, c.alpha = 1e-3, pol.probe_calls, 0.0
        pol.costs[e.k].ratio, pol.backoff = 50.0, 4
        calls, decode = [], e.runner.decode
        m0 = e.metrics_snapshot()         # the module's engine has served other tests: count this run's only
        e.runner.decode = lambda inp, draft_len=None, calls=calls, decode=decode: (
            calls.append(draft_len), decode(inp, draft_len))[1]
        try:
            got = run_all(e, items)
        finally:
            e.runner.decode = decode
        for rid in want:
            assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, (tap_free, rid)
        m = e.metrics_snapshot()
        assert m["compiles_after_warmup"] == 0
        res[tap_free] = ([max(d, 0) for d in calls], m["spec_num_drafts"] - m0["spec_num_drafts"],
                         m["spec_num_accepted_tokens"] - m0["spec_num_accepted_tokens"])
        if tap_free:
            assert calls.count(TAP_FREE) >= 4 and m["spec_tap_free_calls"] == calls.count(TAP_FREE)
    assert res[True] == res[False] and res[True][1] > 0
