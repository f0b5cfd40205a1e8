"""Engine metrics: counters, gauges and recent histogram samples (vLLM names where one exists)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def _samples():
    return deque(maxlen=20000)


@dataclass
class EngineMetrics:
    block: int = 0
    dp_size: int = 1                       # DP ranks (per-rank entries below only when > 1)
    # counters
    num_steps: int = 0
    num_prefill_calls: int = 0
    num_decode_calls: int = 0
    num_decode_iters: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0        # prompt tokens actually run (misses + replay)
    generation_tokens: int = 0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    num_preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    replay_tokens: int = 0
    prefix_snapshot_hits: int = 0          # hits that restored a state snapshot (exact)
    prefix_snapshot_fallbacks: int = 0     # exact-mode hits with no snapshot kept: bounded replay instead
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list = field(default_factory=list)
    compiles_after_warmup: int = 0
    dp_dummy_rows: int = 0                 # rows run for ranks that had no work in a device call (valid=False)
    dp_dummy_calls: list = field(default_factory=list)    # per rank: device calls it took part in with no work
    # gauges
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    dp_num_running: list = field(default_factory=list)    # per rank (sequences)
    dp_num_waiting: list = field(default_factory=list)
    dp_kv_usage: list = field(default_factory=list)
    # histogram samples (seconds)
    ttft: deque = field(default_factory=_samples)
    itl: deque = field(default_factory=_samples)
    e2e: deque = field(default_factory=_samples)
    queue_time: deque = field(default_factory=_samples)
    step_time: deque = field(default_factory=_samples)
    host_time: deque = field(default_factory=_samples)   # host work per step (not waiting for the device)
    acceptance_length: deque = field(default_factory=_samples)

    def __post_init__(self):
        if not self.spec_accepted_per_pos:
            self.spec_accepted_per_pos = [0] * self.block
        D = self.dp_size
        for name in ("dp_dummy_calls", "dp_num_running", "dp_num_waiting"):
            if not getattr(self, name):
                setattr(self, name, [0] * D)
        if not self.dp_kv_usage:
            self.dp_kv_usage = [0.0] * D

    @property
    def acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def snapshot(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "num_steps", "num_prefill_calls", "num_decode_calls", "num_decode_iters", "prompt_tokens",
            "computed_prompt_tokens", "generation_tokens", "requests_added", "requests_finished",
            "requests_aborted", "num_preemptions", "prefix_query_tokens", "prefix_hit_tokens", "replay_tokens",
            "prefix_snapshot_hits", "prefix_snapshot_fallbacks",
            "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "compiles_after_warmup",
            "num_running", "num_waiting", "kv_usage", "kv_pages_used", "kv_pages_total")}
        d["spec_accepted_per_pos"] = list(self.spec_accepted_per_pos)
        d["spec_acceptance_rate"] = self.acceptance_rate
        d["spec_acceptance_rate_per_pos"] = [a / self.spec_num_drafts if self.spec_num_drafts else 0.0
                                             for a in self.spec_accepted_per_pos]
        d["spec_mean_acceptance_length"] = self.mean_acceptance_length
        d["prefix_hit_rate"] = self.prefix_hit_rate
        for name in ("ttft", "itl", "e2e", "queue_time", "step_time", "host_time", "acceptance_length"):
            d[f"{name}_s" if name != "acceptance_length" else name] = list(getattr(self, name))
        ht = list(self.host_time)
        d["host_time_mean_s"] = sum(ht) / len(ht) if ht else 0.0
        d["dp_size"] = self.dp_size
        if self.dp_size > 1:      # nested: the server exports dsflash_engine_dp_ranks_<r>_<name>
            d["dp_dummy_rows"] = self.dp_dummy_rows
            d["dp_dummy_calls"] = sum(self.dp_dummy_calls)
            d["dp_ranks"] = {str(r): {"num_running": self.dp_num_running[r], "num_waiting": self.dp_num_waiting[r],
                                      "kv_usage": self.dp_kv_usage[r], "dummy_calls": self.dp_dummy_calls[r]}
                             for r in range(self.dp_size)}
        return d
