"""One generated sequence of a request (a request with ``n`` samples has ``n``), as the scheduler tracks it."""
from __future__ import annotations

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
        self.prefill_start = 0       # first position this admission computes (after a prefix-cache hit)
        self.floor = 0               # window keys below this position do not exist (encoder replay)
        self.kv_from = 0             # global KV below this position comes from the prefix cache
        self.hashes: list[int] = []  # chain hashes of registered full blocks
        self.exact_state = True      # slot state equals a miss's (False after an approximate replay)
        self.snap = None             # pinned snapshot entry to restore before the first prefill chunk
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
        self.guide = None            # guided.Guide under structured output (one token per decode call)
        # adaptive speculation (adaptive.py): accepted drafts and verifications (its estimate shrinks them toward
        # the engine-wide mean), verifications seen, whether its drafts count, decode calls since its last
        # verification while stopped
        self.spec_acc = 0.0
        self.spec_n = 0.0
        self.spec_verifies = 0
        self.spec_drafting = True
        self.spec_idle_calls = 0
        # tap-free plain calls (engine._track_taps): None while the lazy draft context's ring holds all a catch-up
        # reads, else the positions recorded since its last tap-free call
        self.spec_taps = None

    @property
    def all_ids(self):
        return self.prompt_ids + self.out_ids

    @property
    def finished(self):
        return self.status == FINISHED
