"""Analytic bytes and flops, op by op, of one forward step, and its floor under measured ceilings (issue 19).

``step_floor(cfg, rows, S, context, precision, loads)`` describes one target forward on one device: ``rows``
sequences of ``S`` new tokens each, at ``context`` cached tokens (an int, or one per row), with the routed-expert
loads the step's router produced (``[L, E]`` tokens per expert, as ``bench forward`` records them). The ops are
named as ``step_profile.SCOPES`` names them, so a measured per-op profile and these floors line up row by row.

What an op's bytes are (the least it must move as the op it is in the program):

* **weights**: the stored bytes of the tensors it uses -- FP8 E4M3 1 B/element + UE8M0 32x32 block scales, MXFP4
  0.5 B/element + UE8M0 per-32 scales, bf16 2 B, fp32 4 B. Routed experts: only the experts the step's tokens hit
  (``loads > 0``). Never the embedding table: only the ``rows * S`` gathered rows. Engram tables: the gathered rows.
* **cache** (what attention really reads and writes): per sequence the sliding window's cached rows
  (``min(W - 1, C)`` ring rows: the query at position C needs C-W+1 .. C-1 from the ring, later rows of the call
  come from the call itself); the *selected* compressed main-KV entries (per query row ``min(index_topk,
  visible)`` picks, at most the sequence's visible entries in all); at index-source layers the index keys of all
  visible entries (``(C + S) // ratio``); the new window rows, compressor-ring rows and compressed entries written.
  Charged to the op whose math consumes them (window + selected entries: ``sparse_attention``; index keys:
  ``indexer_topk``), not to the gather that decodes them today (``kv_gather``, ``attention_other`` have no floor:
  a fused consumer reads the packed bytes directly). Packed layouts (``model/state.py``) in "reference" precision:
  window FP8 + UE8M0/32 (Dh + Dh/32 B per row), main KV E2M1 + E4M3/16 (Dh/2 + Dh/16), index K E2M1 + UE8M0/32
  (Di/2 + Di/32); "bf16" / "fp32" caches hold plain 2 / 4 B values.
* **activations**: the op's inputs and outputs once each (bf16, fp32 in "fp32" precision). Summed over ops this
  counts a tensor once as its producer's output and once per consumer's input: the per-op floors are floors of the
  ops as separate ops; a fully fused step would move fewer activation bytes (decode: tiny next to the weights).

Flops: 2 M N K per GEMM-shaped contraction (projections, experts, head, gate, mHC mixes); attention 4 Dh per
(query row, head, key) for QK and PV over the window and the selected entries; the indexer 2 Di per (query row,
index head, visible entry). Elementwise work (norms, RoPE, softmax, SwiGLU) is left out: it is bandwidth-bound.
FP8-stored linears whose activations take the FP8 round trip in "reference" numerics (wq_a, wq_b, wkv, wo_b,
indexer wq_b, shared and routed experts, Engram wkv, DSpark main_proj) count at the FP8 GEMM rate; everything else,
and every GEMM in "bf16" / "fp32" precision, at the bf16 rate.

Floor of an op = max(bytes / read bandwidth, fp8 flops / FP8 rate + bf16 flops / bf16 rate), with ceilings measured
in the same run (``dsflash.bench.ceilings``). The whole step: ``bytes_ms`` = all bytes / read bandwidth,
``flops_ms`` = all flops at their rates, ``floor_ms`` = the larger (ops overlapping perfectly), and
``sum_op_floors_ms`` = the sum of the ops' own floors (ops one after another). ``exact_floor_ms`` is the same floor
with every flop at the bf16 rate (``EXACT_FLOOR`` says why that is the floor of the reference arithmetic on sm_90).

On a mesh the numbers are one device's: its DP rank's rows, dense weights replicated (DEP), the routed experts of
its EP rank (experts contiguous per rank; the rank with the most bytes). Tensor parallelism is not modelled.
``draft_floor`` does the same for the DSpark half of a speculative iteration; ``engine_iteration_floor`` adds
target + draft + sampling for one engine decode iteration.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from dsflash.config import ModelConfig


EXACT_FLOOR = (
    "exact floor: every GEMM at the bf16 rate. The reference scales both operands of its FP8 / MXFP4 linears per 32 "
    "along K; sm_90 has no block-scaled MMA, so an FP8 wgmma per 32-wide group needs an fp32 rescale of every "
    "accumulator per group (FP32-pipe time >= the FP8 MMA's own, 2x with both scales), and its reduced-precision "
    "accumulation flipped 0.2 % of h codes where the bf16 path is bit-identical (H200, 2026-11-30, "
    "kernels/NOTES.md). The values are exact in bf16, so the exact arithmetic runs on bf16 tensor cores.")


# ------------------------------------------------------------------------------------------ stored sizes
def fp8_bytes(out: int, inp: int, lead: int = 1) -> int:
    """FP8 E4M3 [out, in] + UE8M0 [out/32, in/32]."""
    return lead * (out * inp + (out // 32) * (inp // 32))


def mxfp4_bytes(out: int, inp: int, lead: int = 1) -> int:
    """MXFP4 [out, in/2] nibble pairs + UE8M0 [out, in/32]."""
    return lead * (out * inp // 2 + out * (inp // 32))


def act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def window_row_bytes(cfg: ModelConfig, precision: str) -> int:
    Dh = cfg.head_dim
    return Dh + Dh // 32 if precision == "reference" else act_bytes(precision) * Dh


def main_entry_bytes(cfg: ModelConfig, precision: str) -> int:
    Dh = cfg.head_dim
    return Dh // 2 + Dh // 16 if precision == "reference" else act_bytes(precision) * Dh


def index_entry_bytes(cfg: ModelConfig, precision: str) -> int:
    Di = cfg.index_head_dim
    return Di // 2 + Di // 32 if precision == "reference" else act_bytes(precision) * Di


# ------------------------------------------------------------------------------------------ one op's cost
@dataclasses.dataclass
class Cost:
    weight_bytes: float = 0
    cache_bytes: float = 0
    act_bytes: float = 0
    flops_fp8: float = 0
    flops_bf16: float = 0

    def add(self, **kw):
        for k, v in kw.items():
            setattr(self, k, getattr(self, k) + v)
        return self

    @property
    def bytes(self):
        return self.weight_bytes + self.cache_bytes + self.act_bytes

    @property
    def flops(self):
        return self.flops_fp8 + self.flops_bf16


def _record(c: Cost, r: dict | None) -> dict:
    out = {"weight_bytes": int(c.weight_bytes), "cache_bytes": int(c.cache_bytes), "act_bytes": int(c.act_bytes),
           "bytes": int(c.bytes), "flops_fp8": float(c.flops_fp8), "flops_bf16": float(c.flops_bf16),
           "flops": float(c.flops)}
    if r and r.get("read_Bps"):
        b = c.bytes / r["read_Bps"] * 1e3
        f = (c.flops_fp8 / r["fp8_flops"] + c.flops_bf16 / r["bf16_flops"]) * 1e3
        out.update(bytes_ms=b, flops_ms=f, floor_ms=max(b, f), bound="bytes" if b >= f else "flops")
        fx = c.flops / r["bf16_flops"] * 1e3        # every GEMM on bf16 tensor cores: see EXACT_FLOOR
        out.update(flops_ms_bf16_mma=fx, exact_floor_ms=max(b, fx))
    return out


def _total(costs: dict, r: dict | None) -> dict:
    tot = Cost()
    for c in costs.values():
        tot.add(**dataclasses.asdict(c))
    out = _record(tot, r)
    if "floor_ms" in out:
        out["sum_op_floors_ms"] = float(sum(_record(c, r)["floor_ms"] for c in costs.values()))
        out["exact_floor_note"] = EXACT_FLOOR
    return out


def _rates(ceilings):
    if ceilings is None:
        return None
    if "read_Bps" in ceilings:
        return ceilings
    from dsflash.bench.ceilings import rates
    return rates(ceilings)


# ------------------------------------------------------------------------------------------ routed experts
def expected_hits(E: int, k: int, tokens: float) -> float:
    """Expected distinct experts hit by ``tokens`` tokens each picking k distinct of E uniformly."""
    return E * (1.0 - (1.0 - k / E) ** tokens) if tokens > 0 else 0.0


def _expert_use(loads, L: int, E: int, k: int, tokens: int, ep_ranks: int):
    """Per layer (hit experts, token-expert pairs) on the busiest EP rank's slice (the rank with the most hit
    experts over all layers). ``loads`` None: uniform routing, the expected counts."""
    if loads is None:
        return [(expected_hits(E, k, tokens) / ep_ranks, tokens * k / ep_ranks)] * L, "uniform routing (expected)"
    a = np.asarray(loads, np.float64)
    if a.shape != (L, E):
        raise ValueError(f"loads must be [{L}, {E}], got {a.shape}")
    if E % ep_ranks:
        raise ValueError(f"{E} experts do not split over {ep_ranks} EP ranks")
    r = a.reshape(L, ep_ranks, E // ep_ranks)
    hits = (r > 0).sum(axis=2)                      # [L, R]
    rank = int(np.argmax(hits.sum(axis=0)))
    return [(float(hits[l, rank]), float(r[l, rank].sum())) for l in range(L)], "measured loads"


# ------------------------------------------------------------------------------------------ parts of every block
def _block_parts(op, cfg: ModelConfig, T: int, a: int, f8: str, n_experts: int, topk: int, hits: float,
                 pairs: float):
    """mHC (pre_mix, post_mix, expand), the two norms, q / kv / o projections, gate, shared and routed experts of
    one block over T rows (``op(name)`` -> the Cost to add to)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    H, Dh, ql, I = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.moe_intermediate_size
    G, ol, E = cfg.o_groups, cfg.o_lora_rank, n_experts
    mix = (2 + n) * n
    # pre_mix reads X, writes h; post_mix reads y and X, writes X1 and h; expand reads z and X1, writes X
    op("mhc").add(weight_bytes=2 * (mix * n * d * 4 + mix * 4 + 3 * 4), act_bytes=(5 * T * n * d + 4 * T * d) * a,
                  flops_bf16=2 * (2 * T * mix * n * d) + 2 * (2 * T * n * d) + 2 * (2 * T * n * n * d))
    op("norm").add(weight_bytes=2 * d * 2, act_bytes=2 * 2 * T * d * a)
    op("q_proj").add(weight_bytes=fp8_bytes(ql, d) + ql * 2 + fp8_bytes(H * Dh, ql),
                     act_bytes=T * d * a + T * (ql + H * Dh) * a, **{f8: 2 * T * (ql * d + H * Dh * ql)})
    op("kv_proj").add(weight_bytes=fp8_bytes(Dh, d) + Dh * 2, act_bytes=T * (d + Dh) * a, **{f8: 2 * T * Dh * d})
    # wo_a: bf16 operands without the activation round trip (bf16 rate); wo_b: an FP8 linear
    op("o_proj").add(weight_bytes=fp8_bytes(G * ol, H * Dh // G) + fp8_bytes(d, G * ol),
                     act_bytes=T * (H * Dh + d) * a).add(flops_bf16=2 * T * ol * H * Dh).add(**{f8: 2 * T * d * G * ol})
    op("gate").add(weight_bytes=E * d * 2 + E * 4, act_bytes=T * d * a + T * topk * 8, flops_bf16=2 * T * E * d)
    op("shared_expert").add(weight_bytes=2 * fp8_bytes(I, d) + fp8_bytes(d, I), act_bytes=2 * T * d * a,
                            **{f8: 6 * T * I * d})
    op("routed_experts").add(weight_bytes=hits * 3 * mxfp4_bytes(I, d), act_bytes=T * d * (a + 4),
                             **{f8: 6 * pairs * I * d})


# ------------------------------------------------------------------------------------------ the target step
def _ctx_list(rows: int, context) -> list[int]:
    if np.ndim(context) == 0:
        return [int(context)] * rows
    ctx = [int(c) for c in context]
    if len(ctx) != rows:
        raise ValueError(f"context: {len(ctx)} values for {rows} rows")
    return ctx


def _emitted(c: int, S: int, ratio: int) -> int:
    """Compressed entries completed by positions c .. c+S-1 (ratio 1: every row; ratio 2: odd positions)."""
    return S if ratio == 1 else (c + S) // 2 - c // 2


def step_costs(cfg: ModelConfig, rows: int, S: int, context, precision: str = "reference", loads=None, *,
               logits: str = "last", ep_ranks: int = 1, ring_slack: int = 16) -> tuple[dict, dict]:
    """(op -> Cost, notes) of one target forward on one device (see the module docstring)."""
    ctxs = _ctx_list(rows, context)
    a = act_bytes(precision)
    ref = precision == "reference"
    d, n, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    H, Dh, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    Hi, Di, K = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    E, W = cfg.n_routed_experts, cfg.sliding_window
    T = rows * S
    logit_rows = {"last": rows, "all": T, "none": 0}[logits]
    f8 = "flops_fp8" if ref else "flops_bf16"         # FP8-activation linears: the FP8 rate in reference numerics
    wrow, mrow, irow = window_row_bytes(cfg, precision), main_entry_bytes(cfg, precision), index_entry_bytes(cfg, precision)
    R = W + ring_slack
    ops: dict[str, Cost] = {}

    def op(name):
        return ops.setdefault(name, Cost())

    # embedding: the gathered rows only, out the n broadcast streams
    op("embed").add(cache_bytes=T * d * 2, act_bytes=T * n * d * a)
    use, use_note = _expert_use(loads, cfg.num_hidden_layers, E, cfg.num_experts_per_tok, T, ep_ranks)
    for l in range(cfg.num_hidden_layers):
        r = cfg.ratio(l)
        _block_parts(op, cfg, T, a, f8, E, cfg.num_experts_per_tok, *use[l])
        if l in cfg.engram_layer_ids:
            cols, De = cfg.engram_cols, cfg.engram_head_dim
            op("engram").add(weight_bytes=fp8_bytes((n + 1) * d, cols * De) + 2 * n * d * 2,
                             cache_bytes=T * cols * (De + De // 32), act_bytes=2 * T * n * d * a,
                             **{f8: 2 * T * (n + 1) * d * cols * De})
        # attention (projections: _block_parts)
        written = sum(min(S, R) for _ in ctxs)
        op("ring_write").add(cache_bytes=written * wrow, act_bytes=T * Dh * a)
        win_cached = sum(min(W - 1, c) for c in ctxs)
        win_keys = sum(min(W, c + s + 1) for c in ctxs for s in range(S))
        sel_keys, sel_entries = 0, 0
        if r > 0:
            for c in ctxs:
                per_row = [min(K, (c + s + 1) // r) for s in range(S)]
                sel_keys += sum(per_row)
                sel_entries += min(sum(per_row), (c + S) // r)
        op("sparse_attention").add(weight_bytes=H * 4, cache_bytes=win_cached * wrow + sel_entries * mrow,
                                   act_bytes=T * (2 * H * Dh + Dh) * a,
                                   flops_bf16=4 * H * Dh * (win_keys + sel_keys))
        if r > 0 and l in cfg.kv_source_layer_ids:
            emitted = sum(_emitted(c, S, r) for c in ctxs)
            op("compressor").add(weight_bytes=r * Dh * d * 2 + Dh * 2,
                                 cache_bytes=(rows * 2 * Dh * 4 if r == 2 else 0),      # the pending pair's half
                                 act_bytes=T * d * a + emitted * Dh * a,
                                 flops_bf16=2 * T * Dh * d * r)
            if r == 2:                                  # the compressor ring: kv and score rows, fp32
                op("ring_write").add(cache_bytes=rows * min(S, ring_slack) * 2 * Dh * 4, act_bytes=T * 2 * Dh * 4)
            op("index_keys").add(weight_bytes=Di * Dh * 2 + Di * 2, act_bytes=emitted * (Dh + Di) * a,
                                 flops_bf16=2 * emitted * Di * Dh)
            op("kv_write").add(cache_bytes=emitted * (mrow + irow), act_bytes=emitted * (Dh + Di) * a)
        if r > 0 and l in cfg.index_source_layer_ids:
            vis_rows = sum((c + s + 1) // r for c in ctxs for s in range(S))
            vis_entries = sum((c + S) // r for c in ctxs)
            op("indexer_q").add(weight_bytes=fp8_bytes(Hi * Di, ql) + Hi * d * 2,
                                act_bytes=T * (ql + d + Hi * Di + Hi) * a,
                                flops_bf16=2 * T * Hi * d).add(**{f8: 2 * T * Hi * Di * ql})
            op("indexer_topk").add(cache_bytes=vis_entries * irow, act_bytes=T * (Hi * Di + Hi) * a + T * K * 4,
                                   flops_bf16=2 * Hi * Di * vis_rows)
    # the last collapse + norm + head, on the rows whose logits are returned
    op("mhc").add(act_bytes=logit_rows * (n * d + d) * a, flops_bf16=2 * logit_rows * n * d)
    op("norm").add(weight_bytes=d * 2, act_bytes=2 * logit_rows * d * a)
    if logit_rows:
        op("head").add(weight_bytes=V * d * 2, act_bytes=logit_rows * (d * a + V * 4), flops_bf16=2 * logit_rows * V * d)
    notes = {"routed_experts": use_note, "logits": logits, "rows": rows, "S": S, "contexts": sorted(set(ctxs)),
             "precision": precision, "ep_ranks": ep_ranks}
    return ops, notes


def step_floor(cfg: ModelConfig, rows: int, S: int, context, precision: str = "reference", loads=None, *,
               ceilings: dict | None = None, logits: str = "last", ep_ranks: int = 1, ring_slack: int = 16) -> dict:
    """{"ops": {op: bytes, flops[, floor_ms, ...]}, "total": {...}, "notes": {...}, "rates": {...}} of one target
    forward (``ceilings``: a ``ceilings.measure()`` dict or ``ceilings.rates()``; None: bytes and flops only)."""
    r = _rates(ceilings)
    ops, notes = step_costs(cfg, rows, S, context, precision, loads, logits=logits, ep_ranks=ep_ranks,
                            ring_slack=ring_slack)
    return {"ops": {k: _record(c, r) for k, c in ops.items()}, "total": _total(ops, r), "notes": notes, "rates": r}


# ------------------------------------------------------------------------------------------ the DSpark draft
def draft_costs(cfg: ModelConfig, rows: int, S: int, context, precision: str = "reference", draft_loads=None, *,
                ep_ranks: int = 1) -> tuple[dict, dict]:
    """(part -> Cost, notes) of the DSpark half of a speculative iteration on one device: ``update_context`` over
    the ``S`` verified rows of each of ``rows`` sequences (main_proj of the taps, each stage's wkv, ring writes)
    and ``propose`` of one block (every stage's block over ``block`` rows attending to W ring rows + the block,
    the draft MoE, the target's head and the Markov chain). ``draft_loads`` ``[stages, E_draft]``; None: uniform
    routing, the expected hit experts."""
    if not cfg.n_stages:
        return {}, {"draft": "this config has no DSpark stages"}
    ctxs = _ctx_list(rows, context)
    a = act_bytes(precision)
    ref = precision == "reference"
    f8 = "flops_fp8" if ref else "flops_bf16"
    d, n, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    H, Dh, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    Kb, Ed, kd, rk = cfg.dspark_block_size, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok, cfg.dspark_markov_rank
    Tt = len(cfg.dspark_target_layer_ids)
    wrow = window_row_bytes(cfg, precision)
    Tu, Tq = rows * S, rows * Kb
    parts = {"draft_context": Cost(), "draft_stages": Cost(), "draft_head": Cost()}
    u = parts["draft_context"]
    u.add(weight_bytes=fp8_bytes(d, Tt * d) + d * 2, act_bytes=Tu * (Tt * d + d) * a, **{f8: 2 * Tu * d * Tt * d})
    for _ in range(cfg.n_stages):
        u.add(weight_bytes=fp8_bytes(Dh, d) + Dh * 2, cache_bytes=Tu * wrow, act_bytes=Tu * (d + Dh) * a,
              **{f8: 2 * Tu * Dh * d})
    use, use_note = _expert_use(draft_loads, cfg.n_stages, Ed, kd, Tq, ep_ranks)
    stage_ops: dict[str, Cost] = {}

    def op(name):
        return stage_ops.setdefault(name, Cost())

    op("embed").add(cache_bytes=Tq * d * 2, act_bytes=Tq * n * d * a)          # the block's rows only
    ring_rows = sum(min(W, c + S) for c in ctxs)      # the W positions before the block (after the update)
    for s in range(cfg.n_stages):
        _block_parts(op, cfg, Tq, a, f8, Ed, kd, *use[s])
        op("sparse_attention").add(weight_bytes=H * 4, cache_bytes=ring_rows * wrow, act_bytes=Tq * (2 * H * Dh + Dh) * a,
                                   flops_bf16=4 * H * Dh * (ring_rows * Kb + Tq * Kb))
    st = parts["draft_stages"]
    for c in stage_ops.values():
        st.add(**dataclasses.asdict(c))
    hd = parts["draft_head"]
    last = cfg.n_stages - 1
    # final norm, the target's head on every block row, the Markov chain (block sequential steps: each reads the
    # whole [V, r] Markov head -- it does not fit in L2 -- and argmaxes [rows, V] logits), the confidence head
    hd.add(weight_bytes=d * 2 + V * d * 2 + V * rk * 2 + (d + rk) * 2,
           cache_bytes=(Kb - 1) * V * rk * 2 + Tq * rk * 2,
           act_bytes=Tq * d * a * 2 + Tq * V * 4 + Kb * rows * V * 4 * 2,
           flops_bf16=2 * Tq * V * d + 2 * Tq * V * rk + 2 * Tq * (d + rk))
    return parts, {"draft_routed_experts": use_note, "draft_rows_updated": S, "block": Kb, "stages": cfg.n_stages,
                   "last_stage": f"mtp.{last}"}


def draft_floor(cfg: ModelConfig, rows: int, S: int, context, precision: str = "reference", draft_loads=None, *,
                ceilings: dict | None = None, ep_ranks: int = 1) -> dict:
    r = _rates(ceilings)
    parts, notes = draft_costs(cfg, rows, S, context, precision, draft_loads, ep_ranks=ep_ranks)
    if not parts:
        return {"parts": {}, "total": None, "notes": notes}
    return {"parts": {k: _record(c, r) for k, c in parts.items()}, "total": _total(parts, r), "notes": notes,
            "rates": r}


# ------------------------------------------------------------------------------------------ engine iteration
def engine_iteration_floor(cfg: ModelConfig, rows: int, context, speculative: bool, precision: str = "reference",
                           loads=None, draft_loads=None, *, ceilings: dict | None = None, ep_ranks: int = 1,
                           ring_slack: int = 16) -> dict:
    """One engine decode iteration: the target forward over 1 (plain) or block + 1 (speculative) rows per sequence
    with logits for every row (what verification needs), the draft (speculative), and sampling (the logits read
    once, the per-sequence token counts read and written)."""
    r = _rates(ceilings)
    S = 1 + (cfg.dspark_block_size if speculative and cfg.n_stages else 0)
    ops, notes = step_costs(cfg, rows, S, context, precision, loads, logits="all", ep_ranks=ep_ranks,
                            ring_slack=ring_slack)
    ops["sampling"] = Cost(act_bytes=rows * S * cfg.vocab_size * 4 + rows * cfg.vocab_size * 4 * 2)
    if speculative and cfg.n_stages:
        parts, dn = draft_costs(cfg, rows, S, context, precision, draft_loads, ep_ranks=ep_ranks)
        dc = Cost()
        for c in parts.values():
            dc.add(**dataclasses.asdict(c))
        ops["draft"] = dc
        notes.update(dn)
    return {"ops": {k: _record(c, r) for k, c in ops.items()}, "total": _total(ops, r), "notes": notes, "rates": r,
            "rows_per_sequence": S}


# ------------------------------------------------------------------------------------------ the per-op table
FLOORLESS = ("attention_other", "moe_other", "kv_gather")


def op_table(prof: dict | None, floor: dict, extra: dict | None = None) -> list[dict]:
    """Rows {op, ms, share, kernels, floor_ms, pct_of_floor, bound, MB, GFLOP} joining a ``step_profile`` result
    (None: floors only) with ``step_floor``; ``extra``: more rows {op: (ms, floor record)} (the draft, timed as its
    own program). pct_of_floor = floor / time (100 % = at the floor)."""
    ops = (prof or {}).get("ops") or {}
    busy = max((prof or {}).get("busy_ms") or 0.0, 1e-12)
    names = list(ops) + [k for k in floor["ops"] if k not in ops]
    rows = []
    for k in names:
        m = ops.get(k)
        f = floor["ops"].get(k)
        ms = m["ms_per_step"] if m else None
        fm = f.get("floor_ms") if f else None
        rows.append({"op": k, "ms": ms, "share": ms / busy if ms is not None and prof else None,
                     "kernels": m["kernels_per_step"] if m else None, "floor_ms": fm,
                     "pct_of_floor": 100 * fm / ms if fm is not None and ms else None,
                     "bound": f.get("bound") if f else ("no floor" if k in FLOORLESS else None),
                     "MB": f["bytes"] / 1e6 if f else None, "GFLOP": f["flops"] / 1e9 if f else None})
    for k, (ms, f) in (extra or {}).items():
        fm = f.get("floor_ms") if f else None
        rows.append({"op": k, "ms": ms, "share": None, "kernels": None, "floor_ms": fm,
                     "pct_of_floor": 100 * fm / ms if fm is not None and ms else None,
                     "bound": (f.get("bound") if f else None), "MB": f["bytes"] / 1e6 if f else None,
                     "GFLOP": f["flops"] / 1e9 if f else None, "separate_program": True})
    return rows


def format_table(rows: list[dict], prof: dict | None, floor: dict, step_ms: float | None = None) -> str:
    def f(v, nd=3):
        return "-" if v is None else f"{v:.{nd}f}"
    lines = [f"{'op':<30}{'ms':>9}{'share':>7}{'kern':>6}{'floor ms':>10}{'%floor':>8}{'bound':>9}{'MB':>10}"
             f"{'GFLOP':>9}"]
    for r in rows:
        lines.append(f"{r['op'][:30]:<30}{f(r['ms']):>9}{f(None if r['share'] is None else 100 * r['share'], 1):>7}"
                     f"{f(r['kernels'], 0):>6}{f(r['floor_ms'], 4):>10}{f(r['pct_of_floor'], 1):>8}"
                     f"{(r['bound'] or '-'):>9}{f(r['MB'], 2):>10}{f(r['GFLOP'], 3):>9}")
    lines.append("%floor = floor ms / ms (100 % = at the op's own floor); ops with no floor are glue (gathers, "
                 "concatenations) a fused consumer would not run")
    t = floor["total"]
    if prof:
        lines.append(f"{'kernel-busy':<30}{prof['busy_ms']:>9.3f}   wall (traced) {prof['wall_ms']:.3f} ms, idle "
                     f"{prof['idle_ms']:.3f} ms, {prof['kernels_per_step']:.0f} kernels/step")
    if t.get("floor_ms") is not None:
        lines.append(f"whole step: {t['bytes'] / 1e6:.2f} MB -> {t['bytes_ms']:.4f} ms at the read bandwidth; "
                     f"{t['flops'] / 1e9:.3f} GFLOP -> {t['flops_ms']:.4f} ms at the GEMM rates; floor "
                     f"{t['floor_ms']:.4f} ms (sum of op floors {t['sum_op_floors_ms']:.4f} ms)"
                     + (f"; step {step_ms:.3f} ms (floor / step = {100 * t['floor_ms'] / step_ms:.1f} %)" if step_ms else ""))
        if t.get("exact_floor_ms") is not None:
            lines.append(f"exact floor (every GEMM at the bf16 rate, the reference arithmetic on sm_90): "
                         f"{t['exact_floor_ms']:.4f} ms"
                         + (f" (exact floor / step = {100 * t['exact_floor_ms'] / step_ms:.1f} %)" if step_ms else ""))
    return "\n".join(lines)


def engine_floor(eng, context: float, speculative: bool, ceilings: dict | None = None) -> dict | None:
    """``engine_iteration_floor`` at a live ``LLMEngine``'s shapes (``bench engine``): every slot busy (rows =
    ``max_num_seqs`` per DP rank), at ``context`` cached tokens (the run's mean), under ``ceilings`` (None: measured
    now, once per process). Routing is unknown there: uniform routing's expected hit experts. None for a backend
    without a ModelConfig (the toy backend)."""
    cfg = getattr(eng.backend, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        return None
    if ceilings is None:
        from dsflash.bench.ceilings import measure
        ceilings = measure()
    rows = eng.max_num_seqs // max(1, getattr(eng, "dp", 1))
    f = engine_iteration_floor(cfg, rows, int(context), speculative and eng.speculative,
                               getattr(eng.backend, "precision", "reference"), ceilings=ceilings,
                               ring_slack=eng.geo.ring_slack)
    f["context"] = int(context)
    f["note"] = ("one decode iteration with every slot busy; CPU engines may run dequantised bf16 weights, which "
                 "this counts in their stored formats")
    return f
