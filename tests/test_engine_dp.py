"""DP ranks in the engine (docs/engine.md "Data-parallel ranks"): per-rank slot / page ranges, the DP load
balancer in front of admission, per-rank step planning with dummy rows for idle ranks.

Toy-backend tests use logical ranks (``data_parallel_size=2``, one device: same pools, balancer and row
layout, cheap compiles). The real tiny model runs on ``dep=2`` over two faked CPU devices
(tests/conftest.py fakes 8; with fewer the test re-runs itself in a child process) in fp32 and must give
the single-device engine's greedy tokens (docs/sharding.md explains why not bf16)."""

import contextlib

import jax
import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.engine.testing import ToyBackend
from dsflash.serve.types import SamplingParams
import multi_device
from multi_device import TINY_ENGINE, prompts, rerun_in_child

TOY = dict(max_num_seqs=4, max_model_len=96, page_size=8, max_num_batched_tokens=48, decode_steps=3,
           prefill_buckets=[(1, 16), (2, 12), (1, 48)])
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def check_ranges(eng):
    """Every live sequence's slot, pages and page-table row lie in its rank's ranges."""
    S, N, D = eng.max_num_seqs, eng.pool.num_pages, eng.dp
    for s in eng.running:
        r = s.rank
        assert r * S // D <= s.slot < (r + 1) * S // D, (s.request_id, r, s.slot)
        assert all(r * N // D <= p < (r + 1) * N // D for p in s.pages), (s.request_id, r, s.pages)
        assert all(eng.rank_pools[r].owns(p) for p in s.pages)
        assert list(eng.runner.mirror.pt[s.slot, :len(s.pages)]) == s.pages


def run_all(eng, items, check=True):
    """items: (rid, prompt, params, dp_rank); all added at once (ranges checked every step). {rid: token ids}."""
    return multi_device.run_all(eng, items, check_ranges if check else None)


@contextlib.contextmanager
def capture_calls(eng):
    """Record the host inputs of every device call (the batch the runner receives) while in the block."""
    calls = []
    run = eng.runner
    orig = run.prefill, run.decode
    run.prefill = lambda inp: (calls.append(("prefill", inp)), orig[0](inp))[1]
    run.decode = lambda inp, *a: (calls.append(("decode", inp)), orig[1](inp, *a))[1]
    try:
        yield calls
    finally:
        del run.prefill, run.decode


def check_dummy_rank(eng, calls, idle):
    """In every call, the idle rank's rows are dummy rows (nothing valid, nothing written) in its own range."""
    D, S = eng.dp, eng.max_num_seqs
    saw = 0
    for kind, inp in calls:
        if kind == "prefill":
            rb = inp["tokens"].shape[0] // D
            rows = slice(idle * rb, (idle + 1) * rb)
            assert (inp["lengths"][rows] == 0).all() and (inp["row_slot"][rows] == S).all()
            assert ((inp["slots"][rows] >= idle * S // D) & (inp["slots"][rows] < (idle + 1) * S // D)).all()
        else:
            rows = slice(idle * S // D, (idle + 1) * S // D)
            assert (inp["row_steps"][rows] == 0).all()
        saw += 1
    return saw


# ---------------------------------------------------------------------------------------- toy backend
@pytest.fixture(scope="module")
def toy_ref():
    return LLMEngine(ToyBackend(), speculative=True, speculative_mode="always", **TOY)


@pytest.fixture(scope="module")
def toy_dp():
    return LLMEngine(ToyBackend(), speculative=True, speculative_mode="always", data_parallel_size=2, **{**TOY, "max_num_seqs": 8})


def test_toy_ranks_equal_single_and_stay_in_range(toy_ref, toy_dp):
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    items = [(f"a{i}", p, GREEDY if i % 3 else sampled, None) for i, p in enumerate(prompts(12, seed=1))]
    want = run_all(toy_ref, items, check=False)
    toy_dp.reset_prefix_cache()
    got = run_all(toy_dp, items)
    assert got == want
    snap = toy_dp.metrics_snapshot()
    assert snap["dp_size"] == 2 and set(snap["dp_ranks"]) == {"0", "1"}
    assert toy_dp.runner.prefill_buckets[0][0] % 2 == 0        # compiled as [D * rows, tokens]
    # the server's /metrics exports the per-rank entries (nested dicts flattened)
    from dsflash.serve.http.metrics import ServerMetrics
    text = ServerMetrics(toy_dp.metrics_snapshot).render().decode()
    for name in ("dp_size", "dp_dummy_rows", "dp_ranks_0_num_running", "dp_ranks_1_num_waiting",
                 "dp_ranks_1_kv_usage", "dp_ranks_0_dummy_calls"):
        assert f"dsflash_engine_{name} " in text, name


def test_toy_balancer_spreads_burst_and_honours_pins(toy_dp):
    eng = toy_dp
    ps = prompts(10, seed=2)
    for i in range(8):
        eng.add_request(f"b{i}", ps[i], GREEDY)
    eng.add_request("pin1", ps[8], GREEDY, dp_rank=1)
    eng.add_request("pin0", ps[9], SamplingParams(max_tokens=5, n=2, temperature=0.0), dp_rank=0)
    ranks = {rid: [s.rank for s in seqs] for rid, seqs in eng.groups.items()}
    burst = [ranks[f"b{i}"][0] for i in range(8)]
    assert sorted(burst) == [0] * 4 + [1] * 4 and burst[:2] in ([0, 1], [1, 0])   # ties spread
    assert ranks["pin1"] == [1] and ranks["pin0"] == [0, 0]
    eng.step()          # the scheduler publishes the per-rank counts to the balancer every step
    for r in range(2):
        w = sum(1 for s in eng.waiting if s.rank == r)
        u = sum(1 for s in eng.running if s.rank == r)
        assert (eng.balancer.waiting[r], eng.balancer.running[r]) == (w, u)
        assert eng.metrics.dp_num_waiting[r] == w and eng.metrics.dp_num_running[r] == u
        assert u == 4 and w == 2 - r     # 4 slots per rank: rank 0 holds 6 sequences, rank 1 holds 5
    while eng.has_unfinished_requests():
        eng.step()
        check_ranges(eng)


def test_toy_prefix_cache_hits_only_within_a_rank(toy_dp):
    eng = toy_dp
    eng.reset_prefix_cache()
    p = prompts(1, seed=3, lo=40, hi=41)[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    hits = []
    for i, rank in enumerate((0, 1, 0)):
        h0 = eng.metrics.prefix_hit_tokens
        run_all(eng, [(f"c{i}", p, sp, rank)])
        hits.append(eng.metrics.prefix_hit_tokens - h0)
    assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0


def test_toy_idle_rank_runs_dummy_rows_and_preempts_per_rank(toy_ref):
    # rank 0 gets everything (pinned), with a pool that forces preemption; rank 1 idles on dummy rows
    eng = LLMEngine(ToyBackend(), speculative=True, speculative_mode="always", data_parallel_size=2, num_pages=28, async_scheduling=True,
                    **{**TOY, "max_num_seqs": 8})
    ps = prompts(6, seed=3, lo=20, hi=40)
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = run_all(toy_ref, [(f"p{i}", p, sp, None) for i, p in enumerate(ps)], check=False)
    with capture_calls(eng) as calls:
        got = run_all(eng, [(f"p{i}", p, sp, 0) for i, p in enumerate(ps)])
    assert got == want
    assert eng.metrics.num_preemptions > 0
    n = check_dummy_rank(eng, calls, idle=1)
    assert n == eng.metrics.dp_dummy_calls[1] and eng.metrics.dp_dummy_calls[0] == 0
    assert eng.metrics_snapshot()["dp_dummy_rows"] > 0
    # everyone idle: nobody steps
    steps = len(calls)
    with capture_calls(eng) as calls2:
        eng.step()
    assert not calls2 and len(calls) == steps


def test_bad_dp_rank_and_indivisible_pools_raise(toy_dp):
    for bad in (2, -1, True, "0", 1.0):
        with pytest.raises(ValueError, match="dp_rank"):
            toy_dp.add_request("bad", [3, 4, 5], GREEDY, dp_rank=bad)
    assert "bad" not in toy_dp.groups
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLMEngine(ToyBackend(), data_parallel_size=2, **{**TOY, "max_num_seqs": 3})
    with pytest.raises(ValueError, match="num_pages"):
        LLMEngine(ToyBackend(), data_parallel_size=2, num_pages=31, **TOY)
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLMEngine(ToyBackend(), data_parallel_size=0, **TOY)
    single = LLMEngine(ToyBackend(), speculative=False, **TOY)
    with pytest.raises(ValueError, match="dp_rank"):
        single.add_request("x", [3, 4], GREEDY, dp_rank=1)
    single.add_request("x", [3, 4], GREEDY, dp_rank=0)         # rank 0 is the only rank


# ---------------------------------------------------------------------------------------- real model, dep=2
MODEL = TINY_ENGINE


def test_tiny_dep2_equals_single_device():
    if rerun_in_child(__file__, "test_tiny_dep2_equals_single_device"):
        return
    from dsflash.sharding.mesh import make_mesh
    ps = prompts(8, seed=5, lo=5, hi=50, vocab=512)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    single = LLMEngine("tiny", background_compile=False, **MODEL)
    want = run_all(single, [(f"r{i}", p, sp, None) for i, p in enumerate(ps)], check=False)
    del single
    eng = LLMEngine("tiny", mesh=make_mesh("dep=2", jax.devices()[:2]), **MODEL)
    # the drafting and tap-free programs compiled in the background on the mesh (lowered on abstract sharded
    # arguments): wait for them, so the calls below draft
    assert eng.dp == 2 and eng.speculative and eng.wait_for_programs(600) and eng.programs_ready
    kv = eng.backend.global_kv_arrays(eng.runner.state)[0]
    assert len(kv.sharding.device_set) == 2 and not kv.sharding.is_fully_replicated
    assert len(eng.runner.rows["y"].sharding.device_set) == 2
    # (a) many concurrent requests (2 slots per rank: queueing, chunked prefill, drafts), balanced ranks
    got = run_all(eng, [(f"r{i}", p, sp, None) for i, p in enumerate(ps)])
    assert got == want
    assert eng.metrics.spec_num_drafts > 0
    # (d) everything pinned to rank 0: rank 1 runs dummy rows in every call; same tokens
    eng.reset_prefix_cache()
    with capture_calls(eng) as calls:
        got = run_all(eng, [(f"r{i}", p, sp, 0) for i, p in enumerate(ps)])
    assert got == want
    assert check_dummy_rank(eng, calls, idle=1) > 0
    snap = eng.metrics_snapshot()
    assert snap["dp_dummy_rows"] > 0 and snap["dp_ranks"]["1"]["dummy_calls"] > 0


def test_tiny_dep8_replicated_draft_equals_single_device():
    """dep=8 with the draft's 4 experts replicated (draft_expert_parallel=False, the server's
    --replicate-draft-experts): the DSpark proposer runs the plain routed MoE, not the EP hook; drafting greedy
    tokens equal the single-device engine's."""
    if rerun_in_child(__file__, "test_tiny_dep8_replicated_draft_equals_single_device"):
        return
    from dsflash.sharding.mesh import make_mesh
    from dsflash.sharding.rules import get_strategy
    opts = {**MODEL, "max_num_seqs": 8}
    ps = prompts(4, seed=6, lo=5, hi=30, vocab=512)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    items = [(f"r{i}", p, sp, None) for i, p in enumerate(ps)]
    want = run_all(LLMEngine("tiny", speculative_mode="always", **opts), items, check=False)
    eng = LLMEngine("tiny", mesh=make_mesh("dep=8"), speculative_mode="always",
                    load_options={"strategy": get_strategy("dep", draft_expert_parallel=False)}, **opts)
    assert eng.speculative and eng.backend.draft_routed_fn is None and eng.backend.routed_fn is not None
    assert run_all(eng, items, check=False) == want
    assert eng.metrics.spec_num_drafts > 0
