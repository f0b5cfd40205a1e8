"""Engine mechanics on the toy backend (cheap model, same state/batch contract as the real one).

The toy's next-token logits read the previous token from the per-slot ring and a global entry through
the page table, so wrong pages, stale ring rows or bad rollbacks change outputs. The real-model tests are
in tests/test_engine_model.py."""
import numpy as np
import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.engine.testing import ToyBackend
from dsflash.serve.types import SamplingParams

COMMON = dict(max_num_seqs=4, max_model_len=96, page_size=8, max_num_batched_tokens=48, decode_steps=3,
              prefill_buckets=[(1, 16), (4, 12), (1, 48)])


def make(spec, **kw):
    # "always": these tests check the drafting path itself (tests/test_engine_adaptive.py: the adaptive default)
    return LLMEngine(ToyBackend(), speculative=spec, **{**COMMON, "speculative_mode": "always" if spec else "off", **kw})


@pytest.fixture(scope="module")
def spec_engine():
    return make(True, async_scheduling=True)


@pytest.fixture(scope="module")
def plain_engine():
    return make(False)   # synchronous (the default); the spec engine schedules asynchronously


def prompts(n, seed=0, lo=3, hi=60):
    r = np.random.default_rng(seed)
    return [[int(x) for x in r.integers(2, 64, size=int(r.integers(lo, hi)))] for _ in range(n)]


def run_all(eng, items):
    """items: list of (rid, prompt, params); all added at once (one continuous batch)."""
    for rid, p, sp in items:
        eng.add_request(rid, p, sp)
    res = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                res[o.request_id] = o
    assert eng.compiles_after_warmup == 0, "the engine compiled after warm-up"
    assert not eng.running and eng.slots.num_free == eng.max_num_seqs
    return res


def test_greedy_speculative_equals_plain(spec_engine, plain_engine):
    ps = prompts(12)
    sp = SamplingParams(max_tokens=14, temperature=0.0)
    items = [(f"g{i}", p, sp) for i, p in enumerate(ps)]
    a = run_all(plain_engine, items)
    m0 = spec_engine.metrics_snapshot()["spec_num_drafts"]
    b = run_all(spec_engine, items)
    for rid in a:
        assert a[rid].outputs[0].token_ids == b[rid].outputs[0].token_ids, rid
        assert a[rid].outputs[0].finish_reason == b[rid].outputs[0].finish_reason
    m = spec_engine.metrics_snapshot()
    assert m["spec_num_drafts"] > m0
    assert 1.0 < m["spec_mean_acceptance_length"] <= 1 + spec_engine.k
    assert 0 < m["spec_acceptance_rate"] < 1
    assert len(m["spec_accepted_per_pos"]) == spec_engine.k
    assert m["ttft_s"] and m["itl_s"]
    assert m["spec_decode_acceptance_rate"] == m["spec_acceptance_rate"]
    for key in ("num_requests_running", "num_requests_waiting", "kv_usage", "prefix_hit_rate", "num_preemptions",
                "spec_decode_mean_acceptance_length", "host_time_mean_s", "kv_bytes_per_token"):
        assert isinstance(m[key], (int, float)), key


def test_same_seed_same_tokens_alone_or_batched(spec_engine, plain_engine):
    ps = prompts(5, seed=1)
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    for eng in (spec_engine, plain_engine):
        alone = run_all(eng, [("alone", ps[0], sp)])["alone"].outputs[0].token_ids
        others = [(f"o{i}", p, SamplingParams(max_tokens=10, temperature=1.0, seed=i)) for i, p in enumerate(ps[1:])]
        batched = run_all(eng, others[:2] + [("mine", ps[0], sp)] + others[2:])["mine"].outputs[0].token_ids
        assert alone == batched
        assert len(alone) == 12


def test_prefix_cache_hits_equal_misses(spec_engine):
    eng = spec_engine
    base = prompts(1, seed=7, lo=40, hi=41)[0]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng.reset_prefix_cache()
    miss = run_all(eng, [("m", base + [5, 6, 7], sp)])["m"]
    eng.reset_prefix_cache()
    h0 = eng.metrics.prefix_hit_tokens
    run_all(eng, [("warm", base + [9], sp)])                       # caches the 40-token prefix (5 pages)
    hit = run_all(eng, [("h", base + [5, 6, 7], sp)])["h"]
    assert eng.metrics.prefix_hit_tokens - h0 == 40
    assert hit.metrics.num_cached_tokens == 40
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert eng.metrics_snapshot()["prefix_hit_rate"] > 0


def test_tiny_pool_preempts_and_completes_everything():
    eng = make(True, num_pages=14, async_scheduling=True)  # one max-length sequence needs 13 pages
    ref = make(True, async_scheduling=False)
    ps = prompts(6, seed=3, lo=20, hi=40)
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    items = [(f"p{i}", p, sp) for i, p in enumerate(ps)]
    got = run_all(eng, items)
    want = run_all(ref, items)
    assert eng.metrics.num_preemptions > 0
    for rid in want:
        assert got[rid].outputs[0].finish_reason == "length"
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids


def test_stop_tokens_logprobs_abort_and_n(spec_engine):
    eng = spec_engine
    p = prompts(1, seed=11)[0]
    free = run_all(eng, [("free", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3))])
    out = free["free"].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    for t, e in zip(out.token_ids, out.logprobs):
        assert e["token_id"] == t and e["logprob"] <= 0 and len(e["top"]) == 3
        assert max(e["top"].values()) == pytest.approx(e["logprob"], abs=1e-5)  # greedy = most likely
    stop_tok = out.token_ids[4]
    first = out.token_ids.index(stop_tok)
    stopped = run_all(eng, [("s", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[stop_tok]))])["s"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok
    assert stopped.token_ids == out.token_ids[:first + 1]
    # abort
    eng.add_request("keep", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    eng.add_request("drop", p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    fin = {o.request_id: o for o in eng.step() if o.finished}
    eng.abort_request("drop")
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                fin[o.request_id] = o
    assert fin["drop"].outputs[0].finish_reason == "abort"
    assert len(fin["keep"].outputs[0].token_ids) == 6
    # n > 1: sample i uses seed + i
    multi = run_all(eng, [("n", p, SamplingParams(max_tokens=5, temperature=1.0, seed=40, n=3))])["n"]
    assert [o.index for o in multi.outputs] == [0, 1, 2]
    single = run_all(eng, [("one", p, SamplingParams(max_tokens=5, temperature=1.0, seed=41))])["one"]
    assert multi.outputs[1].token_ids == single.outputs[0].token_ids


def test_first_tokens_leave_before_their_steps_decode_call(plain_engine):
    """A prompt completing in a step that also decodes joins that decode call; its first token goes to
    ``first_token_hook`` before the call is dispatched (it used to wait for the whole call: on one H200 a 4-iteration
    call is ~19 ms of a lone prompt's ~65 ms TTFT), and the step's own outputs and the tokens are unchanged."""
    eng = make(False)
    seen, order = [], []
    eng.first_token_hook = lambda outs: (seen.extend(outs), order.append("hook"))
    decode = eng.runner.decode

    def spy(*a, **kw):
        order.append("decode")
        return decode(*a, **kw)

    eng.runner.decode = spy
    ps = prompts(3, seed=31)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}

    def step():
        order.append("step")
        for o in eng.step():
            outs[o.request_id] = o

    eng.add_request("a", ps[0], sp)         # alone: its last chunk's step decodes it too
    while not eng.running or eng.running[0].status != "decode":
        step()
    eng.add_request("b", ps[1], sp.replace(logprobs=1))
    eng.add_request("one", ps[2], sp.replace(max_tokens=1))       # finished by its first token
    while eng.has_unfinished_requests():
        step()
    early = {o.request_id: o for o in seen}
    assert set(early) == {"a", "b", "one"}, set(early)
    for rid in ("a", "b"):
        assert len(early[rid].outputs[0].token_ids) == 1 and not early[rid].finished
    assert len(early["b"].outputs[0].logprobs) == 1
    assert early["one"].finished and "one" not in outs               # handed out once, finished
    hooks = [i for i, e in enumerate(order) if e == "hook"]
    assert len(hooks) >= 2 and all(order[i + 1] == "decode" for i in hooks)   # before their step's decode call
    want = run_all(plain_engine, [("a", ps[0], sp), ("b", ps[1], sp.replace(logprobs=1)),
                                  ("one", ps[2], sp.replace(max_tokens=1))])
    for rid in ("a", "b"):
        assert outs[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    assert outs["b"].outputs[0].logprobs == want["b"].outputs[0].logprobs
    assert early["one"].outputs[0].token_ids == want["one"].outputs[0].token_ids
    assert eng.slots.num_free == eng.max_num_seqs


def test_logprobs_are_computed_only_for_the_calls_that_ask(plain_engine, monkeypatch):
    """The top-k over the vocabulary runs only in calls where a running row asks for logprobs (runner
    ``_logprob_outputs``: 0.82 ms of a 6.85 ms H200 decode iteration when every call paid it); rows that ask get
    the same numbers whether or not their batch-mates do."""
    eng = plain_engine
    calls = []
    run_step = eng.runner.run_step

    def spy(*a, **kw):
        pf, dc = run_step(*a, **kw)
        calls.append((pf, dc))
        return pf, dc

    monkeypatch.setattr(eng.runner, "run_step", spy)
    p = prompts(1, seed=5)[0]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    none = run_all(eng, [("none", p, plain)])["none"].outputs[0]
    assert none.logprobs is None
    for pf, dc in calls:       # no row asked: the outputs are the zeros of the skipped branch
        for r in (pf, dc):
            if r is not None:
                assert not np.any(r["top_lp"]) and not np.any(r["lp"])
    calls.clear()
    got = run_all(eng, [("top3", p, plain.replace(logprobs=3)), ("chosen", p, plain.replace(logprobs=0)),
                        ("none2", p, plain)])
    assert any(np.any(dc["top_lp"]) for _, dc in calls if dc is not None)
    top3, chosen = got["top3"].outputs[0], got["chosen"].outputs[0]
    assert got["none2"].outputs[0].logprobs is None and got["none2"].outputs[0].token_ids == none.token_ids
    assert top3.token_ids == chosen.token_ids == none.token_ids
    for a, b in zip(top3.logprobs, chosen.logprobs):
        assert len(a["top"]) == 3 and b["top"] == {}
        assert a["logprob"] == b["logprob"] < 0
        assert max(a["top"].values()) == pytest.approx(a["logprob"], abs=1e-5)


def test_bad_requests_raise_value_error_naming_the_field(plain_engine):
    eng = plain_engine
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("a", [5] * 90, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("b", [5] * 96, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("c", [5, 999], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("d", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("e", "text but no tokenizer", SamplingParams())
    with pytest.raises(ValueError, match="logprobs"):
        eng.add_request("f", [5], SamplingParams(logprobs=20).replace(logprobs=25))
    for field, kw in [("temperature", dict(temperature=-1.0)), ("top_p", dict(top_p=0.0)), ("top_k", dict(top_k=-3)),
                      ("min_p", dict(min_p=2.0)), ("max_tokens", dict(max_tokens=0)), ("seed", dict(seed=-1)),
                      ("presence_penalty", dict(presence_penalty=5.0)), ("n", dict(n=0))]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    eng.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng.waiting and not eng.running


@pytest.mark.parametrize("cap", [None, 64])
def test_mixed_prefill_cap_limits_prefill_in_steps_that_decode(cap):
    """``max_mixed_prefill_tokens``: while a request decodes, a long prompt is prefilled at most ``cap`` tokens a step
    in a bucket of at most ``cap`` rows x tokens (decode rows wait less); with no decode rows it still takes the
    whole budget. Without the cap the mixed steps take ~B tokens in the (1, B) program."""
    eng = LLMEngine(ToyBackend(), max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=256, page_size=16,
                    speculative=False, enable_prefix_caching=False, max_mixed_prefill_tokens=cap)
    assert eng.runner.prefill_buckets == sorted([(4, 64), (1, 256)] + ([(4, 16), (1, 64)] if cap else []),
                                                key=lambda b: (b[0] * b[1], b))
    plans, schedule = [], eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    eng.add_request("lone", [3 + i % 50 for i in range(600)], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.add_request("long", [5 + i % 40 for i in range(600)], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    # decode rows running before the step (not a prompt completing in it, which joins its decode call)
    steps = [(p.prefill[0], sum(n for _, n in p.prefill[1]),
              any(all(s is not c for c, _ in p.prefill[1]) for s, _ in p.decode)) for p in plans if p.prefill]
    assert steps[0] == ((1, 256), 256, False)                      # alone: the whole budget
    mixed = [(b, n) for b, n, dec in steps if dec]
    assert mixed
    if cap:
        assert all(b[0] * b[1] <= cap and n <= cap for b, n in mixed), mixed
    else:
        assert max(n for _, n in mixed) > 64, mixed
