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
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16 -> fp32, round to nearest even, NaN kept NaN. The NaN branch matters on the GPU: fp32
    arithmetic there returns the canonical NaN 0x7FFFFFFF, and adding the rounding bias carries it into the sign
    bit (0x80000000 = -0.0): NaN weights came out as -0. scores on the H200 (2026-11-30). The quiet bit is set
    before truncating so a signalling payload cannot truncate to inf."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (u | 0x00400000) & 0xFFFF0000, rounded).to(tl.float32, bitcast=True)


@triton.jit
def _relu_nan(x):
    """The reference's relu (jnp.maximum(x, 0)): NaN stays NaN. ``tl.maximum`` lowers to fmax semantics on the
    GPU (max(NaN, 0) = 0), which would turn a NaN logit into a 0 contribution."""
    return tl.where(x > 0.0, x, tl.where(x != x, x, 0.0))


@triton.jit
def _indexer_score_kernel(q_ptr, w_ptr, k_ptr, lim_ptr, cand_ptr, o_ptr, S: tl.constexpr, T: tl.constexpr,
                          Hi: tl.constexpr, Di: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                          HAS_CAND: tl.constexpr, ROUND: tl.constexpr, IEEE: tl.constexpr):
    nsb = tl.cdiv(S, BS)
    b = (tl.program_id(0) // nsb).to(tl.int64)
    s0 = (tl.program_id(0) % nsb) * BS
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    tmask = t < T
    offs_m = tl.arange(0, BS * Hi)                      # m = row * Hi + head
    qrow = s0 + offs_m // Hi
    qmask = qrow < S
    offs_d = tl.arange(0, Di)
    q = tl.load(q_ptr + ((b * S + qrow) * Hi + offs_m % Hi)[:, None] * Di + offs_d[None, :],
                mask=qmask[:, None], other=0.0)
    kt = tl.load(k_ptr + (b * T + t)[:, None] * Di + offs_d[None, :], mask=tmask[:, None], other=0.0)
    if IEEE:   # the interpreter's bf16 dot is wrong; fp32 products of bf16 values are exact, so same math
        qk = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(kt))
    w = tl.load(w_ptr + (b * S + qrow) * Hi + offs_m % Hi, mask=qmask, other=0.0).to(tl.float32)
    if ROUND:
        qk = _bf16_rne(qk)
    c = _relu_nan(qk) * w[:, None]                      # bf16 x bf16 is exact in fp32: one rounding below
    if ROUND:
        c = _bf16_rne(c)
    sc = tl.sum(tl.reshape(c, (BS, Hi, BT)), axis=1)    # [BS, BT]
    if ROUND:
        sc = _bf16_rne(sc)
    rows = s0 + tl.arange(0, BS)
    rmask = rows < S
    lim = tl.load(lim_ptr + b * S + rows, mask=rmask, other=0)
    ok = t[None, :] < lim[:, None]
    out = (b * S + rows)[:, None] * T + t[None, :]
    if HAS_CAND:
        ok = ok & (tl.load(cand_ptr + out, mask=rmask[:, None] & tmask[None, :], other=0) != 0)
    tl.store(o_ptr + out, tl.where(ok, sc, float("-inf")), mask=rmask[:, None] & tmask[None, :])


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


def indexer_scores_triton(q, w, k, visible, valid, cand=None, *, block_t=None):
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only
    from dsflash.kernels.indexer_topk_shapes import check_inputs as _check

    _check(q, w, k, visible, valid, cand)
    check_shapes(q, w, k)
    B, S, Hi, Di = q.shape
    T = k.shape[1]
    prm = launch_params(S, Hi, T)
    if block_t:
        prm["BT"] = block_t
    nw = prm.pop("num_warps")
    lim = jnp.where(valid, visible, 0).astype(jnp.int32)
    has_cand = cand is not None
    cand_arg = cand.astype(jnp.int8) if has_cand else jnp.zeros((1,), jnp.int8)
    return jt.triton_call(
        q, w.astype(q.dtype), k.astype(q.dtype), lim, cand_arg,
        kernel=_indexer_score_kernel,
        out_shape=jax.ShapeDtypeStruct((B, S, T), jnp.float32),
        grid=(B * triton.cdiv(S, prm["BS"]), triton.cdiv(T, prm["BT"])), num_warps=nw, num_stages=2,
        S=S, T=T, Hi=Hi, Di=Di, HAS_CAND=int(has_cand), ROUND=int(q.dtype == jnp.bfloat16),
        IEEE=int(q.dtype == jnp.float32), **prm)
