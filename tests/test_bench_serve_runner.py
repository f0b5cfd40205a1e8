"""The closed-loop runner of ``bench serve`` (one concurrency point) with a fake in-process client:
concurrency = live lanes, the warm-up barrier, the request budget, and a crashing lane."""
from __future__ import annotations

import asyncio
import time

from dsflash.bench.serve import PointRun
from dsflash.bench.serve_metrics import RequestRecord
from dsflash.bench.workloads import FixedConfig, FixedWorkload


class FakeClient:
    def __init__(self, delay: float):
        self.delay = delay
        self.live = 0
        self.max_live = 0
        self.calls = []

    async def run(self, spec, request_id):
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        st = time.perf_counter()
        self.calls.append((spec.lane, spec.warmup, st))
        await asyncio.sleep(self.delay)
        self.live -= 1
        t = time.perf_counter()
        return RequestRecord(request_id=request_id, lane=spec.lane, warmup=spec.warmup, start_time=st, end_time=t,
                             success=True, ttft=t - st, latency=t - st, output_tokens=1, generated_text="x")


def run_point(workload, client, conc, **kw):
    kw = {"budget": None, "duration": None, "warmup_timeout": 5, "drain_timeout": 5, **kw}
    return asyncio.run(PointRun(workload, client, conc, **kw).run())


def test_closed_loop_budget_and_barrier():
    wl = FixedWorkload(FixedConfig(input_len=4, output_len=1, warmup_requests=2))
    client = FakeClient(0.01)
    out = run_point(wl, client, 3, budget=12)
    recs = out["records"]
    assert client.max_live == 3                                   # never more than the live lanes
    assert sum(not r.warmup for r in recs) == 12                  # the measured budget, exactly
    assert sum(r.warmup for r in recs) == 3 * 2
    # every measured request starts after every warm-up request has ended (the barrier)
    last_warm_end = max(r.end_time for r in recs if r.warmup)
    assert all(r.start_time >= last_warm_end for r in recs if not r.warmup)
    assert out["window_start"] >= last_warm_end
    assert out["window_end"] == max(r.end_time for r in recs if not r.warmup)
    assert out["notes"] == []


def test_duration_stops_issuing():
    wl = FixedWorkload(FixedConfig(input_len=4, output_len=1, warmup_requests=0))
    out = run_point(wl, FakeClient(0.02), 2, duration=0.2)
    measured = [r for r in out["records"] if not r.warmup]
    assert all(r.start_time <= out["window_start"] + 0.2 + 0.015 for r in measured)
    assert 0.2 <= out["window_end"] - out["window_start"] < 0.3
    assert 10 <= len(measured) <= 24


class CrashingWorkload(FixedWorkload):
    async def run_lane(self, ctx):
        if ctx.lane == 1:
            raise RuntimeError("workload bug")
        await super().run_lane(ctx)


def test_a_crashing_lane_is_reported_not_hung():
    wl = CrashingWorkload(FixedConfig(input_len=4, output_len=1, warmup_requests=1))
    out = run_point(wl, FakeClient(0.005), 3, budget=6)
    assert any("lane 1: RuntimeError: workload bug" in n for n in out["notes"])
    assert sum(not r.warmup for r in out["records"]) == 6
    assert {r.lane for r in out["records"]} == {0, 2}
