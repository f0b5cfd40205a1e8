"""The Scheduler: owns the queues, the page and slot pools, the prefix cache and every sequence, and turns
them into one ``StepPlan`` per engine step.

Per step: (1) page growth for decoding sequences, oldest first (the youngest running sequence is preempted by
recompute when the pool is full), (2) FCFS admission with prefix-cache lookup and encoder replay, (3) chunked
prefill within the token budget, packed into the compiled bucket that schedules the most tokens. Sequences whose
prompt completes in this step's prefill join the same step's decode call.

DP ranks (``dp > 1``): every sequence has a ``rank``; its slot and pages come from that rank's pools, preemption
picks victims of the same rank, admission is FCFS per rank, and each rank packs its own prefill chunks into its
row range of the global prefill bucket (``_plan_prefill``; one rank is the plain case).

Hooks (``policy``; P/D uses them, ``dsflash/serve/pd/engine.py``): ``after_admit(s)`` runs after an ordinary
admission and may move the sequence on (KV received from elsewhere); ``keep(s)`` is asked before a finished
sequence's pages and slot are freed and may keep them (returns True).
"""
from __future__ import annotations

import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dsflash.serve.engine.kv_cache import OutOfPages, PagePool, PagePoolGroup, SlotPool, SlotPoolGroup, block_hashes
from dsflash.serve.engine.sequence import DECODE, FINISHED, PREFILL, WAITING, Sequence

__all__ = ["Scheduler", "StepPlan", "Sequence", "WAITING", "PREFILL", "DECODE", "FINISHED"]


@dataclass
class StepPlan:
    """What one step runs: ``prefill`` = ``(bucket, chunks [(seq, n)], rows)`` or None; ``decode`` = ``[(seq, h)]``
    (``h`` decode iterations for the sequence). ``prefill_items`` ``[(seq, n, last)]`` is set by ``commit``."""
    prefill: tuple | None = None
    decode: list = field(default_factory=list)
    prefill_items: list = field(default_factory=list)
    K1: int = 1          # tokens per decode iteration this plan's pages / budget assumed (draft length + 1)
    # exact prefix caching (snapshots.py): [(slot, entry, position)] run before / after this step's prefill
    restores: list = field(default_factory=list)
    saves: list = field(default_factory=list)

    def __bool__(self):
        return self.prefill is not None or bool(self.decode)


class Scheduler:
    def __init__(self, *, num_slots: int, num_pages: int, page_size: int, pages_per_seq: int, dp: int,
                 block: int, decode_steps: int, max_num_batched_tokens: int, prefix_caching: bool, prefix_replay,
                 replay_window: int, replay_exact: int, prefill_buckets, mirror, draft_sampling: bool, metrics,
                 seed: int = 0, snapshots=None, prefix_cache_mode: str = "replay", mixed_prefill_tokens=None,
                 snapshot_tail: int = 0):
        self.dp, self.page_size, self.pages_per_seq = dp, page_size, pages_per_seq
        self.K1, self.decode_steps = block + 1, decode_steps
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_caching = prefix_caching
        self._replay_window, self._replay_exact = replay_window, replay_exact
        self.prefix_replay = prefix_replay
        self.prefill_buckets = prefill_buckets      # the runner's compiled buckets, [D * Rb, T]
        self.mixed_prefill_tokens = mixed_prefill_tokens   # per rank, in steps that also decode (None: no cap)
        self.mirror, self.draft_sampling, self.metrics = mirror, draft_sampling, metrics
        self.policy = None
        # exact prefix caching: a SnapshotCache (None: the runner keeps no snapshots) and the mode in use
        self.snapshots = snapshots
        self.prefix_cache_mode = prefix_cache_mode
        # how far past a block boundary a call may end and still snapshot it (snapshots.py "Tail")
        self.snapshot_tail = snapshot_tail
        if dp == 1:
            self.pool = PagePool(num_pages, page_size, prefix_caching)
            self.slots = SlotPool(num_slots)
            self.rank_pools, self.rank_slots = [self.pool], [self.slots]
            self.balancer = None
        else:
            from dsflash.sharding.dp_balance import DPLoadBalancer
            self.pool = PagePoolGroup(num_pages, page_size, prefix_caching, dp)
            self.slots = SlotPoolGroup(num_slots, dp)
            self.rank_pools, self.rank_slots = self.pool.ranks, self.slots.ranks
            self.balancer = DPLoadBalancer(dp)
        self.num_slots = num_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.groups: dict[str, list[Sequence]] = {}     # request id -> its sequences
        self._order = itertools.count()
        self._rng = random.Random(seed)

    @property
    def prefix_replay(self):
        return self._prefix_replay

    @prefix_replay.setter
    def prefix_replay(self, mode):
        """Tokens recomputed in front of a prefix-cache hit: "bounded" (one window, SPEC §6.1), "exact" (every
        layer's window cone), or a count; may change between steps."""
        self._prefix_replay = mode
        self.replay = {"bounded": self._replay_window, "exact": self._replay_exact}.get(mode, mode)

    @property
    def exact(self) -> bool:
        """Hits restore snapshots (falling back to the replay only where none is kept)."""
        return self.prefix_caching and self.snapshots is not None and self.prefix_cache_mode == "exact"

    # ------------------------------------------------------------------ requests
    def draw_seed(self) -> int:
        return self._rng.getrandbits(63)

    def add(self, request_id: str, seqs: list[Sequence], dp_rank: int | None):
        """Queue a request's sequences; a request (all its samples) stays on one DP rank for life."""
        rank = 0
        if self.balancer is not None:
            rank = self.balancer.choose(None if dp_rank is None else int(dp_rank))
            self.balancer.waiting[rank] += len(seqs) - 1
        for s in seqs:
            s.rank = rank
        self.groups[request_id] = seqs
        self.waiting.extend(seqs)

    def finish(self, s: Sequence, reason, stop_reason=None):
        s.finish_reason, s.stop_reason = reason, stop_reason
        if reason == "abort" and s.detok is not None and not s.detok.stopped:
            s.detok.finish()
        if s.status == WAITING:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass
        elif s in self.running:
            self.running.remove(s)
            self.register(s, s.computed if s.status == PREFILL else len(s.all_ids) - 1)
        self.free(s)
        s.status = FINISHED
        now = time.time()
        s.metrics.finished_time = now
        s.metrics.num_generation_tokens = len(s.out_ids)
        if reason != "abort":
            self.metrics.e2e.append(now - s.metrics.arrival_time)

    def retire(self, rid) -> bool:
        """Forget a request whose sequences have all finished."""
        seqs = self.groups.get(rid)
        if seqs and all(s.finished for s in seqs):
            del self.groups[rid]
            self.metrics.requests_finished += 1
            return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ resources
    def free(self, s: Sequence):
        if self.policy is not None and self.policy.keep(s):
            return
        self.release(s)

    def release(self, s: Sequence):
        """Give a sequence's pages and slot back to its rank's pools."""
        if s.pages:
            self.rank_pools[s.rank].free(s.pages)
            s.pages = []
        if s.slot is not None:
            s.last_slot = s.slot
            self.rank_slots[s.rank].free(s.slot)
            self.mirror.reset_pages(s.slot)
            s.slot = None
        s.hashes = []
        if s.snap is not None:           # admitted on a snapshot that was never restored
            self.snapshots.unpin(s.snap)
            s.snap = None

    def _preempt(self, s: Sequence):
        """Recompute preemption: drop the sequence's KV and slot; it re-enters the queue at the front."""
        self.running.remove(s)
        self.free(s)
        s.status = WAITING
        s.computed = 0
        self.waiting.appendleft(s)
        self.metrics.num_preemptions += 1

    def _grow(self, s: Sequence, n_tokens: int) -> bool:
        """Make ``s`` hold pages for positions < n_tokens, preempting the youngest others if needed."""
        need = min(math.ceil(n_tokens / self.page_size), self.pages_per_seq) - len(s.pages)
        pool = self.rank_pools[s.rank]
        while need > 0:
            try:
                new = pool.allocate(need)
            except OutOfPages:
                victims = [v for v in self.running if v is not s and v.rank == s.rank]
                if not victims:
                    return False
                victim = max(victims, key=lambda v: v.order)
                if victim.order < s.order:       # s is the youngest: it yields instead
                    return False
                self._preempt(victim)
                continue
            s.pages.extend(new)
            self.mirror.set_pages(s.slot, len(s.pages) - len(new), new)
            need = 0
        return True

    def admit(self, s: Sequence) -> bool:
        """Slot + pages (prefix-cache hits first) for a waiting sequence; False if they are not free."""
        if not self._admit(s):
            return False
        if self.policy is not None:
            self.policy.after_admit(s)
        return True

    def _admit(self, s: Sequence) -> bool:
        slot = self.rank_slots[s.rank].allocate()
        if slot is None:
            return False
        pool = self.rank_pools[s.rank]
        ids = s.all_ids
        P = self.page_size
        sp = s.params
        # penalties need every earlier token's counts, which a replay from the middle would not see
        penalised = sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
        use_cache = self.prefix_caching and not penalised
        hashes = block_hashes(ids, P, max_blocks=(len(ids) - 1) // P) if use_cache else []
        hit = pool.lookup(hashes)
        need = math.ceil(len(ids) / P) - len(hit)
        if need > pool.num_free:
            pool.free(hit)
            pool.query_blocks -= len(hashes)
            pool.hit_blocks -= len(hit)
            self.rank_slots[s.rank].free(slot)
            return False
        s.slot = slot
        s.pages = hit + pool.allocate(need)
        self.mirror.reset_pages(slot)
        self.mirror.set_pages(slot, 0, s.pages)
        C = len(hit) * P
        s.hashes = hashes[:len(hit)]
        s.exact_state, s.snap = True, None
        start = self._snapshot_start(hashes[:len(hit)]) if C and self.exact else None
        if start is not None:            # exact: restore the state at a boundary, compute from there
            s.computed, s.snap = start
            self.snapshots.pin(s.snap)
            s.floor, s.kv_from = 0, C
            self.metrics.replay_tokens += C - s.computed
            self.metrics.prefix_snapshot_hits += 1
        elif C:
            s.computed = max(0, C - self.replay)
            s.floor, s.kv_from = s.computed, C
            self.metrics.replay_tokens += C - s.computed
            s.exact_state = s.computed == 0          # a replay from the middle is approximate: saves nothing
            if self.exact:               # no snapshot kept for this prefix: the bounded replay, counted
                self.metrics.prefix_snapshot_fallbacks += 1
        else:
            s.computed, s.floor, s.kv_from = 0, 0, 0
        s.prefill_start = s.computed
        s.metrics.num_cached_tokens = max(s.metrics.num_cached_tokens, C)
        self.metrics.prefix_query_tokens += len(ids)
        self.metrics.prefix_hit_tokens += C
        s.status = PREFILL
        s.order = next(self._order)
        if s.metrics.first_scheduled_time is None:
            s.metrics.first_scheduled_time = time.time()
            self.metrics.queue_time.append(s.metrics.first_scheduled_time - s.metrics.arrival_time)
        self.mirror.bind(s, self.draft_sampling)
        self.running.append(s)
        return True

    def _snapshot_start(self, hashes):
        """(position, entry) of the deepest hit boundary with a snapshot, or None. A shallower one than the
        hit is still exact: positions up to the hit are recomputed without rewriting their cached KV."""
        for j in range(len(hashes), 0, -1):
            e = self.snapshots.get(hashes[j - 1])
            if e is not None:
                return j * self.page_size, e
        return None

    def _plan_snapshots(self, plan: StepPlan):
        """Restores for first chunks admitted on a snapshot; saves for chunks of exact sequences that end on a
        block boundary, and at the prompt's last full block boundary when its last chunk runs past it by at most
        ``snapshot_tail`` (the pool entry is registered now, the save runs after this step's prefill)."""
        if plan.prefill is None or self.snapshots is None:
            return
        P = self.page_size
        for s, n in plan.prefill[1]:
            if s.snap is not None and s.computed == s.prefill_start:
                plan.restores.append((s.slot, s.snap, s.computed))
                self.snapshots.unpin(s.snap)   # safe: a later save to this entry launches after the restore
                self.snapshots.restores += 1
                s.snap = None
            if not (self.exact and s.exact_state):
                continue
            e = s.computed + n
            at = [e] if e % P == 0 else []
            last = (len(s.all_ids) - 1) // P * P       # where a repeat of the prompt hits
            if e == len(s.all_ids) and s.computed < last < e and e - last <= self.snapshot_tail:
                at.insert(0, last)                     # inside this chunk: still in the rings after it
            k = len(s.hashes)           # chain hashes of the blocks not registered yet, once for both saves
            new = block_hashes(s.all_ids[k * P:at[-1]], P, parent=s.hashes[-1] if k else None) \
                if at and at[-1] > k * P else []
            for c in at:
                h = new[c // P - k - 1] if c > k * P else s.hashes[c // P - 1]
                entry = self.snapshots.put(h)
                if entry is not None:
                    plan.saves.append((s.slot, entry, c))

    def register(self, s: Sequence, committed: int):
        """Publish the sequence's full blocks below ``committed`` in its rank's prefix cache."""
        if not self.prefix_caching or not s.pages:
            return
        P = self.page_size
        full = committed // P
        if full <= len(s.hashes):
            return
        ids = s.all_ids
        parent = s.hashes[-1] if s.hashes else None
        new = block_hashes(ids[len(s.hashes) * P:full * P], P, parent=parent)
        pool = self.rank_pools[s.rank]
        for j, h in enumerate(new):
            pool.register(s.pages[len(s.hashes) + j], h)
        s.hashes.extend(new)

    # ------------------------------------------------------------------ the step plan
    @staticmethod
    def _wants_decode_row(s: Sequence) -> bool:
        """Whether decoding sequence ``s`` takes a row of the next decode call: not if what is in flight already
        finishes it, nor (guided) while its next mask waits for the token in flight."""
        return s.params.max_tokens - len(s.out_ids) - s.pending_lb > 0 and not (s.guide is not None and s.pending)

    def schedule(self) -> StepPlan:
        K1, P = self.K1, self.page_size
        # 1. decode growth, oldest first (the youngest is preempted when the pool runs dry)
        decode = []
        for s in sorted([s for s in self.running if s.status == DECODE], key=lambda v: v.order):
            if s.status != DECODE:
                continue  # preempted while growing an older sequence
            if not self._wants_decode_row(s):
                continue
            pos = len(s.all_ids) - 2 + s.pending
            rem = s.params.max_tokens - len(s.out_ids) - s.pending_lb
            h = 1 if s.guide is not None else min(self.decode_steps, rem)   # guided: one token per call
            if not self._grow(s, pos + 1 + h * K1):
                if not self._grow(s, pos + 1 + K1):
                    self._preempt(s)
                    continue
            h = min(h, (len(s.pages) * P - 1 - pos) // K1)
            decode.append((s, h))
        decode = [(s, h) for s, h in decode if s.status == DECODE]
        # 2. admission, FCFS per DP rank; 3. prefill chunks of every rank into the best bucket
        self._admit_ranks()
        prefill, decode = self._plan_prefill(decode)
        plan = StepPlan(prefill, decode, K1=K1)
        self._plan_snapshots(plan)
        return plan

    def commit(self, plan: StepPlan):
        """Advance the sequences as if the plan's calls had run (their results are read back later, possibly
        after the next step is dispatched): prefill progress, DECODE on a completed prompt, in-flight tokens."""
        m = self.metrics
        if plan.prefill is not None:
            bucket, chunks, rows = plan.prefill
            if self.dp > 1:
                rb = bucket[0] // self.dp
                self._count_dummy([r // rb for r in rows], rb)
            for s, n in chunks:
                last = s.computed + n == len(s.all_ids)
                s.computed += n
                if last:
                    s.status = DECODE
                    s.pending += 1
                    s.pending_lb += 1
                plan.prefill_items.append((s, n, last))
            m.num_prefill_calls += 1
        if plan.decode:
            if self.dp > 1:
                self._count_dummy([s.rank for s, _ in plan.decode], self.num_slots // self.dp)
            for s, h in plan.decode:
                s.pending += h * self.K1
                s.pending_lb += h
            m.num_decode_calls += 1

    def _join_decode(self, chunks, decode):
        """Sequences whose prompt completes in this step's prefill join the same step's decode call."""
        K1, P = self.K1, self.page_size
        for s, n in chunks:
            if s.computed + n == len(s.all_ids) and s.guide is None:   # guided: the mask needs the first token
                pos = len(s.all_ids) - 1
                h = max(1, min(self.decode_steps, s.params.max_tokens - len(s.out_ids) - 1))
                if s.params.max_tokens - len(s.out_ids) - 1 <= 0:
                    continue
                if self._grow(s, pos + 1 + h * K1) or self._grow(s, pos + 1 + K1):
                    h = min(h, (len(s.pages) * P - 1 - pos) // K1)
                    if h >= 1:
                        decode.append((s, h))
        return [(s, h) for s, h in decode if s in self.running]

    def _admit_ranks(self):
        """FCFS admission per DP rank (one rank: strictly FCFS): a rank stops at its first request that does
        not fit; others go on."""
        blocked = [not p.num_free for p in self.rank_slots]
        admitted = set()
        for s in self.waiting:
            if all(blocked):
                break
            r = s.rank
            if blocked[r]:
                continue
            if s.pending or not self.admit(s):
                blocked[r] = True
            else:
                admitted.add(id(s))
                blocked[r] = not self.rank_slots[r].num_free
        if admitted:
            keep = [s for s in self.waiting if id(s) not in admitted]
            self.waiting.clear()
            self.waiting.extend(keep)

    def _plan_prefill(self, decode):
        """Prefill planning per DP rank. Every rank packs its prefill chunks (admission order, its own token
        budget ``max_num_batched_tokens - its decode rows * (block + 1)``) into the per-rank bucket
        ``(Rb, T)``; the bucket that schedules the most tokens over all ranks wins and compiles as
        ``[D * Rb, T]`` with rank r's chunks in rows ``[r*Rb, r*Rb + n_r)`` (the rest are dummy rows). The
        decode call's rows are the slots, which already lie in their rank's range.
        Returns ``((bucket, chunks, rows) or None, decode)``."""
        D, K1 = self.dp, self.K1
        dec_rows = [0] * D
        for s, _ in decode:
            dec_rows[s.rank] += 1
        pre = [[] for _ in range(D)]
        for s in sorted([s for s in self.running if s.status == PREFILL], key=lambda v: v.order):
            pre[s.rank].append(s)
        best, best_key = None, None
        if any(pre):
            budgets, buckets = self._prefill_budgets(dec_rows, K1)
            align = self.page_size if self.exact else 0
            for bucket in buckets:
                Rb, T = bucket[0] // D, bucket[1]
                plans = [self._pack(pre[r][:Rb], T, budgets[r], align, self.snapshot_tail) for r in range(D)]
                tot = sum(n for plan in plans for _, n in plan)
                key = (tot, -Rb * T)
                if tot and (best_key is None or key > best_key):
                    best, best_key = (bucket, Rb, plans), key
        if best is None:
            return None, decode
        bucket, Rb, plans = best
        chunks = [c for plan in plans for c in plan]
        rows = [r * Rb + i for r, plan in enumerate(plans) for i in range(len(plan))]
        # sequences finishing their prompt now can decode in the same step (their row is set by prefill)
        decode = self._join_decode(chunks, decode)
        keep = [(c, row) for c, row in zip(chunks, rows) if c[0] in self.running]
        if not keep:
            return None, decode
        return (bucket, [c for c, _ in keep], [row for _, row in keep]), decode

    def _prefill_budgets(self, dec_rows, K1):
        """Per-rank prefill token budgets and the candidate buckets of a step with ``dec_rows`` decode rows per rank
        at ``K1`` tokens per decode iteration (``_plan_prefill``; ``prefill_room`` asks the same question)."""
        D, B = self.dp, self.max_num_batched_tokens
        budgets = [max(B - dec_rows[r] * K1, min(B, 16)) for r in range(D)]
        buckets, cap = self.prefill_buckets, self.mixed_prefill_tokens
        if cap is not None and any(dec_rows):
            # decode rows wait for the prefill: a smaller chunk in a smaller program (where one is compiled)
            budgets = [min(b, cap) for b in budgets]
            buckets = [b for b in buckets if b[0] // D * b[1] <= cap] or buckets
        return budgets, buckets

    def prefill_room(self, K1: int) -> int:
        """Prompt tokens the next ``schedule`` could prefill if its decode iterations took ``K1`` tokens each (the
        adaptive policy's question: does drafting, ``K1 = block + 1``, leave less prefill than plain, ``K1 = 1``?).
        ``_plan_prefill``'s packing on token counts: per DP rank its budget (``_prefill_budgets``: decode rows, the
        mixed-step cap) over its pending prompts in admission order, at most a bucket's rows and tokens per row,
        the best bucket. Pending: running prompts' remaining tokens, then, FCFS, whole prompts of as many waiting
        sequences as the rank has free slots. It errs high (a prefix-cache hit or a page shortage admits less, exact
        prefix caching cuts chunks at block boundaries; only a preemption by decode growth frees budget instead),
        i.e. toward "drafting displaces prefill" and plain decoding."""
        D = self.dp
        rows, pending = [0] * D, [[] for _ in range(D)]
        for s in self.running:                     # those that get a decode row (``schedule``'s step 1)
            if s.status == DECODE and self._wants_decode_row(s):
                rows[s.rank] += 1
        for s in sorted([s for s in self.running if s.status == PREFILL], key=lambda v: v.order):
            pending[s.rank].append(len(s.all_ids) - s.computed)
        budgets, buckets = self._prefill_budgets(rows, K1)
        most = max(b[0] // D for b in buckets)     # prompts a rank can pack in one step
        free = [min(p.num_free, most - len(q)) for p, q in zip(self.rank_slots, pending)]
        for s in self.waiting:
            if max(free) <= 0:
                break
            if free[s.rank] > 0:
                pending[s.rank].append(len(s.all_ids) - s.computed)
                free[s.rank] -= 1
        return max(sum(self._packed(pending[r][:b[0] // D], b[1], budgets[r]) for r in range(D)) for b in buckets)

    @staticmethod
    def _packed(lengths, T, budget) -> int:
        """Tokens ``_pack`` gives prompts with ``lengths`` tokens left (in order): at most ``T`` each, ``budget``
        in all."""
        total = 0
        for n in lengths:
            n = min(n, T, budget - total)
            if n <= 0:
                break
            total += n
        return total

    @staticmethod
    def _pack(seqs, T, budget, align=0, tail=0):
        """Prefill chunks ``(s, n)`` of ``seqs`` in order: at most ``T`` tokens each, ``budget`` in all.
        ``align`` (exact prefix caching: the page size): a chunk that does not finish its prompt ends on a
        block boundary where it can, and the last full block boundary below the prompt's end (where a repeat
        of the prompt hits) ends a chunk, so that its state can be snapshotted -- unless the prompt ends within
        ``tail`` positions of it (the rings still hold its state after the call: snapshots.py "Tail")."""
        plan = []
        for s in seqs:
            L = len(s.all_ids)
            n = min(L - s.computed, T, budget)
            if n <= 0:
                break
            if align and s.exact_state:
                e, last = s.computed + n, (L - 1) // align * align
                if e < L and e // align * align > s.computed:
                    n = e // align * align - s.computed
                elif e == L and last > s.computed and L - last > tail:
                    n = last - s.computed
            plan.append((s, n))
            budget -= n
        return plan

    # ------------------------------------------------------------------ DP accounting
    def _count_dummy(self, ranks, rows):
        """A device call whose real rows belong to ``ranks`` (one entry per row): the other ranks' ``rows``
        rows run as dummy rows (valid=False)."""
        from dsflash.sharding.dp_balance import plan_step
        st = plan_step(np.bincount(ranks, minlength=self.dp), buckets=[rows])
        m = self.metrics
        for r, d in enumerate(st.dummy):
            if d:
                m.dp_dummy_rows += rows
                m.dp_dummy_calls[r] += 1

    def update_dp_counts(self):
        """Per-rank waiting / running (sequences) into the metrics and the load balancer (every step)."""
        D, m = self.dp, self.metrics
        w, u = [0] * D, [0] * D
        for s in self.waiting:
            w[s.rank] += 1
        for s in self.running:
            u[s.rank] += 1
        m.dp_num_waiting, m.dp_num_running = w, u
        m.dp_kv_usage = [p.usage() for p in self.rank_pools]
        self.balancer.update_all(list(zip(w, u)))
