"""Prometheus metrics for the server (``GET /metrics``).

Two sources:

* **Server-side** (measured here, per request): request counts by endpoint and status, finished
  requests by finish reason, prompt / generation token counters, time-to-first-token, inter-token
  latency (one observation per generated token: a step that yields k tokens, as in speculative
  decoding, counts k tokens of dt/k each), end-to-end latency, queue time, HTTP requests in flight,
  and the speculative-decoding counters summed from each finished request's ``RequestMetrics``.
* **Engine-side**: every numeric entry of ``engine.metrics_snapshot()`` (nested dicts flattened
  with ``_``) as a gauge ``dsflash_engine_<key>``, plus the standard gauges
  ``dsflash_num_requests_running`` / ``_waiting`` / ``dsflash_kv_cache_usage_perc`` /
  ``dsflash_spec_decode_acceptance_rate`` / ``dsflash_spec_decode_mean_acceptance_length`` / prefix-cache
  hit rate / preemptions taken from the snapshot keys listed in ``_STANDARD`` when the engine reports
  them; lists of numbers named ``*_per_pos`` become one gauge labelled by ``position``. Other lists
  (the engine's raw latency samples) are not exported: the server's own histograms cover them.
"""
from __future__ import annotations

import re
import time
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0,
                600.0)

# standard gauge name -> snapshot keys to try, first hit wins
_STANDARD = {
    "dsflash_num_requests_running": ("num_requests_running", "num_running"),
    "dsflash_num_requests_waiting": ("num_requests_waiting", "num_waiting"),
    "dsflash_kv_cache_usage_perc": ("kv_usage", "kv_cache_usage"),
    "dsflash_spec_decode_acceptance_rate": ("spec_acceptance_rate", "spec_decode_acceptance_rate"),
    "dsflash_spec_decode_mean_acceptance_length": ("spec_mean_acceptance_length",
                                                   "spec_decode_mean_acceptance_length"),
    "dsflash_prefix_cache_hit_rate": ("prefix_hit_rate",),
    "dsflash_prefix_cache_replay_fallbacks": ("prefix_snapshot_fallbacks",),
    "dsflash_num_preemptions": ("num_preemptions",),
}


def _flatten(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flatten(v, key + "_")
        elif isinstance(v, bool):
            yield key, float(v)
        elif isinstance(v, (int, float)):
            yield key, float(v)


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        try:
            snap = self._snapshot() or {}
        except Exception:  # noqa: BLE001 - scraping must not fail
            snap = {}
        flat = dict(_flatten(snap))
        for std, keys in _STANDARD.items():
            for k in keys:
                if k in flat:
                    g = GaugeMetricFamily(std, f"engine metrics_snapshot()['{k}']")
                    g.add_metric([], flat[k])
                    yield g
                    break
        for k, v in sorted(flat.items()):
            g = GaugeMetricFamily(f"dsflash_engine_{_metric_name(k)}", f"engine metrics_snapshot()['{k}']")
            g.add_metric([], v)
            yield g
        # per-draft-position lists (e.g. spec_accepted_per_pos) as one labelled gauge each
        for k, v in sorted(snap.items()):
            if k.endswith("_per_pos") and isinstance(v, (list, tuple)) and all(
                    isinstance(x, (int, float)) for x in v):
                g = GaugeMetricFamily(f"dsflash_engine_{_metric_name(k)}", f"engine metrics_snapshot()['{k}']",
                                      labels=["position"])
                for i, x in enumerate(v):
                    g.add_metric([str(i)], float(x))
                yield g


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict], model_name: str = ""):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dsflash_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("dsflash_request_success", "Finished generations by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("dsflash_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("dsflash_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("dsflash_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("dsflash_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("dsflash_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("dsflash_request_queue_time_seconds", "Arrival to first scheduling",
                                    buckets=_TTFT_BUCKETS, registry=r)
        self.in_flight = Gauge("dsflash_http_requests_in_flight", "Generation HTTP requests being served",
                               registry=r)
        self.engine_in_flight = Gauge("dsflash_num_requests_in_flight",
                                      "Engine requests held (added, not finished or aborted)", registry=r)
        self.aborted = Counter("dsflash_request_aborted", "Engine requests aborted (client disconnect, "
                               "shutdown)", registry=r)
        self.spec_drafts = Counter("dsflash_spec_decode_num_drafts", "Draft blocks proposed", registry=r)
        self.spec_draft_tokens = Counter("dsflash_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         registry=r)
        self.spec_accepted = Counter("dsflash_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     registry=r)
        self.info = Gauge("dsflash_model_info", "Served model", ["model"], registry=r)
        self.info.labels(model=model_name).set(1)
        self._snapshot = snapshot
        r.register(_EngineCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per engine request: TTFT / ITL / e2e observations from successive cumulative outputs."""

    def __init__(self, metrics: Optional[ServerMetrics], arrival: Optional[float] = None):
        self.m = metrics
        self.arrival = time.time() if arrival is None else arrival
        self.last_time: Optional[float] = None
        self.n_tokens = 0

    def update(self, out) -> None:
        if self.m is None or not out.outputs:
            return
        n = len(out.outputs[0].token_ids)
        now = time.time()
        new = n - self.n_tokens
        if new > 0:
            if self.last_time is None:
                self.m.ttft.observe(max(0.0, now - self.arrival))
                new -= 1
                self.m.generation_tokens.inc()
                self.last_time = now
            if new > 0:
                dt = (now - self.last_time) / new
                for _ in range(new):
                    self.m.itl.observe(dt)
                self.m.generation_tokens.inc(new)
            self.last_time = now
            self.n_tokens = n
        if out.finished:
            self.m.e2e.observe(max(0.0, now - self.arrival))
            self.m.finished.labels(finish_reason=str(out.outputs[0].finish_reason)).inc()
            rm = out.metrics
            if rm is not None:
                if rm.first_scheduled_time and rm.arrival_time:
                    self.m.queue_time.observe(max(0.0, rm.first_scheduled_time - rm.arrival_time))
                if rm.num_drafts:
                    self.m.spec_drafts.inc(rm.num_drafts)
                if rm.num_draft_tokens:
                    self.m.spec_draft_tokens.inc(rm.num_draft_tokens)
                if rm.num_accepted_tokens:
                    self.m.spec_accepted.inc(rm.num_accepted_tokens)
