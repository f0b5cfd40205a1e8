"""Scheduling half of ``LLMEngine`` (a mixin): the sequence record, admission with prefix-cache lookup and
encoder replay, page growth with recompute preemption, and the per-step plan (prefill bucket + decode rows).
The engine (``engine.py``) owns the queues, pools and runner these methods use.

With DP ranks (``self.dp > 1``) every sequence has a ``rank``: its slot and pages come from that rank's pools,
preemption picks victims of the same rank, admission is FCFS per rank, and each rank packs its own prefill
chunks into its row range of the global prefill bucket (``_plan_prefill``; one rank is the plain case)."""
from __future__ import annotations

import math
import time

from dsflash.serve.engine.kv_cache import OutOfPages, block_hashes
from dsflash.serve.types import RequestMetrics, SamplingParams

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


class Sequence:
    def __init__(self, rid, index, prompt, prompt_ids, params: SamplingParams, arrival, seed, stop_ids):
        self.request_id, self.index = rid, index
        self.prompt, self.prompt_ids, self.params = prompt, list(prompt_ids), params
        self.seed, self.stop_ids = seed, stop_ids
        self.out_ids: list[int] = []
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.status = WAITING
        self.slot: int | None = None
        self.pages: list[int] = []
        self.computed = 0            # positions whose KV is written (prefill progress)
        self.floor = 0               # window keys below this position do not exist (encoder replay)
        self.kv_from = 0             # global KV below this position comes from the prefix cache
        self.hashes: list[int] = []  # chain hashes of registered full blocks
        self.order = 0               # admission order (preemption picks the youngest)
        self.text = ""
        self.finish_reason = None
        self.stop_reason = None
        self.metrics = RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(prompt_ids))
        self.last_token_time = None
        self.detok = None            # IncrementalDetokenizer when the model has a tokenizer
        self.pending = 0             # upper bound of tokens that dispatched, unprocessed calls may add
        self.pending_lb = 0          # tokens they add unless the sequence finishes
        self.last_slot = None
        self.rank = 0                # DP rank (slot, pages and prefix cache come from its range)

    @property
    def all_ids(self):
        return self.prompt_ids + self.out_ids

    @property
    def finished(self):
        return self.status == FINISHED



class SchedulerMixin:
    def _preempt(self, s: Sequence):
        """Recompute preemption: drop the sequence's KV and slot; it re-enters the queue at the front."""
        self.running.remove(s)
        self._free(s)
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
            self._pt[s.slot, len(s.pages) - len(new):len(s.pages)] = new
            need = 0
        return True

    def _set_slot_params(self, s: Sequence):
        p, i = s.params, s.slot
        sp = self._sp
        sp["temp"][i] = p.temperature
        sp["top_k"][i] = p.top_k if p.top_k > 0 else 0
        sp["top_p"][i] = p.top_p
        sp["min_p"][i] = p.min_p
        sp["pres"][i] = p.presence_penalty
        sp["freq"][i] = p.frequency_penalty
        sp["rep"][i] = p.repetition_penalty
        sp["seed_lo"][i] = s.seed & 0xFFFFFFFF
        sp["seed_hi"][i] = (s.seed >> 32) & 0xFFFFFFFF
        sp["max_gen"][i] = p.max_tokens
        sp["draft_temp"][i] = p.temperature if self.draft_sampling else 0.0
        sp["stop_ids"][i] = -1
        sp["stop_ids"][i, :len(s.stop_ids)] = s.stop_ids
        self._floor[i] = s.floor

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
        self._pt[slot] = self._pt_fill[slot]
        self._pt[slot, :len(s.pages)] = s.pages
        C = len(hit) * P
        s.hashes = hashes[:len(hit)]
        if C:
            replay = {"bounded": self.backend.sliding_window,
                      "exact": (self.backend.num_layers + 2) * self.backend.sliding_window}.get(
                self.prefix_replay, self.prefix_replay)
            s.computed = max(0, C - replay)
            s.floor, s.kv_from = s.computed, C
            self.metrics.replay_tokens += C - s.computed
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
        self._set_slot_params(s)
        self.running.append(s)
        return True

    # ------------------------------------------------------------------ scheduling
    def _schedule(self):
        K1, P = self.K1, self.page_size
        # 1. decode growth, oldest first (the youngest is preempted when the pool runs dry)
        decode = []
        for s in sorted([s for s in self.running if s.status == DECODE], key=lambda v: v.order):
            if s.status != DECODE:
                continue  # preempted while growing an older sequence
            pos = len(s.all_ids) - 2 + s.pending
            rem = s.params.max_tokens - len(s.out_ids) - s.pending_lb
            if rem <= 0:
                continue                          # finishes with what is in flight
            h = min(self.decode_steps, rem)
            if not self._grow(s, pos + 1 + h * K1):
                if not self._grow(s, pos + 1 + K1):
                    self._preempt(s)
                    continue
            h = min(h, (len(s.pages) * P - 1 - pos) // K1)
            decode.append((s, h))
        decode = [(s, h) for s, h in decode if s.status == DECODE]
        # 2. admission, FCFS per DP rank; 3. prefill chunks of every rank into the best bucket
        self._admit_ranks()
        return self._plan_prefill(decode)

    def _join_decode(self, chunks, decode):
        """Sequences whose prompt completes in this step's prefill join the same step's decode call."""
        K1, P = self.K1, self.page_size
        for s, n in chunks:
            if s.computed + n == len(s.all_ids):
                pos = len(s.all_ids) - 1
                h = max(1, min(self.decode_steps, s.params.max_tokens - len(s.out_ids) - 1))
                if s.params.max_tokens - len(s.out_ids) - 1 <= 0:
                    continue
                if self._grow(s, pos + 1 + h * K1) or self._grow(s, pos + 1 + K1):
                    h = min(h, (len(s.pages) * P - 1 - pos) // K1)
                    if h >= 1:
                        decode.append((s, h))
        return [(s, h) for s, h in decode if s in self.running]

    # ------------------------------------------------------------------ admission and prefill, per DP rank
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
            if s.pending or not self._admit(s):
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
        D, K1, B = self.dp, self.K1, self.max_num_batched_tokens
        dec_rows = [0] * D
        for s, _ in decode:
            dec_rows[s.rank] += 1
        pre = [[] for _ in range(D)]
        for s in sorted([s for s in self.running if s.status == PREFILL], key=lambda v: v.order):
            pre[s.rank].append(s)
        best, best_key = None, None
        if any(pre):
            budgets = [max(B - dec_rows[r] * K1, min(B, 16)) for r in range(D)]
            for bucket in self.runner.prefill_buckets:
                Rb, T = bucket[0] // D, bucket[1]
                plans = [self._pack(pre[r][:Rb], T, budgets[r]) for r in range(D)]
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

    @staticmethod
    def _pack(seqs, T, budget):
        """Prefill chunks ``(s, n)`` of ``seqs`` in order: at most ``T`` tokens each, ``budget`` in all."""
        plan = []
        for s in seqs:
            n = min(len(s.all_ids) - s.computed, T, budget)
            if n <= 0:
                break
            plan.append((s, n))
            budget -= n
        return plan

    def _register(self, s: Sequence, committed: int):
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
