"""Triton (jax-triton) lightning-indexer scoring; same contract as ``indexer_topk.indexer_scores_reference``.

STATUS: checked against the reference in Triton's interpreter (``scripts/triton_interpret_indexer.py``).
First H200 run (2026-11-30, commit 199278b): scores bit-exact on finite inputs, but NaN head weights gave -0.
scores (the bf16 rounding carried the GPU's canonical NaN into the sign bit); fixed in ``_bf16_rne`` and the relu
made NaN-propagating like the reference -- the fix is checked in the interpreter only, not yet on a GPU.
Timed: 1.11-1.22x the XLA reference at 64-128 sequences, 0.82x at one row (benchmarks/BENCHMARKS.md).

Design: one program per (BS query rows of one sequence, BT compressed entries). The BS rows x Hi heads are stacked
into the M dimension of one MMA, so the K tile [BT, Di] is read once for all of them (decode with draft rows,
prefill) and no [S, Hi, T] intermediate ever reaches memory (the XLA reference materialises qk in bf16):
  qk [BS*Hi, BT] = q . k^T (fp32 acc) -> bf16 -> relu * w -> bf16 -> sum over heads (fp32) -> bf16 -> mask.
Roundings are done with integer round-to-nearest-even (the interpreter's casts truncate; on a GPU this is the
same result as the hardware cast). Selection stays in XLA (``indexer_topk.select``): ``lax.top_k`` over the
written fp32 scores, see NOTES.md for why.

Two forms of the same tile math (``_tile_scores``; same tile shape and warps, so the same bits):
* tile form ``_indexer_score_kernel``: one program per (row block, entry tile). Decode-sized calls.
* row form ``_indexer_score_rows_kernel`` (calls of >= ``ROWS_FORM_MIN_S`` rows, i.e. prefill): one program per row
  block (x a chunk of the entries when rows are few) loops over the entry tiles with q / w loaded once, and only
  stores -inf for the tiles no row of the block sees (>= cdiv(max visible, BT)). Why: in a 16K-token prefill (H100,
  2026-12-06) the tile form took 23.3 + 11.4 ms in the two indexer layers, ~44 ns per tile whatever the size: it
  re-read q from memory once per entry tile and computed the ~half of the tiles that a causal prefill masks whole.
  The per-tile epilogue (two integer RNE roundings, relu, head sum: ~2,200 SASS per warp per tile) is the floor
  left, not the MMA. See NOTES.md "Indexer row form".
Hardware bf16 rounding (``hw_round``, ``_bf16_round`` HW_ROUND 1): the three roundings by the hardware convert
(cvt.rn.bf16.f32) with ``_bf16_rne``'s NaN bits, so the same bits by construction; the row form's loop 2,245 -> 1,472
SASS a tile (sm_90 compile). The default on a GPU since session 18: tests/gpu/test_indexer.py's
test_hw_round_bit_identical passed (25 cases, one H100, 2026-12-06) and the scorer went 0.673 -> 0.455 ms at 4K and
9.41 -> 5.87 ms at 16K causal prefill. Off (and refused when asked) in the interpreter, whose casts truncate.
``hw_round=2`` (HW_ROUND 2, the default on a GPU since session 22: ``HW_ROUND_DEFAULT``): the convert alone, 1,025
instead of 1,472 SASS a tile. It differs from ``_bf16_rne`` only in a NaN's bits (canonical 0x7FFF instead of the
payload with the quiet bit), and every rounding here is followed by an fp32 multiply or add (relu * w, the head sum)
or is the last one, whose input is such a result: the scores are the same bits wherever the GPU's fp32 arithmetic
returns the canonical NaN. tests/gpu/test_indexer.py's test_hw_round_bit_identical passed for it (25 cases incl. NaN
keys / weights / queries with varied payloads, one H200, 2026-12-06); the 16K prefill's indexer op 12.60 -> 10.71 ms.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.triton_common import _bf16_round


@triton.jit
def _relu_nan(x):
    """The reference's relu (jnp.maximum(x, 0)): NaN stays NaN. ``tl.maximum`` lowers to fmax semantics on the
    GPU (max(NaN, 0) = 0), which would turn a NaN logit into a 0 contribution."""
    return tl.where(x > 0.0, x, tl.where(x != x, x, 0.0))


@triton.jit
def _tile_scores(q, w, kt, BS: tl.constexpr, Hi: tl.constexpr, BT: tl.constexpr, ROUND: tl.constexpr,
                 IEEE: tl.constexpr, HW_ROUND: tl.constexpr = 0):
    """Scores [BS, BT] of one tile, unmasked, from q [BS*Hi, Di], w [BS*Hi] (fp32) and keys kt [BT, Di]: the one copy
    of the per-element math that both kernels run (same dot shape, roundings and head-sum reshape)."""
    if IEEE:   # the interpreter's bf16 dot is wrong; fp32 products of bf16 values are exact, so same math
        qk = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(kt))
    if ROUND:
        qk = _bf16_round(qk, HW_ROUND)
    c = _relu_nan(qk) * w[:, None]                      # bf16 x bf16 is exact in fp32: one rounding below
    if ROUND:
        c = _bf16_round(c, HW_ROUND)
    sc = tl.sum(tl.reshape(c, (BS, Hi, BT)), axis=1)    # [BS, BT]
    if ROUND:
        sc = _bf16_round(sc, HW_ROUND)
    return sc


@triton.jit
def _block_qw(q_ptr, w_ptr, b, s0, S: tl.constexpr, Hi: tl.constexpr, Di: tl.constexpr, BS: tl.constexpr):
    """The block's BS query rows x Hi heads stacked into M (m = row * Hi + head): q [BS*Hi, Di], w [BS*Hi] fp32;
    rows past S load zeros."""
    offs_m = tl.arange(0, BS * Hi)
    qrow = s0 + offs_m // Hi
    qmask = qrow < S
    q = tl.load(q_ptr + ((b * S + qrow) * Hi + offs_m % Hi)[:, None] * Di + tl.arange(0, Di)[None, :],
                mask=qmask[:, None], other=0.0)
    w = tl.load(w_ptr + (b * S + qrow) * Hi + offs_m % Hi, mask=qmask, other=0.0).to(tl.float32)
    return q, w


@triton.jit
def _store_scores(sc, o_ptr, cand_ptr, b, rows, rmask, lim, t, tmask, S: tl.constexpr, T: tl.constexpr,
                  HAS_CAND: tl.constexpr):
    """One tile's scores [BS, BT] stored, -inf where the entry is not visible to the row (t >= lim) or outside
    the candidate set."""
    ok = t[None, :] < lim[:, None]
    out = (b * S + rows)[:, None] * T + t[None, :]
    if HAS_CAND:
        ok = ok & (tl.load(cand_ptr + out, mask=rmask[:, None] & tmask[None, :], other=0) != 0)
    tl.store(o_ptr + out, tl.where(ok, sc, float("-inf")), mask=rmask[:, None] & tmask[None, :])


@triton.jit
def _indexer_score_kernel(q_ptr, w_ptr, k_ptr, lim_ptr, cand_ptr, o_ptr, S: tl.constexpr, T: tl.constexpr,
                          Hi: tl.constexpr, Di: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                          HAS_CAND: tl.constexpr, ROUND: tl.constexpr, IEEE: tl.constexpr,
                          HW_ROUND: tl.constexpr = 0):
    """Tile form: one program per (BS rows, one BT tile of entries). Decode-sized calls."""
    nsb = tl.cdiv(S, BS)
    b = (tl.program_id(0) // nsb).to(tl.int64)
    s0 = (tl.program_id(0) % nsb) * BS
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    tmask = t < T
    q, w = _block_qw(q_ptr, w_ptr, b, s0, S, Hi, Di, BS)
    kt = tl.load(k_ptr + (b * T + t)[:, None] * Di + tl.arange(0, Di)[None, :], mask=tmask[:, None], other=0.0)
    sc = _tile_scores(q, w, kt, BS, Hi, BT, ROUND, IEEE, HW_ROUND)
    rows = s0 + tl.arange(0, BS)
    rmask = rows < S
    lim = tl.load(lim_ptr + b * S + rows, mask=rmask, other=0)
    _store_scores(sc, o_ptr, cand_ptr, b, rows, rmask, lim, t, tmask, S, T, HAS_CAND)


@triton.jit
def _indexer_score_rows_kernel(q_ptr, w_ptr, k_ptr, lim_ptr, cand_ptr, o_ptr, S: tl.constexpr, T: tl.constexpr,
                               Hi: tl.constexpr, Di: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                               TPS: tl.constexpr, HAS_CAND: tl.constexpr, ROUND: tl.constexpr, IEEE: tl.constexpr,
                               HW_ROUND: tl.constexpr = 0):
    """Row form (prefill): one program per (BS rows, TPS consecutive BT tiles of entries), q / w / lim loaded once.
    Tiles from the first one no row of the block sees (index >= cdiv(max lim, BT)) are only stored as -inf; the
    others run ``_tile_scores`` and the same masks as the tile form. Row blocks go last-first: in a causal prefill
    the last rows see the most entries, so the longest programs start first."""
    nsb = tl.cdiv(S, BS)
    b = (tl.program_id(0) // nsb).to(tl.int64)
    s0 = (nsb - 1 - tl.program_id(0) % nsb) * BS
    q, w = _block_qw(q_ptr, w_ptr, b, s0, S, Hi, Di, BS)
    offs_d = tl.arange(0, Di)
    rows = s0 + tl.arange(0, BS)
    rmask = rows < S
    lim = tl.load(lim_ptr + b * S + rows, mask=rmask, other=0)
    j0 = tl.program_id(1) * TPS
    j1 = tl.minimum(j0 + TPS, tl.cdiv(T, BT))
    live = tl.maximum(tl.minimum(tl.cdiv(tl.max(lim, axis=0), BT), j1), j0)   # tiles j0 .. live-1 are computed
    # tiles no row of the block sees: -inf only. This loop first: after the main loop its addresses were kept live
    # across it (sm_90: 178 registers, 1 block per SM; first: 128, 2 blocks)
    for j in range(live, j1):
        t = j * BT + tl.arange(0, BT)
        out = (b * S + rows)[:, None] * T + t[None, :]
        tl.store(o_ptr + out, tl.full((BS, BT), float("-inf"), tl.float32), mask=rmask[:, None] & (t < T)[None, :])
    for j in range(j0, live):
        t = j * BT + tl.arange(0, BT)
        tmask = t < T
        kt = tl.load(k_ptr + (b * T + t)[:, None] * Di + offs_d[None, :], mask=tmask[:, None], other=0.0)
        sc = _tile_scores(q, w, kt, BS, Hi, BT, ROUND, IEEE, HW_ROUND)
        _store_scores(sc, o_ptr, cand_ptr, b, rows, rmask, lim, t, tmask, S, T, HAS_CAND)


def launch_params(S, Hi, T):
    """BS query rows per program: enough for M = BS * Hi >= 16 (MMA minimum), 4 rows (M=128 at Hi=32) when there
    are several rows to share a K tile."""
    bs = max(1, 16 // Hi)
    while bs < 4 and bs < S:
        bs *= 2
    BT = 128 if T >= 128 else max(16, triton.next_power_of_2(T))
    return dict(BS=bs, BT=BT, num_warps=8 if bs * Hi >= 128 else 4)


def check_shapes(q, w, k):
    B, S, Hi, Di = q.shape
    if Hi & (Hi - 1) or Di & (Di - 1) or Di < 16:
        raise ValueError(f"the Triton indexer needs power-of-two heads and head dim >= 16, got Hi={Hi}, Di={Di}")


# The row form for calls of at least this many query rows (prefill chunks); the tile form below it. Decode and
# draft-verify calls have <= 8 rows (1 + the draft block; dispatch.PAGED_MAX_ROWS) and keep the form that was measured
# there; the engine's prefill chunks have hundreds of rows or more. The row form is never more work: with
# ``min_programs`` it splits the entries into as many chunks as the tile form has tiles when rows are few.
ROWS_FORM_MIN_S = 16
# split the entries over a second grid axis until there are this many programs (2 blocks x 132 SMs on an H100,
# x ~4 so a causal prefill's uneven programs balance); at 4096 rows of one sequence there are 1024 row blocks already
ROWS_FORM_MIN_PROGRAMS = 1024


def rows_form_splits(B, S, T, BS, BT, min_programs=ROWS_FORM_MIN_PROGRAMS):
    """(splits, tiles per split) of the row form's entry axis: as few splits as give ``min_programs`` programs."""
    nt = triton.cdiv(T, BT)
    progs = B * triton.cdiv(S, BS)
    splits = max(1, min(nt, triton.cdiv(min_programs, progs)))
    tps = triton.cdiv(nt, splits)
    return triton.cdiv(nt, tps), tps


HW_ROUND_DEFAULT = 2   # hw_round=None on a GPU: 1 = the convert with _bf16_rne's NaN bits, 2 = the convert alone


def hw_round_supported():
    """Whether the hardware bf16 rounding (``hw_round=True``) can run as meant: not in Triton's interpreter, whose
    fp32 -> bf16 casts truncate (0x3F818000 -> 0x3F810000 where RNE gives 0x3F820000; 0x7F7FFFFF stays finite).
    There it is refused rather than silently run on the integer path: a fallback would let an interpreter check of
    ``hw_round=True`` pass while checking the other path."""
    return not triton.knobs.runtime.interpret     # (triton is pinned to 3.6, which has the knob)


def indexer_scores_triton(q, w, k, visible, valid, cand=None, *, block_t=None, form="auto",
                          rows_min_s=ROWS_FORM_MIN_S, min_programs=ROWS_FORM_MIN_PROGRAMS, hw_round=None):
    """Scores [B, S, T] fp32 (the reference's contract). ``form``: "tiles" (one program per row block x entry tile),
    "rows" (one program per row block looping over the tiles, skipping those no row sees), or "auto" (rows from
    ``rows_min_s`` query rows). Both forms give the same bits (same tile math, same launch shape per tile).
    ``hw_round``: the three bf16 roundings by the hardware convert with ``_bf16_rne``'s NaN bits (``_bf16_round``
    HW_ROUND 1; the same bits by construction and on the GPU test, ~1,470 instead of 2,245 SASS a tile in the row
    form's loop); 2: the convert alone (NaN canonical; the same scores wherever fp32 arithmetic canonicalises NaN, see
    the module doc). None (default): ``HW_ROUND_DEFAULT`` wherever it can run (``hw_round_supported``: not in Triton's
    interpreter); True / 2 there are refused; False keeps the integer rounding. Only bf16 inputs round (fp32 inputs
    ignore it)."""
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only
    from dsflash.kernels.indexer_topk_shapes import check_inputs as _check

    _check(q, w, k, visible, valid, cand)
    check_shapes(q, w, k)
    if form not in ("auto", "tiles", "rows"):
        raise ValueError(f"form must be 'auto', 'tiles' or 'rows', got {form!r}")
    if hw_round is None:
        hw_round = HW_ROUND_DEFAULT if hw_round_supported() else 0
    elif hw_round not in (False, True, 0, 1, 2):
        raise ValueError(f"hw_round must be None, False, True (1) or 2 (the convert alone), got {hw_round!r}")
    elif hw_round and not hw_round_supported():
        raise ValueError("hw_round=True needs the GPU's cvt.rn.bf16.f32: Triton's interpreter truncates fp32 -> bf16 "
                         "casts, so it cannot run (or check) the hardware-rounding path; use hw_round=False there")
    B, S, Hi, Di = q.shape
    T = k.shape[1]
    prm = launch_params(S, Hi, T)
    if block_t:
        prm["BT"] = block_t
    nw = prm.pop("num_warps")
    lim = jnp.where(valid, visible, 0).astype(jnp.int32)
    has_cand = cand is not None
    cand_arg = cand.astype(jnp.int8) if has_cand else jnp.zeros((1,), jnp.int8)
    rows = form == "rows" or (form == "auto" and S >= rows_min_s)
    if rows:
        splits, tps = rows_form_splits(B, S, T, prm["BS"], prm["BT"], min_programs)
        kernel, grid, extra = _indexer_score_rows_kernel, (B * triton.cdiv(S, prm["BS"]), splits), dict(TPS=tps)
    else:
        kernel, grid, extra = _indexer_score_kernel, (B * triton.cdiv(S, prm["BS"]), triton.cdiv(T, prm["BT"])), {}
    return jt.triton_call(
        q, w.astype(q.dtype), k.astype(q.dtype), lim, cand_arg,
        kernel=kernel,
        out_shape=jax.ShapeDtypeStruct((B, S, T), jnp.float32),
        grid=grid, num_warps=nw, num_stages=2,
        S=S, T=T, Hi=Hi, Di=Di, HAS_CAND=int(has_cand), ROUND=int(q.dtype == jnp.bfloat16),
        IEEE=int(q.dtype == jnp.float32), HW_ROUND=int(hw_round) if q.dtype == jnp.bfloat16 else 0, **prm, **extra)
