"""Metric definitions of ``bench serve`` on synthetic timelines; expected values are computed here by
hand from the definitions (docs/benchmarks.md: TTFT, TPOT as vLLM; ITL and peak throughput per token,
interactivity = 1/TPOT), without numpy, independently of the implementation."""
from __future__ import annotations

import math

import pytest

from dsflash.bench.serve_metrics import (
    RequestRecord, compute_metrics, distribute_tokens, format_summary, parse_slos, peak_rates, request_itls,
    request_tpot)


def pct(values, q):
    """Linear-interpolation percentile (the 'linear' method: rank = q/100 * (n-1))."""
    v = sorted(values)
    rank = q / 100 * (len(v) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def rec_from_chunks(start, chunk_times, *, prompt=100, out=None, tokens=None, cached=None, warmup=False,
                    success=True, **kw):
    """A record whose content chunks arrived at absolute times ``chunk_times``, carrying ``tokens``
    tokens each (default: one per chunk, or ``out`` spread evenly when given)."""
    r = RequestRecord(start_time=start, success=success, warmup=warmup, prompt_tokens=prompt,
                      cached_tokens=cached, **kw)
    if success:
        r.ttft = chunk_times[0] - start
        r.chunk_gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        r.latency = chunk_times[-1] - start
        if tokens is not None:
            r.chunk_tokens = list(tokens)
        r.output_tokens = (sum(tokens) if tokens is not None else len(chunk_times)) if out is None else out
        r.num_chunks = len(chunk_times)
        r.end_time = chunk_times[-1]
    else:
        r.end_time = start + 0.01
        r.error = kw.get("error", "HTTP 500: boom")
    return r


@pytest.fixture
def records():
    return [
        # A: 4 chunks = 4 tokens
        rec_from_chunks(0.0, [0.30, 0.35, 0.45, 0.50], prompt=100, cached=60),
        # B: 3 chunks carrying 1, 2, 2 tokens (e.g. speculative decoding: usage says 5)
        rec_from_chunks(0.1, [0.60, 0.70, 0.90], prompt=200, tokens=[1, 2, 2], cached=0),
        # C: a single token -> no TPOT sample, TPOT 0 for goodput
        rec_from_chunks(0.2, [0.40], prompt=50, cached=50),
        # D: 2 tokens, slow first token
        rec_from_chunks(0.5, [2.50, 2.60], prompt=150, cached=100),
        # warm-up request: ignored everywhere
        rec_from_chunks(-5.0, [-4.0, -3.0], prompt=10_000, warmup=True),
    ]


def test_latency_definitions(records):
    m = compute_metrics(records, duration_s=4.0, percentiles=[50, 90, 99])
    a, b, c, d = records[:4]
    ttfts = [0.30, 0.50, 0.20, 2.00]
    e2els = [0.50, 0.80, 0.20, 2.10]
    # ICL: every gap between chunks, pooled over requests (what vLLM calls ITL)
    icls = [0.05, 0.10, 0.05, 0.10, 0.20, 0.10]
    # ITL per token: B's chunks of 2 tokens after 0.10 and 0.20 s give 2 x 0.05 and 2 x 0.10
    itls = [0.05, 0.10, 0.05, 0.05, 0.05, 0.10, 0.10, 0.10]
    # TPOT = (E2EL - TTFT) / (output_tokens - 1), only requests with > 1 token
    tpots = [(0.50 - 0.30) / 3, (0.80 - 0.50) / 4, (2.10 - 2.00) / 1]
    for key, vals in (("ttft_ms", ttfts), ("e2el_ms", e2els), ("itl_ms", itls), ("icl_ms", icls),
                      ("tpot_ms", tpots)):
        s = m[key]
        assert s["count"] == len(vals), key
        assert s["mean"] == pytest.approx(1000 * sum(vals) / len(vals)), key
        assert s["median"] == pytest.approx(1000 * pct(vals, 50)), key
        assert s["p90"] == pytest.approx(1000 * pct(vals, 90)), key
        assert s["p99"] == pytest.approx(1000 * pct(vals, 99)), key
        mean = sum(vals) / len(vals)
        assert s["std"] == pytest.approx(1000 * math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))), key
    assert request_tpot(c) is None and request_tpot(a) == pytest.approx(0.2 / 3)
    # interactivity = 1 / TPOT at the matching percentile (tokens/s/user); per-user = 1/TPOT per request
    assert m["p90_interactivity"] == pytest.approx(1 / pct(tpots, 90))
    assert m["interactivity"]["median"] == pytest.approx(1 / pct(tpots, 50))
    per_user = [1 / t for t in tpots]
    assert m["per_user_output_throughput"]["mean"] == pytest.approx(sum(per_user) / 3)
    assert m["per_user_output_throughput"]["p10"] == pytest.approx(pct(per_user, 10))
    # E2E-normalised interactivity: median of output_tokens / E2EL
    assert m["e2e_interactivity_median"] == pytest.approx(pct([4 / 0.5, 5 / 0.8, 1 / 0.2, 2 / 2.1], 50))


def test_throughput_cached_split_and_cost(records):
    m = compute_metrics(records, duration_s=4.0, num_gpus=4, gpu_hour_usd=2.0)
    n_in, n_out, n_cached = 100 + 200 + 50 + 150, 4 + 5 + 1 + 2, 60 + 0 + 50 + 100
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_input_tokens"] == n_in and m["total_output_tokens"] == n_out
    assert m["request_throughput"] == pytest.approx(4 / 4.0)
    assert m["input_throughput"] == pytest.approx(n_in / 4.0)
    assert m["output_throughput"] == pytest.approx(n_out / 4.0)
    assert m["total_token_throughput"] == pytest.approx((n_in + n_out) / 4.0)
    assert m["output_throughput_per_gpu"] == pytest.approx(n_out / 4.0 / 4)
    assert m["total_token_throughput_per_gpu"] == pytest.approx((n_in + n_out) / 4.0 / 4)
    assert m["cached_input_tokens"] == n_cached and m["uncached_input_tokens"] == n_in - n_cached
    assert m["cached_input_throughput"] == pytest.approx(n_cached / 4.0)
    assert m["uncached_input_throughput"] == pytest.approx((n_in - n_cached) / 4.0)
    assert m["prefix_hit_rate"] == pytest.approx(n_cached / n_in)
    # $ per million tokens: 4 GPUs x $2/h over the window, divided by the tokens of that kind
    usd = 4 * 2.0 / 3600 * 4.0
    assert m["usd_per_million_output_tokens"] == pytest.approx(usd / n_out * 1e6)
    assert m["usd_per_million_input_tokens"] == pytest.approx(usd / n_in * 1e6)
    assert m["usd_per_million_total_tokens"] == pytest.approx(usd / (n_in + n_out) * 1e6)
    assert m["valid"] and m["invalid_reasons"] == []
    assert "Successful requests:" in format_summary(m)


def test_cached_split_absent_when_not_reported(records):
    records[1].cached_tokens = None
    m = compute_metrics(records, duration_s=1.0)
    assert m["cached_input_tokens"] is None and m["prefix_hit_rate"] is None


def test_goodput_counts_requests_meeting_every_slo(records):
    # TTFTs 300/500/200/2000 ms; TPOTs 66.7/75/0(1 token)/100 ms; E2ELs 500/800/200/2100 ms
    m = compute_metrics(records, duration_s=2.0, slos=parse_slos("ttft=500,tpot=80"))
    assert m["good_completed"] == 3 and m["goodput"] == pytest.approx(3 / 2.0)   # A, B (TTFT == SLO), C
    m = compute_metrics(records, duration_s=2.0, slos=parse_slos("tpot=70"))
    assert m["good_completed"] == 2                                              # A and C
    m = compute_metrics(records, duration_s=2.0, slos=parse_slos("e2el:1s ttft:2000ms"))
    assert m["good_completed"] == 3                                              # all but D
    assert "goodput" not in compute_metrics(records, duration_s=2.0)


def test_parse_slos_rejects_bad_input():
    assert parse_slos("ttft=250,tpot=20") == {"ttft": 0.25, "tpot": 0.02}
    assert parse_slos(None) == {}
    for bad in ("ttfx=3", "ttft", "ttft=-1"):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_failed_fraction_invalidates_above_ten_percent():
    ok = [rec_from_chunks(i * 1.0, [i + 0.1, i + 0.2]) for i in range(9)]
    # 1 of 10 failed = 10 %: still valid (the limit is "more than 10 %")
    m = compute_metrics(ok + [rec_from_chunks(0, [], success=False)], duration_s=10.0)
    assert m["failed"] == 1 and m["failed_fraction"] == pytest.approx(0.1) and m["valid"]
    # 2 of 10: invalid; failures are excluded from latency and throughput
    m = compute_metrics(ok[:8] + [rec_from_chunks(0, [], success=False)] * 2, duration_s=10.0)
    assert m["failed_fraction"] == pytest.approx(0.2) and not m["valid"]
    assert m["completed"] == 8 and m["ttft_ms"]["count"] == 8
    assert m["errors"] == {"HTTP 500: boom": 2}
    # context overflow errors: > 1 % invalidates on its own
    many = [rec_from_chunks(i * 1.0, [i + 0.1, i + 0.2]) for i in range(97)]
    bad = rec_from_chunks(0, [], success=False, context_overflow=True)
    m = compute_metrics(many + [bad] * 2, duration_s=100.0)
    assert m["context_overflow_fraction"] == pytest.approx(2 / 99) and not m["valid"]
    m = compute_metrics([rec_from_chunks(0, [], success=False)], duration_s=1.0)
    assert not m["valid"] and m["ttft_ms"]["mean"] == 0.0


def test_peak_rates_one_second_buckets():
    # request 1: chunks at 0.5, 0.9, 1.2; request 2 (start 1.1): chunks at 1.3, 1.4, 1.5, 2.6
    r1 = rec_from_chunks(0.0, [0.5, 0.9, 1.2])
    r2 = rec_from_chunks(1.1, [1.3, 1.4, 1.5, 2.6])
    peak, live = peak_rates([r1, r2])
    assert peak == 4            # bucket [1, 2): 1.2, 1.3, 1.4, 1.5
    assert live == 2            # overlap during [1.1, 1.2)
    # back-to-back requests inside one second never overlap: peak concurrency 1
    seq = [rec_from_chunks(0.0, [0.1, 0.2]), rec_from_chunks(0.2, [0.3, 0.4]), rec_from_chunks(0.4, [0.5, 0.9])]
    peak, live = peak_rates(seq)
    assert (peak, live) == (6, 1)


def test_warmup_records_never_count(records):
    m_all = compute_metrics(records, duration_s=4.0)
    m_measured = compute_metrics(records[:4], duration_s=4.0)
    for k in ("completed", "total_input_tokens", "total_output_tokens", "ttft_ms", "itl_ms"):
        assert m_all[k] == m_measured[k]


def test_pareto_front_and_monotone_interpolation():
    from dsflash.bench.serve_metrics import monotone_interpolate, pareto_front, throughput_at_interactivity
    pts = [(10, 100), (20, 80), (15, 70), (30, 40), (5, 90)]      # (15, 70) and (5, 90) are dominated
    assert pareto_front(pts) == [(10.0, 100.0), (20.0, 80.0), (30.0, 40.0)]
    xs, ys = [10.0, 20.0, 30.0], [100.0, 80.0, 40.0]
    # through the data points, none outside the measured range, linear data stays linear
    assert [monotone_interpolate(xs, ys, x) for x in (10, 20, 30)] == [100, 80, 40]
    assert monotone_interpolate(xs, ys, 9.9) is None and monotone_interpolate(xs, ys, 30.1) is None
    assert monotone_interpolate([0, 1, 2], [0, 2, 4], 0.5) == pytest.approx(1.0)
    # monotone and without overshoot on a sharply bent front
    xs2, ys2 = [1.0, 2.0, 3.0, 10.0], [1000.0, 999.0, 100.0, 99.0]
    grid = [1 + i * 0.01 for i in range(901)]
    vals = [monotone_interpolate(xs2, ys2, x) for x in grid]
    assert all(a >= b - 1e-9 for a, b in zip(vals, vals[1:]))
    assert max(vals) <= 1000 + 1e-9 and min(vals) >= 99 - 1e-9
    got = throughput_at_interactivity(pts, [15, 50])
    assert got["50"] is None and 80 < got["15"] < 100


# ----------------------------------------------------------------------------------------------
# per-token definitions on a speculative-decoding timeline (several tokens per chunk)
# ----------------------------------------------------------------------------------------------
def spec_record():
    """Sent at t=0; chunks at 1.0 s (1 token), 1.6 s (6 tokens), 2.2 s (6 tokens), 2.5 s (3 tokens)."""
    return rec_from_chunks(0.0, [1.0, 1.6, 2.2, 2.5], tokens=[1, 6, 6, 3], prompt=64)


def test_six_token_chunks_per_token_itl_tpot_interactivity():
    r = spec_record()
    m = compute_metrics([r], duration_s=2.5, percentiles=[50, 90])
    # by hand: N = 16 tokens; TTFT 1.0 s, E2EL 2.5 s
    assert m["total_output_tokens"] == 16
    assert m["ttft_ms"]["mean"] == pytest.approx(1000.0)
    assert m["e2el_ms"]["mean"] == pytest.approx(2500.0)
    # TPOT = (2.5 - 1.0) / (16 - 1) = 0.1 s; interactivity = 1 / TPOT = 10 tok/s/user
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["p90_interactivity"] == pytest.approx(10.0)
    assert m["per_user_output_throughput"]["mean"] == pytest.approx(10.0)
    # ITL per token: 6 tokens after 0.6 s -> 6 x 0.1 s; 6 after 0.6 s -> 6 x 0.1; 3 after 0.3 s -> 3 x 0.1
    assert request_itls(r) == pytest.approx([0.1] * 15)
    assert m["itl_ms"]["count"] == 15
    assert m["itl_ms"]["p90"] == pytest.approx(100.0)
    # per chunk (vLLM's "ITL"): 3 gaps of 0.6, 0.6, 0.3 s -> p90 by hand = 0.6 s, i.e. 1.7 "tok/s"
    assert m["icl_ms"]["count"] == 3
    assert m["icl_ms"]["p90"] == pytest.approx(1000 * pct([0.6, 0.6, 0.3], 90))
    assert m["tokens_per_chunk"]["mean"] == pytest.approx(16 / 4)
    assert m["first_chunk_tokens"]["mean"] == pytest.approx(1.0)


def test_first_chunk_tokens_belong_to_ttft():
    # the first chunk carries 4 tokens: they give no ITL sample; the later tokens share the decode time
    r = rec_from_chunks(0.0, [0.5, 1.1, 1.4], tokens=[4, 6, 2])
    # ITL: 6 x (0.6 / 6) and 2 x (0.3 / 2); the samples add up to E2EL - TTFT = 0.9 s
    assert request_itls(r) == pytest.approx([0.1] * 6 + [0.15] * 2)
    assert sum(request_itls(r)) == pytest.approx(1.4 - 0.5)
    # TPOT keeps vLLM's denominator N - 1 = 11
    assert request_tpot(r) == pytest.approx(0.9 / 11)


def test_zero_token_chunk_passes_its_gap_on():
    # a content chunk with no new tokens (text held back and released later): its gap goes to the next
    r = rec_from_chunks(0.0, [0.2, 0.5, 0.6], tokens=[1, 0, 2])
    assert request_itls(r) == pytest.approx([0.2, 0.2])       # (0.3 + 0.1) / 2 each


def test_peak_throughput_counts_tokens_not_chunks():
    # chunks at 0.4 s (1 token), 0.9 s (6), 1.3 s (6), 1.8 s (6), 2.1 s (5): buckets from the send at 0
    r = rec_from_chunks(0.0, [0.4, 0.9, 1.3, 1.8, 2.1], tokens=[1, 6, 6, 6, 5])
    # second 2 at another request (sent at 0.5): 1 token at 1.5 s, 6 at 1.95 s
    r2 = rec_from_chunks(0.5, [1.5, 1.95], tokens=[1, 6])
    peak, live = peak_rates([r, r2])
    # bucket [0,1): 1 + 6 = 7; [1,2): 6 + 6 + 1 + 6 = 19; [2,3): 5  -> 19 (per chunk it would be 4)
    assert peak == 19 and live == 2
    m = compute_metrics([r, r2], duration_s=2.1)
    assert m["peak_output_throughput"] == 19
    assert m["output_throughput"] == pytest.approx((24 + 7) / 2.1)


def test_goodput_itl_and_icl_slos_per_token():
    # ITL per token 0.1 s everywhere, but the chunk gaps are 0.6 s
    r = spec_record()
    assert compute_metrics([r], 2.5, slos=parse_slos("itl=101"))["good_completed"] == 1
    assert compute_metrics([r], 2.5, slos=parse_slos("itl=99"))["good_completed"] == 0
    assert compute_metrics([r], 2.5, slos=parse_slos("icl=599"))["good_completed"] == 0
    assert compute_metrics([r], 2.5, slos=parse_slos("icl=601"))["good_completed"] == 1


def test_distribute_tokens_largest_remainder():
    assert distribute_tokens(16, [1, 6, 6, 3]) == [1, 6, 6, 3]
    assert distribute_tokens(10, [1, 1, 1]) == [4, 3, 3]           # 3.33 each: the first gets the rest
    assert distribute_tokens(5, [0, 0]) == [3, 2]                  # no weights: even
    assert sum(distribute_tokens(64, [3, 7, 11, 2, 9])) == 64
    assert distribute_tokens(0, [1, 2]) == [0, 0] and distribute_tokens(3, []) == []


def test_records_without_chunk_counts_spread_output_tokens_evenly():
    # no per-chunk counts (older records): the server's total is spread evenly over the chunks
    r = rec_from_chunks(0.0, [1.0, 1.6, 2.2, 2.5], out=16)
    assert request_itls(r) == pytest.approx([0.6 / 4] * 4 + [0.6 / 4] * 4 + [0.3 / 4] * 4)


def test_chunk_token_counts_from_the_stream():
    from dsflash.bench.serve import chunk_token_counts_from_stream as counts
    texts = [" a", " bb cc", " d", " e"]
    # cumulative per-chunk usage (continuous_usage_stats): increases; 2 trailing tokens go to the last chunk
    assert counts(texts, [1, 7, 13, 14], 16) == ([1, 6, 6, 3], "server")
    # one chunk without usage: not the server's counts; the tokenizer's, scaled to the server total 8
    class WordTok:
        def encode(self, t):
            return t.split()
    # words 1, 2, 1, 1 of 5 -> 8 x = 1.6, 3.2, 1.6, 1.6: floors 1, 3, 1, 1, the 2 left to the largest
    # remainders (.6, ties to the earlier chunks)
    assert counts(texts, [1, None, 5, 6], 8, WordTok()) == ([2, 3, 2, 1], "tokenizer")
    assert counts(texts, [None] * 4, None, WordTok()) == ([1, 2, 1, 1], "tokenizer")
    # no tokenizer: one per chunk, the rest (10 - 4 = 6) by text length 2, 6, 2, 2 of 12 -> 1, 3, 1, 1
    assert counts(texts, [None] * 4, 10) == ([2, 4, 2, 2], "text-length")
    assert counts(texts, [None] * 4, 4) == ([1, 1, 1, 1], "text-length")
    assert counts(texts, [None] * 4, None) == ([1, 1, 1, 1], "one-per-chunk")
