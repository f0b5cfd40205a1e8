"""DP load balancer: least-loaded by 4*waiting + running, ties spread, pinning, optimistic increments;
per-step padding; dummy steps keep EP ranks in lockstep."""
import numpy as np
import pytest

from dsflash.sharding import eplb
from dsflash.sharding.dp_balance import (DPLoadBalancer, IdleDetector, RoundRobin, bursty_trace, pad_to_max,
                                         plan_step, simulate)


def test_least_loaded_score():
    lb = DPLoadBalancer(3)
    lb.update_all([(1, 0), (0, 3), (0, 5)])      # scores 4, 3, 5
    assert lb.choose() == 1
    assert lb.waiting == [1, 1, 0]                # optimistic bump of the chosen rank's waiting count
    assert lb.choose() == 0                       # scores now 4, 7, 5 -> rank 0


def test_ties_spread_round_robin_and_optimistic_bursts():
    lb = DPLoadBalancer(4)
    picks = [lb.choose() for _ in range(8)]       # no stats update in between: a burst
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]
    lb2 = DPLoadBalancer(4, client_index=2, num_clients=2)
    assert lb2.choose() == 2 and lb2.waiting[2] == 2   # second front-end starts its scan elsewhere


def test_pinning():
    lb = DPLoadBalancer(4)
    lb.update_all([(0, 0), (9, 9), (0, 0), (0, 0)])
    assert lb.choose(pinned=1) == 1 and lb.waiting[1] == 10
    with pytest.raises(ValueError, match="pinned"):
        lb.choose(pinned=4)


def test_pad_to_max_and_plan_step():
    assert pad_to_max([3, 17, 0, 5]) == 17
    assert pad_to_max([3, 17, 0, 5], multiple=8) == 24
    assert pad_to_max([3, 17], buckets=[8, 16, 32, 64]) == 32
    with pytest.raises(ValueError, match="bucket"):
        pad_to_max([100], buckets=[8, 16])
    p = plan_step([0, 5, 2, 0], multiple=4)
    assert p.run and p.padded_tokens == 8 and p.dummy == (True, False, False, True)
    assert p.valid_mask(2).tolist() == [True, True] + [False] * 6
    assert p.valid_mask(0).sum() == 0
    assert not plan_step([0, 0, 0, 0]).run


def test_least_loaded_beats_round_robin_on_bursty_trace():
    trace = bursty_trace(1500, seed=0, base_rate=2.0, burst_size=40)
    ll = simulate(DPLoadBalancer(8), trace, 8, max_running=8, stats_interval=5)
    rr = simulate(RoundRobin(8), trace, 8, max_running=8, stats_interval=5)
    print(f"\nbursty trace ({len(trace)} requests, 8 ranks): least-loaded mean queue {ll['mean_queue']:.2f} "
          f"p90 wait {ll['p90_wait']:.1f} | round-robin mean queue {rr['mean_queue']:.2f} p90 wait {rr['p90_wait']:.1f}")
    assert ll["finished"] == rr["finished"] == len(trace)
    assert ll["mean_queue"] < 0.7 * rr["mean_queue"]
    assert ll["p90_wait"] < rr["p90_wait"]


def test_dummy_steps_keep_ranks_in_lockstep_and_are_not_recorded():
    trace = bursty_trace(300, seed=1, base_rate=0.3, burst_size=10)
    res = simulate(DPLoadBalancer(4), trace, 4, max_running=4)
    assert len(set(res["steps"])) == 1           # every rank executed the same number of forwards
    assert sum(res["dummy_steps"]) > 0           # some of them dummy
    # EPLB side: dummy steps advance the interval counter, but their load is not recorded
    st = eplb.EplbState(1, 4, 4, eplb.EplbConfig(window_size=10, step_interval=100))
    plans = [plan_step([2, 0, 1, 0]), plan_step([0, 0, 3, 0])]
    for p in plans:
        load = np.zeros((1, 4), np.int32)
        for rank in range(4):
            load[0, rank] += p.valid_mask(rank).sum()   # rows of rank r routed to its expert r
        st.record(load, dummy=False)
    st.record(np.zeros((1, 4), np.int32), dummy=True)
    assert st.step == 3 and st.recorded_steps == 2
    assert st.window_load().tolist() == [[2, 0, 4, 0]]


def test_idle_detector_every_32():
    d = IdleDetector(32)
    flags = [d.step(any_rank_has_work=False) for _ in range(64)]
    assert [i for i, f in enumerate(flags) if f] == [31, 63]
    d = IdleDetector(4)
    assert [d.step(True) for _ in range(4)] == [False] * 4
