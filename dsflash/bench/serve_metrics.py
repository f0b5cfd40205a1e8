"""Serving metrics for ``bench serve``, every one counted in *tokens*, not in streamed chunks.

Pure functions of per-request records (no I/O), so every definition can be tested on synthetic
timelines. A record holds the arrival time of every *content chunk* (a streamed chunk that carries
generated text) and how many tokens each chunk carried (``chunk_tokens``: from the server's
per-chunk usage when it sends one, else from the client's tokenizer or an estimate, reconciled to
the final ``usage.completion_tokens``; see ``docs/benchmarks.md``). With speculative decoding one
chunk carries several tokens, so per-chunk and per-token numbers differ. Per successful request
(seconds, from the moment the request was sent; N = output tokens, n_k = tokens of chunk k):

* **TTFT** – send → first content chunk (as vLLM and AIPerf).
* **E2EL** – send → last content chunk.
* **TPOT** – ``(E2EL - TTFT) / (N - 1)`` (vLLM's TPOT; AIPerf calls the same number its
  per-request "inter token latency"); requests with N <= 1 have none (TPOT 0 for goodput, as vLLM).
* **ITL** (per token) – a chunk k >= 1 that arrives ``g_k`` after the previous token-carrying chunk
  and carries ``n_k`` tokens contributes ``n_k`` samples of ``g_k / n_k``; samples are pooled over
  all requests. The tokens of the first chunk belong to TTFT and give no sample. A request's ITL
  samples add up to ``E2EL - TTFT``.
* **ICL** (inter-chunk latency) – every gap between consecutive content chunks, pooled; this is what
  vLLM's ``benchmark_serving`` reports as "ITL" (one sample per chunk whatever it carries).
* **interactivity** (tokens/s/user) – per request ``1 / TPOT``; "p-th percentile interactivity"
  is ``1 / (p-th percentile TPOT)``, so p90 interactivity is the slow tail (90 % of requests are at
  least this fast), as AgentX reads it off AIPerf's per-request ITL.

Aggregates over a profiling window of ``duration_s`` seconds: request throughput, input / output /
total tokens per second (and per GPU), input split into cached and uncached tokens when the server
reports ``usage.prompt_tokens_details.cached_tokens``, goodput (requests/s meeting *all* stated
SLOs), cost per million tokens at a $/GPU-hour, peak output tokens/s (tokens, not chunks, in 1-s
buckets) and peak concurrency, failure rate (the run is invalid above ``MAX_FAILED_FRACTION``, or
above ``MAX_CONTEXT_OVERFLOW_FRACTION`` context-overflow errors).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

MAX_FAILED_FRACTION = 0.10            # InferenceX rejects runs with > 10 % failed requests
MAX_CONTEXT_OVERFLOW_FRACTION = 0.01  # AgentX: > 1 % context-overflow errors invalidates a run
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el", "itl", "icl")


@dataclass
class RequestRecord:
    """What the client measured for one request (times in seconds, ``start_time`` on
    ``time.perf_counter``'s clock)."""
    request_id: str = ""
    lane: int = 0
    session_id: str = ""
    kind: str = "fixed"                   # fixed | primer | root | subagent
    warmup: bool = False                  # warm-up requests are never counted
    start_time: float = 0.0
    end_time: float = 0.0                 # when the response ended (success or not)
    success: bool = False
    ttft: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)    # gaps between consecutive content chunks
    chunk_tokens: list[int] = field(default_factory=list)    # tokens carried by each content chunk
    chunk_tokens_source: str = ""         # server | tokenizer | text-length | one-per-chunk
    latency: float = 0.0                  # E2EL: send -> last content chunk
    prompt_tokens: int = 0                # server usage if reported, else the client's estimate
    prompt_tokens_from_server: bool = False
    est_prompt_tokens: int = 0            # the client's estimate (diagnostic)
    cached_tokens: Optional[int] = None   # usage.prompt_tokens_details.cached_tokens, if reported
    output_tokens: int = 0                # server usage if reported, else sum(chunk_tokens)
    output_tokens_from_server: bool = False
    max_tokens: int = 0                   # what was asked for (== output_tokens under ignore_eos)
    num_chunks: int = 0
    status: Optional[int] = None          # HTTP status
    error: str = ""
    context_overflow: bool = False
    generated_text: str = ""

    def to_json(self, with_text: bool = False) -> dict:
        d = asdict(self)
        if not with_text:
            d.pop("generated_text")
        return d


def parse_slos(spec: Optional[str]) -> dict[str, float]:
    """``"ttft=2000,tpot=50"`` (milliseconds; ``:`` also accepted, and an ``ms`` / ``s`` suffix)
    -> ``{"ttft": 2.0, "tpot": 0.05}`` in seconds."""
    out: dict[str, float] = {}
    if not spec:
        return out
    for part in spec.replace(" ", ",").split(","):
        if not part:
            continue
        sep = "=" if "=" in part else ":"
        if sep not in part:
            raise ValueError(f"--slo: expected NAME=MILLISECONDS, got {part!r}")
        name, value = part.split(sep, 1)
        name = name.strip().lower()
        if name not in SLO_METRICS:
            raise ValueError(f"--slo: unknown metric {name!r} (choose from {', '.join(SLO_METRICS)})")
        value = value.strip().lower()
        scale = 1e-3
        if value.endswith("ms"):
            value = value[:-2]
        elif value.endswith("s"):
            value, scale = value[:-1], 1.0
        v = float(value)
        if not v > 0:
            raise ValueError(f"--slo: {name} must be > 0, got {v}")
        out[name] = v * scale
    return out


def _stats(values: Sequence[float], percentiles: Iterable[float], scale: float = 1000.0) -> dict:
    """mean / median / std / p<q> of ``values`` times ``scale`` (seconds -> ms by default);
    percentiles with numpy's default (linear interpolation), as vLLM does. Empty -> all 0 (vLLM)."""
    arr = np.asarray(values, dtype=np.float64) * scale
    out = {"count": int(arr.size)}
    if arr.size == 0:
        out.update(mean=0.0, median=0.0, std=0.0)
        out.update({_pkey(p): 0.0 for p in percentiles})
        return out
    out.update(mean=float(arr.mean()), median=float(np.median(arr)), std=float(arr.std()))
    out.update({_pkey(p): float(np.percentile(arr, p)) for p in percentiles})
    return out


def _tally(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in items:
        out[k] = out.get(k, 0) + 1
    return out


def _pkey(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def request_tpot(r: RequestRecord) -> Optional[float]:
    """TPOT of one request, ``(E2EL - TTFT) / (N - 1)`` (vLLM); None when it produced <= 1 token."""
    if r.output_tokens > 1:
        return (r.latency - r.ttft) / (r.output_tokens - 1)
    return None


def distribute_tokens(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split into ``len(weights)`` non-negative integers proportional to ``weights``
    (largest remainder, ties to the earlier item); all-zero weights split evenly."""
    k = len(weights)
    if k == 0:
        return []
    total = max(int(total), 0)
    w = [max(float(x), 0.0) for x in weights]
    if not sum(w) > 0:
        w = [1.0] * k
    tw = sum(w)
    exact = [total * x / tw for x in w]
    out = [int(math.floor(e)) for e in exact]
    order = sorted(range(k), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:total - sum(out)]:
        out[i] += 1
    return out


def chunk_token_counts(r: RequestRecord) -> list[int]:
    """Tokens carried by each content chunk of ``r``: ``r.chunk_tokens`` when it has one entry per
    chunk, else ``r.output_tokens`` spread evenly over the chunks."""
    n = len(r.chunk_gaps) + 1
    if len(r.chunk_tokens) == n:
        return [int(x) for x in r.chunk_tokens]
    return distribute_tokens(r.output_tokens if r.output_tokens > 0 else n, [1.0] * n)


def chunk_times(r: RequestRecord) -> list[float]:
    """Absolute arrival times of the content chunks of a request (start + TTFT + cumulative gaps)."""
    t = r.start_time + r.ttft
    times = [t]
    for gap in r.chunk_gaps:
        t += gap
        times.append(t)
    return times


def request_itls(r: RequestRecord) -> list[float]:
    """Per-token inter-token latencies of one request: a chunk that arrives ``g`` after the previous
    token-carrying chunk with ``n`` tokens gives ``n`` samples of ``g / n`` (a chunk with no tokens
    passes its gap on to the next one); the first chunk's tokens belong to TTFT and give none."""
    counts = chunk_token_counts(r)
    out: list[float] = []
    pending = 0.0
    for gap, n in zip(r.chunk_gaps, counts[1:]):
        pending += gap
        if n > 0:
            out.extend([pending / n] * n)
            pending = 0.0
    return out


def peak_rates(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """Peak output tokens/s (the tokens each content chunk carries, counted at its arrival in
    1-second buckets from the first request's send time; vLLM's buckets, but vLLM counts one per
    chunk) and peak concurrent requests (exact sweep over the half-open intervals [send, last
    token), as in current vLLM)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    t1 = max(r.start_time + r.latency for r in ok)
    n = int(math.ceil(t1 - t0)) + 1
    tokens = np.zeros(n)
    for r in ok:
        for t, k in zip(chunk_times(r), chunk_token_counts(r)):
            b = int(t - t0)
            if 0 <= b < n:
                tokens[b] += k
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    live = peak = 0
    for _, delta in events:          # at equal times the departure (-1) sorts first
        live += delta
        peak = max(peak, live)
    return float(tokens.max()), int(peak)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    slos: Optional[dict[str, float]] = None,
    num_gpus: int = 1,
    gpu_hour_usd: Optional[float] = None,
) -> dict:
    """Aggregate metrics of the measured (non-warm-up) ``records`` over a window of ``duration_s``.

    Latency statistics are in milliseconds, rates per second. See the module docstring for the
    definitions; ``docs/benchmarks.md`` states them for readers."""
    percentiles = sorted(set(float(p) for p in percentiles) | {90.0})
    slos = dict(slos or {})
    recs = [r for r in records if not r.warmup]
    ok = [r for r in recs if r.success]
    failed = [r for r in recs if not r.success]
    dur = float(duration_s)
    if not dur > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    num_gpus = max(int(num_gpus), 1)

    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    req_itls = {id(r): request_itls(r) for r in ok}
    itls = [x for r in ok for x in req_itls[id(r)]]
    icls = [gap for r in ok for gap in r.chunk_gaps]
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    per_user = [1.0 / t for t in tpots if t > 0]
    counts = [chunk_token_counts(r) for r in ok]

    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported) if reported else None

    # goodput: a request is good when it meets every stated SLO (vLLM: TPOT of <= 1 token = 0)
    good = 0
    if slos:
        for r in ok:
            per_req = {
                "ttft": r.ttft,
                "tpot": request_tpot(r) or 0.0,
                "e2el": r.latency,
                "itl": max(req_itls[id(r)], default=0.0),
                "icl": max(r.chunk_gaps, default=0.0),
            }
            if all(per_req[k] <= v for k, v in slos.items()):
                good += 1

    n_all = len(recs)
    fail_frac = len(failed) / n_all if n_all else 0.0
    overflow_frac = sum(r.context_overflow for r in failed) / n_all if n_all else 0.0
    peak_tok_s, peak_live = peak_rates(ok)

    out_tps = output_tokens / dur
    in_tps = input_tokens / dur
    tot_tps = (input_tokens + output_tokens) / dur
    m: dict = {
        "duration_s": dur,
        "completed": len(ok),
        "failed": len(failed),
        "failed_fraction": fail_frac,
        "context_overflow_fraction": overflow_frac,
        "request_throughput": len(ok) / dur,
        "total_input_tokens": int(input_tokens),
        "total_output_tokens": int(output_tokens),
        "input_tokens_from_server": all(r.prompt_tokens_from_server for r in ok) if ok else False,
        "output_tokens_from_server": all(r.output_tokens_from_server for r in ok) if ok else False,
        "mean_input_tokens": input_tokens / len(ok) if ok else 0.0,
        "mean_output_tokens": output_tokens / len(ok) if ok else 0.0,
        "input_throughput": in_tps,
        "output_throughput": out_tps,
        "total_token_throughput": tot_tps,
        "num_gpus": num_gpus,
        "input_throughput_per_gpu": in_tps / num_gpus,
        "output_throughput_per_gpu": out_tps / num_gpus,
        "total_token_throughput_per_gpu": tot_tps / num_gpus,
        "peak_output_throughput": peak_tok_s,
        "peak_concurrent_requests": peak_live,
        "ttft_ms": _stats(ttfts, percentiles),
        "tpot_ms": _stats(tpots, percentiles),
        "itl_ms": _stats(itls, percentiles),
        "icl_ms": _stats(icls, percentiles),
        "e2el_ms": _stats(e2els, percentiles),
        "per_user_output_throughput": _stats(per_user, sorted(set(percentiles) | {10.0}), scale=1.0),
        "tokens_per_chunk": _stats([k for c in counts for k in c], percentiles, scale=1.0),
        "first_chunk_tokens": _stats([c[0] for c in counts], percentiles, scale=1.0),
        "chunk_tokens_source": _tally(r.chunk_tokens_source or "one-per-chunk" for r in ok),
    }
    # cached / uncached input (only when every successful request reported cached_tokens)
    if cached is not None and len(reported) == len(ok):
        m["cached_input_tokens"] = int(cached)
        m["uncached_input_tokens"] = int(input_tokens - cached)
        m["cached_input_throughput"] = cached / dur
        m["uncached_input_throughput"] = (input_tokens - cached) / dur
        m["prefix_hit_rate"] = cached / input_tokens if input_tokens else 0.0
    else:
        m["cached_input_tokens"] = None
        m["uncached_input_tokens"] = None
        m["cached_input_throughput"] = None
        m["uncached_input_throughput"] = None
        m["prefix_hit_rate"] = None
    # interactivity (tokens/s/user) = 1 / TPOT at the matching percentile (p90: the slow tail)
    tpot_s = m["tpot_ms"]
    m["interactivity"] = {
        k: (1000.0 / tpot_s[k] if tpot_s[k] > 0 else None)
        for k in ["mean", "median"] + [_pkey(p) for p in percentiles]
    }
    m["p90_interactivity"] = m["interactivity"]["p90"]
    # E2E-normalised variant: output tokens / E2EL per request, median over requests
    e2e_inter = [r.output_tokens / r.latency for r in ok if r.latency > 0 and r.output_tokens > 0]
    m["e2e_interactivity_median"] = float(np.median(e2e_inter)) if e2e_inter else None
    if slos:
        m["slos_ms"] = {k: v * 1000.0 for k, v in slos.items()}
        m["good_completed"] = good
        m["goodput"] = good / dur
    # cost per million tokens: all GPUs' cost attributed to each token kind in turn (InferenceX)
    if gpu_hour_usd is not None:
        usd_per_s = gpu_hour_usd * num_gpus / 3600.0
        m["gpu_hour_usd"] = gpu_hour_usd
        m["usd_per_million_output_tokens"] = usd_per_s / out_tps * 1e6 if out_tps else None
        m["usd_per_million_input_tokens"] = usd_per_s / in_tps * 1e6 if in_tps else None
        m["usd_per_million_total_tokens"] = usd_per_s / tot_tps * 1e6 if tot_tps else None
    reasons = []
    if fail_frac > MAX_FAILED_FRACTION:
        reasons.append(f"{fail_frac:.1%} of requests failed (limit {MAX_FAILED_FRACTION:.0%})")
    if overflow_frac > MAX_CONTEXT_OVERFLOW_FRACTION:
        reasons.append(f"{overflow_frac:.1%} context-overflow errors (limit {MAX_CONTEXT_OVERFLOW_FRACTION:.0%})")
    if not ok:
        reasons.append("no request completed")
    m["valid"] = not reasons
    m["invalid_reasons"] = reasons
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown").splitlines()[0][:160]
        errors[key] = errors.get(key, 0) + 1
    m["errors"] = errors
    return m


def format_summary(m: dict, title: str = "Serving benchmark result") -> str:
    """A vLLM-style plain-text table of the headline numbers."""
    w = 52
    lines = [f"{{s:{{c}}^{w}}}".format(s=f" {title} ", c="=")]

    def row(name, value, fmt="{:<40} {:<10}"):
        if value is None:
            value = "n/a"
        elif isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(fmt.format(name, value))

    row("Successful requests:", m["completed"])
    row("Failed requests:", f"{m['failed']} ({m['failed_fraction']:.1%})")
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    if m.get("cached_input_tokens") is not None:
        row("  of which cached:", f"{m['cached_input_tokens']} ({m['prefix_hit_rate']:.1%})")
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    if "goodput" in m:
        row("Request goodput (req/s):", m["goodput"])
    row("Input token throughput (tok/s):", m["input_throughput"])
    if m.get("uncached_input_throughput") is not None:
        row("  uncached input (tok/s):", m["uncached_input_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row(f"Output tok/s per GPU ({m['num_gpus']} GPUs):", m["output_throughput_per_gpu"])
    row("Peak output token throughput (tok/s):", m["peak_output_throughput"])
    row("Peak concurrent requests:", m["peak_concurrent_requests"])
    row("p90 interactivity (tok/s/user):", m["p90_interactivity"])
    pu = m.get("per_user_output_throughput") or {}
    if pu.get("count"):
        row("Mean per-user output tok/s (1/TPOT):", pu["mean"])
    tc = m.get("tokens_per_chunk") or {}
    if tc.get("count"):
        src = ", ".join(f"{k} {v}" for k, v in (m.get("chunk_tokens_source") or {}).items())
        row("Mean tokens per chunk:", f"{tc['mean']:.2f} (counts: {src})")
    if m.get("usd_per_million_output_tokens") is not None:
        row("USD per million output tokens:", m["usd_per_million_output_tokens"])
        row("USD per million total tokens:", m["usd_per_million_total_tokens"])
    for key, label in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency (per token)"), ("icl_ms", "Inter-chunk Latency"),
                       ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{{s:{{c}}^{w}}}".format(s=label, c="-"))
        s = m[key]
        row(f"Mean {key[:-3].upper()} (ms):", s["mean"])
        row(f"Median {key[:-3].upper()} (ms):", s["median"])
        for k, v in s.items():
            if k.startswith("p"):
                row(f"P{k[1:]} {key[:-3].upper()} (ms):", v)
    if not m["valid"]:
        lines.append("INVALID RUN: " + "; ".join(m["invalid_reasons"]))
    lines.append("=" * w)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# comparing sweeps at fixed interactivity (AgentX / InferenceX style)
# ----------------------------------------------------------------------------------------------
def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (interactivity, throughput) points no other point beats on both axes (higher is better
    on both), sorted by interactivity; throughput then falls as interactivity rises."""
    pts = sorted({(float(x), float(y)) for x, y in points if x is not None and y is not None},
                 key=lambda p: (-p[0], -p[1]))
    front: list[tuple[float, float]] = []
    best_y = -math.inf
    for x, y in pts:                      # from the most interactive point down
        if y > best_y:
            front.append((x, y))
            best_y = y
    return sorted(front)


def monotone_interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> Optional[float]:
    """Monotone piecewise-cubic Hermite interpolation (Fritsch–Carlson) through (xs, ys), xs strictly
    increasing; None outside [xs[0], xs[-1]] (no extrapolation). Never overshoots the data."""
    n = len(xs)
    if n == 0 or x < xs[0] or x > xs[-1]:
        return None
    if n == 1:
        return float(ys[0])
    h = [xs[i + 1] - xs[i] for i in range(n - 1)]
    d = [(ys[i + 1] - ys[i]) / h[i] for i in range(n - 1)]
    m = [0.0] * n
    m[0], m[-1] = d[0], d[-1]
    for i in range(1, n - 1):
        if d[i - 1] * d[i] <= 0:
            m[i] = 0.0
        else:                              # weighted harmonic mean keeps the interpolant monotone
            w1, w2 = 2 * h[i] + h[i - 1], h[i] + 2 * h[i - 1]
            m[i] = (w1 + w2) / (w1 / d[i - 1] + w2 / d[i])
    for i in range(n - 1):                 # end slopes: clip to keep monotonicity
        if d[i] == 0:
            m[i] = m[i + 1] = 0.0
    k = max(i for i in range(n - 1) if xs[i] <= x) if x < xs[-1] else n - 2
    t = (x - xs[k]) / h[k]
    h00, h10 = 2 * t ** 3 - 3 * t ** 2 + 1, t ** 3 - 2 * t ** 2 + t
    h01, h11 = -2 * t ** 3 + 3 * t ** 2, t ** 3 - t ** 2
    return float(h00 * ys[k] + h10 * h[k] * m[k] + h01 * ys[k + 1] + h11 * h[k] * m[k + 1])


def throughput_at_interactivity(points: Iterable[tuple[float, float]], targets: Iterable[float]) -> dict:
    """Output tokens/s/GPU at each target p90 interactivity (tok/s/user), read off the Pareto front
    of a sweep by monotone interpolation; None where the sweep does not reach the target."""
    front = pareto_front(points)
    xs, ys = [p[0] for p in front], [p[1] for p in front]
    return {f"{t:g}": monotone_interpolate(xs, ys, float(t)) for t in targets}
