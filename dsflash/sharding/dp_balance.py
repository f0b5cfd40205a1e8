"""Data-parallel load balancing across DP ranks (attention DP + EP MoE), SERVING §3.

* :class:`DPLoadBalancer` - the front-end's request router: least-loaded rank by
  ``score = 4 * waiting + running``; ties spread round-robin (the scan starts after the last pick);
  optional pinning (``X-data-parallel-rank``); after a pick it optimistically bumps its local copy of
  that rank's waiting count (by the number of front-end clients) so a burst that arrives between two
  stats updates does not all land on one rank. :meth:`update` takes the authoritative counts the
  coordinator publishes.
* :func:`plan_step` - the per-step DP synchronisation: every rank's token count -> one padded count
  (max across ranks, rounded up to a bucket) so shapes match across ranks and the jitted step is
  reused; while *any* rank has work, idle ranks run a **dummy step** (EP collectives need every
  rank; dummy rows carry ``valid=False`` so EPLB does not record them, but the EPLB step counter
  advances); when every rank is idle nobody steps.
* :class:`IdleDetector` - the cheap global-idle check done only every ``every`` steps (32 in vLLM).
* :func:`simulate` - a discrete-time model of DP ranks with a bursty arrival trace (tests, bench).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


class DPLoadBalancer:
    def __init__(self, num_ranks: int, client_index: int = 0, num_clients: int = 1, waiting_weight: int = 4):
        if num_ranks < 1:
            raise ValueError("DPLoadBalancer: num_ranks must be >= 1")
        self.n = num_ranks
        self.num_clients = num_clients
        self.waiting_weight = waiting_weight
        self.waiting = [0] * num_ranks
        self.running = [0] * num_ranks
        self._start = client_index % num_ranks   # per-client offset: several front-ends spread ties too

    def score(self, rank: int) -> int:
        return self.waiting_weight * self.waiting[rank] + self.running[rank]

    def update(self, rank: int, waiting: int, running: int) -> None:
        """Authoritative counts from the coordinator (replace the optimistic local ones)."""
        self.waiting[rank], self.running[rank] = int(waiting), int(running)

    def update_all(self, counts: Sequence[tuple[int, int]]) -> None:
        for r, (w, u) in enumerate(counts):
            self.update(r, w, u)

    def choose(self, pinned: int | None = None) -> int:
        if pinned is not None:
            if not 0 <= pinned < self.n:
                raise ValueError(f"DPLoadBalancer: pinned rank {pinned} not in [0, {self.n})")
            rank = pinned
        else:
            best, rank = None, self._start
            for i in range(self.n):
                r = (self._start + i) % self.n
                s = self.score(r)
                if best is None or s < best:
                    best, rank = s, r
            self._start = (rank + 1) % self.n
        self.waiting[rank] += self.num_clients
        return rank


class RoundRobin:
    """Baseline router (same interface)."""

    def __init__(self, num_ranks: int):
        self.n, self._next = num_ranks, 0

    def update(self, rank, waiting, running):
        pass

    def update_all(self, counts):
        pass

    def choose(self, pinned: int | None = None) -> int:
        if pinned is not None:
            return pinned
        r = self._next
        self._next = (r + 1) % self.n
        return r


# ------------------------------------------------------------------------- per-step synchronisation
def pad_to_max(counts: Sequence[int], multiple: int = 1, buckets: Sequence[int] | None = None) -> int:
    """The token count every rank pads its step to: max across ranks, rounded up to ``multiple`` and then
    to the smallest bucket that fits (the largest bucket if none does... is an error)."""
    m = max(int(c) for c in counts) if len(counts) else 0
    m = max(1, int(math.ceil(m / multiple)) * multiple)
    if buckets:
        fit = [b for b in sorted(buckets) if b >= m]
        if not fit:
            raise ValueError(f"pad_to_max: {m} tokens exceed the largest bucket {max(buckets)}")
        m = fit[0]
    return m


@dataclass(frozen=True)
class StepPlan:
    run: bool                   # False: every rank is idle, nobody steps
    padded_tokens: int          # per-rank token rows of this step (identical on every rank)
    dummy: tuple                # per rank: True = run a dummy step (no real work)
    tokens: tuple               # per rank: real tokens

    def valid_mask(self, rank: int) -> np.ndarray:
        """Rows of ``rank`` that carry real tokens (False rows: padding/dummy; not recorded by EPLB)."""
        v = np.zeros(self.padded_tokens, bool)
        v[: self.tokens[rank]] = True
        return v


def plan_step(tokens_per_rank: Sequence[int], multiple: int = 1, buckets: Sequence[int] | None = None) -> StepPlan:
    t = tuple(int(x) for x in tokens_per_rank)
    if not any(t):
        return StepPlan(False, 0, tuple(False for _ in t), t)
    return StepPlan(True, pad_to_max(t, multiple, buckets), tuple(x == 0 for x in t), t)


class IdleDetector:
    """Global-idle detection by an all-reduce done only every ``every`` steps (vLLM: 32): returns True when
    the ranks may stop stepping (wave ends). Up to ``every - 1`` dummy steps follow the last request."""

    def __init__(self, every: int = 32):
        self.every, self.count = every, 0

    def step(self, any_rank_has_work: bool) -> bool:
        self.count += 1
        if self.count % self.every:
            return False
        return not any_rank_has_work


# ------------------------------------------------------------------------- simulation
@dataclass
class _Rank:
    waiting: list = field(default_factory=list)    # (request id, arrival step, service steps)
    running: list = field(default_factory=list)    # [request id, remaining steps]
    steps: int = 0
    dummy_steps: int = 0


def bursty_trace(num_steps: int, seed: int = 0, base_rate: float = 0.6, burst_every: int = 50,
                 burst_size: int = 24, mean_service: float = 20.0) -> list[tuple[int, int]]:
    """(arrival step, service steps) of each request: Poisson background + periodic bursts, heavy-tailed
    (lognormal) service times."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(num_steps):
        n = rng.poisson(base_rate) + (burst_size if s % burst_every == 0 and s else 0)
        for _ in range(n):
            svc = max(1, int(rng.lognormal(np.log(mean_service) - 0.5, 1.0)))
            out.append((s, svc))
    return out


def simulate(router, trace, num_ranks: int, max_running: int = 8, stats_interval: int = 5,
             num_steps: int | None = None) -> dict:
    """Run ``trace`` through ``router`` on ``num_ranks`` ranks, each running at most ``max_running``
    requests per step (one decode token each). Stats reach the router every ``stats_interval`` steps.
    Every step where any rank has work, idle ranks run dummy steps. Returns queue-length and wait stats
    plus per-rank step counters (equal when ranks stay in lockstep)."""
    ranks = [_Rank() for _ in range(num_ranks)]
    by_step: dict[int, list] = {}
    for i, (a, svc) in enumerate(trace):
        by_step.setdefault(a, []).append((i, a, svc))
    horizon = num_steps or (max(a for a, _ in trace) + 1 + sum(s for _, s in trace))
    waits, queue_len = [], []
    done = 0
    step = 0
    while step < horizon and (done < len(trace)):
        for req in by_step.get(step, []):
            ranks[router.choose()].waiting.append(req)
        for r in ranks:  # admission
            while r.waiting and len(r.running) < max_running:
                rid, a, svc = r.waiting.pop(0)
                waits.append(step - a)
                r.running.append([rid, svc])
        plan = plan_step([len(r.running) for r in ranks])
        if plan.run:
            for i, r in enumerate(ranks):
                r.steps += 1
                r.dummy_steps += plan.dummy[i]
                for job in r.running:
                    job[1] -= 1
                fin = [j for j in r.running if j[1] <= 0]
                done += len(fin)
                r.running = [j for j in r.running if j[1] > 0]
        queue_len.append(sum(len(r.waiting) for r in ranks))
        step += 1
        if step % stats_interval == 0:
            router.update_all([(len(r.waiting), len(r.running)) for r in ranks])
    w = np.asarray(waits, float)
    return {"mean_queue": float(np.mean(queue_len)), "p90_wait": float(np.percentile(w, 90)),
            "mean_wait": float(w.mean()), "finished": done, "steps": [r.steps for r in ranks],
            "dummy_steps": [r.dummy_steps for r in ranks], "sim_steps": step}
