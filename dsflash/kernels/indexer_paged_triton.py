"""Triton lightning-indexer scoring straight from the paged index-key pool (decode rows, long context).

Same contract and numerics as ``indexer_topk.indexer_scores_paged_reference`` (= gather every entry's key through
the page table, decode it, then ``indexer_scores_reference``), without the gather: at 32 sequences x 131,072
entries the bf16 copy of every key is 1.07 GB written and read again (2.3 ms on an H200, run 23) while the packed
MXFP4 keys are 285 MB.

Design: one program per (sequence, block of SB query rows, BT entries). It loads the BT entries' pool rows through
the page table (clamped into the pool: unused pages hold -1 or junk, always past the visible entries), decodes the MXFP4 codes
and UE8M0 scales to bf16 in registers (exact: an E2M1 value times a power of two), and keeps that key tile for all
its rows. Per row the MMA is k [BT, Di] . q^T [Di, Hi] -> [BT, Hi]: entries on M, heads on N, so the sum over heads
is a reduction along the MMA's N inside a thread and a few lanes (the row-major [rows x heads, BT] product of
``indexer_topk_triton`` needs a layout conversion to sum over heads). Epilogue as the reference:
  qk = bf16(q . k) -> relu (NaN kept) * w -> bf16 -> fp32 sum over heads -> bf16 -> -inf where masked.
STATUS: checked in Triton's interpreter (tests/test_kernels_indexer_paged.py) and on an H200 (run 25, 2026-12-02:
tests/gpu/test_indexer.py -k paged 12 passed, bit-identical on grid inputs; 1.32 ms at 32 x 6 rows x 128K entries).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.indexer_topk_shapes import paged_supports as supports
from dsflash.kernels.indexer_topk_triton import _relu_nan
from dsflash.kernels.triton_common import _bf16_rne, _dot_bf16


@triton.jit
def _e2m1_f32(code):
    """E2M1 code (int32, 0..15) -> its value as fp32 bits built directly: m >= 2 is 2^((m >> 1) - 1) (1 + (m & 1)
    / 2), m = 1 is 0.5, m = 0 is 0; bit 3 is the sign."""
    m = code & 7
    mag = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 0x3F000000, 0))
    return (mag | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_f32(s):
    """UE8M0 -> 2^(s-127) as quant.e8m0_to_f32 (0 is the subnormal 2^-127)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round(x, DECODE: tl.constexpr):
    """fp32 -> bf16 -> fp32, ties to even: the conversion instruction on the GPU (cvt.rn, one per pair), the integer
    rounding in the interpreter (whose cast truncates)."""
    if DECODE == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    return _bf16_rne(x)


@triton.jit
def _indexer_paged_kernel(q_ptr, w_ptr, kq_ptr, ks_ptr, kx_ptr, pt_ptr, lim_ptr, cand_ptr, o_ptr,
                          S: tl.constexpr, T: tl.constexpr, P: tl.constexpr, PER_PAGE: tl.constexpr,
                          NPOOL: tl.constexpr, Hi: tl.constexpr, HP: tl.constexpr, Di: tl.constexpr, SB: tl.constexpr,
                          BT: tl.constexpr, MXFP4: tl.constexpr, HAS_CAND: tl.constexpr, DECODE: tl.constexpr):
    nsb = tl.cdiv(S, SB)
    b = (tl.program_id(0) // nsb).to(tl.int64)
    s0 = (tl.program_id(0) % nsb) * SB
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    tmask = t < T
    page = tl.load(pt_ptr + b * P + t // PER_PAGE, mask=tmask, other=0).to(tl.int64)
    row = page * PER_PAGE + t % PER_PAGE
    row = tl.minimum(tl.maximum(row, 0), NPOOL - 1)   # unused pages (-1, junk) lie past every row's visible entries:
                                                      # masked below, their loads only need to stay in bounds
    if MXFP4:
        offs_h = tl.arange(0, Di // 2)
        packed = tl.load(kq_ptr + row[:, None] * (Di // 2) + offs_h[None, :], mask=tmask[:, None], other=0)
        packed = packed.to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BT, Di))     # element 2j in the low nibble
        offs_g = tl.arange(0, Di // 32)
        sc = _e8m0_f32(tl.load(ks_ptr + row[:, None] * (Di // 32) + offs_g[None, :], mask=tmask[:, None], other=127))
        vals = tl.reshape(_e2m1_f32(codes), (BT, Di // 32, 32)) * sc[:, :, None]
        kt = tl.reshape(vals, (BT, Di)).to(tl.bfloat16)             # exact: E2M1 x 2^e has <= 2 significant bits
    else:
        offs_d = tl.arange(0, Di)
        kt = tl.load(kx_ptr + row[:, None] * Di + offs_d[None, :], mask=tmask[:, None], other=0.0).to(tl.bfloat16)
    offs_d = tl.arange(0, Di)
    offs_hd = tl.arange(0, HP)                  # heads padded to the MMA's minimum N (HP >= 16)
    hmask = offs_hd < Hi
    for i in tl.range(0, SB):
        r = s0 + i
        rin = r < S
        base = (b * S + r) * Hi
        qt = tl.load(q_ptr + (base + offs_hd)[None, :] * Di + offs_d[:, None], mask=rin & hmask[None, :],
                     other=0.0)                                     # [Di, HP]
        qk = _round(_dot_bf16(kt, qt, DECODE), DECODE)              # [BT, HP] fp32, bf16-valued
        # a padded head contributes relu(0) * -1 = -0.0, the exact identity of an IEEE sum (+0.0 would turn a
        # -0.0 score into +0.0)
        w = tl.load(w_ptr + base + offs_hd, mask=rin & hmask, other=-1.0).to(tl.float32)
        c = _round(_relu_nan(qk) * w[None, :], DECODE)              # bf16 x bf16 is exact in fp32: one rounding
        score = _round(tl.sum(c, axis=1), DECODE)                   # [BT]
        lim = tl.load(lim_ptr + b * S + r, mask=rin, other=0)
        ok = t < lim
        out = (b * S + r) * T + t
        if HAS_CAND:
            ok = ok & (tl.load(cand_ptr + out, mask=tmask & rin, other=0) != 0)
        tl.store(o_ptr + out, tl.where(ok, score, float("-inf")), mask=tmask & rin)


# The row loop's cp.async stages (the launch's num_stages). At 2 the next row's queries are requested at the end of a
# row and waited for at the top of the next (sm_90 SASS: LDGSTS ... BRA; DEPBAR.LE SB0, 0x0), so every row waits one
# L2 round trip; at 3 they are requested a row earlier (DEPBAR.LE SB0, 0x1), 57,600 B of shared memory, 138 registers,
# still 3 programs an SM (NOTES: "The paged indexer scorer under an sm_90 compile"). 2 until timed on a GPU.
NUM_STAGES = 2


def launch_params(S, T):
    """SB rows per program (all of a decode call's rows share one decoded key tile), BT entries."""
    return dict(SB=min(S, 8), BT=128 if T >= 128 else max(16, triton.next_power_of_2(T)), num_warps=4)


def kernel_args(q, w, pool, page_table, per_page, visible, valid, cand):
    """(arrays, constexprs, grid, num_warps) of one launch; shared by the jax-triton call and the interpreter
    check so both run the same arguments."""
    B, S, Hi, Di = q.shape
    P = page_table.shape[1]
    T = P * per_page
    mx = "q" in pool
    npool = (pool["q"] if mx else pool["x"]).shape[0]
    prm = launch_params(S, T)
    nw = prm.pop("num_warps")
    lim = jnp.where(valid, visible, 0).astype(jnp.int32)
    dummy8 = jnp.zeros((1,), jnp.uint8)
    arrays = (q, w.astype(q.dtype), pool["q"] if mx else dummy8, pool["s"] if mx else dummy8,
              dummy8 if mx else pool["x"], page_table.astype(jnp.int32), lim,
              cand.astype(jnp.int8) if cand is not None else jnp.zeros((1,), jnp.int8))
    const = dict(S=S, T=T, P=P, PER_PAGE=per_page, NPOOL=npool, Hi=Hi, HP=max(16, Hi), Di=Di, MXFP4=int(mx),
                 HAS_CAND=int(cand is not None), **prm)
    grid = (B * triton.cdiv(S, prm["SB"]), triton.cdiv(T, prm["BT"]))
    return arrays, const, grid, nw


def indexer_scores_paged_triton(q, w, pool, page_table, per_page, visible, valid, cand=None):
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only
    if not supports(q, pool):
        raise ValueError(f"the paged Triton indexer reads bf16 queries with power-of-two heads / head dim over an "
                         f"MXFP4 ('q', 's') or plain ('x') pool; got q {q.shape} {q.dtype}, pool {sorted(pool)}")
    B, S = q.shape[:2]
    arrays, const, grid, nw = kernel_args(q, w, pool, page_table, per_page, visible, valid, cand)
    return jt.triton_call(*arrays, kernel=_indexer_paged_kernel,
                          out_shape=jax.ShapeDtypeStruct((B, S, const["T"]), jnp.float32),
                          grid=grid, num_warps=nw, num_stages=NUM_STAGES, DECODE=1, **const)
