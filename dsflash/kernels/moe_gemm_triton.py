"""Triton (jax-triton) routed-expert grouped GEMM with MXFP4 weights dequantised in-kernel.

Same signature and contract as ``moe_gemm.routed_moe_reference``; see that module for the numerics.

How it works
------------
* JAX side (cheap, O(T k)): activations take the FP8 E4M3 per-32 quantisation of the reference
  (``quant.fp8_quant``: codes + pow2 scales, bit-identical to the reference round trip); the T*k token
  slots are sorted by expert (stable) and cut into M-tiles of ``BM`` rows that never cross an expert
  (tile table: expert, first row, end row; spare tiles carry expert -1 and exit at once).
* Kernel 1 ``_moe_up_kernel`` (fused gate/up): per (M-tile, N-block of I) it reads the gathered FP8 token
  rows and the MXFP4 W1 and W3 rows of that expert, 32 K-elements at a time. An E2M1 nibble maps
  exactly onto an E4M3 byte worth value * 2^-6 (sign to bit 7, the 3 magnitude bits to bits 2-4;
  subnormal 0.5 included), so the weights go to the FP8 tensor cores without any float math; each
  32-wide K block's partial product is scaled by act_scale * weight_scale * 2^6 (all powers of two,
  exact) and accumulated in fp32. Epilogue: bf16 rounding of both GEMM results, clamp, SiLU, routing weight
  before W2, bf16 rounding, FP8 E4M3 per-32 quantisation of h (codes + pow2 scales) -- the reference's round
  trip, fused.
* Kernel 2 ``_moe_down_kernel``: h (sorted rows, FP8) times MXFP4 W2 the same way, bf16 rounding,
  rows stored back at their unsorted slot; the k slots of a token are summed in fp32 by XLA.
* ``precision="bf16"`` (clearly a variant, not the released numerics): no FP8 activation round trips;
  bf16 activations, weights decoded E2M1 -> E4M3 -> bf16 in-kernel, bf16 tensor cores, h stored bf16.
  ``precision="fp32"`` is not offered by the kernel (use the reference).
* Nibble decoding: ``DECODE="asm"`` (default on GPU) decodes 8 nibbles per 32-bit register with four
  shifts/ands (inline PTX); ``DECODE="tl"`` is the same in plain Triton ops (also runs in Triton's
  interpreter).
* ``kind="ds"`` kernels (``_moe_*_kernel_ds``) use ``tl.dot_scaled`` instead: E4M3 activations with UE8M0 scales
  (or bf16) times packed E2M1 weights with their UE8M0 scales; on Hopper Triton upcasts both to bf16 with the
  scales applied (exact) and accumulates a BK-wide chunk in one bf16 MMA. ``act="bf16rt"`` feeds bf16 carriers of
  the same FP8 round-tripped values (x dequantised in-kernel, h round-tripped in the epilogue).
* ``kind="sk"`` kernels (``_moe_*_kernel_sk``, decode): the K dimension of both GEMMs split over a third grid axis
  (``moe_plan.split_ks``: enough programs to fill the GPU when only a few experts are active), fp32 partials
  summed in a fixed order by ``_moe_up_epilogue_sk`` (then the usual epilogue) and ``_moe_down_reduce_sk`` (then the
  bf16 rounding of each expert's output). ``mma="bf16"`` loads BK-wide weight slabs (16-byte vectors), prefetches
  the next slab into registers and decodes to bf16 with the scales applied (exact) for one bf16 MMA per slab;
  ``mma="fp8"`` is the per-32 FP8-MMA loop above, split.
* ``mma="swap"`` / ``"swap_eo"`` / ``"swap_bd"`` (``_moe_*_kernel_sw``): the same split-K plan with the weights as the
  MMA's left operand (acc^T = W . x^T; Hopper wgmma reads it from registers, and the weight rows fill its M while a
  decode tile's token rows are its N); "swap_eo" keeps the even / odd K elements (low / high nibbles) as two planes
  instead of interleaving them, "swap_bd" builds their bf16 bits in inline PTX. The defaults since 2026-11-30
  (``sw_eo_np`` decode, ``sw_eo_prefill_w8`` prefill) are "swap_eo" with Triton's own load pipelining.
* ``mma="swap_ps"`` (``_moe_*_kernel_ps``, 2026-12-01, named variants, not defaults): swapped operands with the
  scales applied after the MMA -- per 32-wide K group an fp16 MMA of the raw codes (weight nibbles as E4M3 -> fp16,
  the activations' E4M3 codes), then the fp32 partial times weight scale x activation scale (powers of two) into the
  accumulator; FP8 activations only, h as FP8 codes + scales. BM 8 tiles make Triton use mma.sync instead of wgmma.
Configs live in ``moe_plan`` (``NAMED_CONFIGS``); ``pick_config`` chooses by rows per expert and activation format (defaults
from the 2026-11-30 H200 measurements, see NOTES.md and benchmarks/BENCHMARKS.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash import quant
from dsflash.kernels.moe_plan import (DECODE_CONFIG, PREFILL_CONFIG, MoeConfig, fit_config, num_tiles, pick_config,  # noqa: F401
                                      prepare, split_ks, tile_schedule)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _e2m1_to_e4m3_tl(p):
    """uint8 [R, C] nibble pairs -> float8e4nv [R, 2C] worth E2M1 * 2^-6 (low nibble first)."""
    v = p.to(tl.int32)
    lo = v & 0xF
    hi = (v >> 4) & 0xF
    blo = ((lo & 8) << 4) | ((lo & 7) << 2)
    bhi = ((hi & 8) << 4) | ((hi & 7) << 2)
    b = tl.join(blo, bhi)                                   # [R, C, 2]
    b = tl.reshape(b, (p.shape[0], 2 * p.shape[1]))
    return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _e2m1_planes_tl(p):
    """uint8 [R, C] nibble pairs -> two uint8 [R, C] planes of E4M3 bytes worth E2M1 * 2^-6: the low nibbles (even
    K elements) and the high nibbles (odd K elements), not interleaved."""
    v = p.to(tl.int32)
    lo = v & 0xF
    hi = (v >> 4) & 0xF
    blo = ((lo & 8) << 4) | ((lo & 7) << 2)
    bhi = ((hi & 8) << 4) | ((hi & 7) << 2)
    return blo.to(tl.uint8), bhi.to(tl.uint8)


@triton.jit
def _e2m1_planes_asm(p):
    """``_e2m1_planes_tl`` in inline PTX: four shifts/ands per 8 nibbles."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t0, t1;
        shl.b32 t0, $2, 4;
        and.b32 t0, t0, 0x80808080;
        shl.b32 t1, $2, 2;
        and.b32 t1, t1, 0x1C1C1C1C;
        or.b32 $0, t0, t1;
        and.b32 t0, $2, 0x80808080;
        shr.b32 t1, $2, 2;
        and.b32 t1, t1, 0x1C1C1C1C;
        or.b32 $1, t0, t1;
        }
        """,
        constraints="=r,=r,r",
        args=[p],
        dtype=(tl.uint8, tl.uint8),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _e2m1_to_e4m3_asm(p):
    lo, hi = _e2m1_planes_asm(p)
    b = tl.join(lo, hi)
    b = tl.reshape(b, (p.shape[0], 2 * p.shape[1]))
    return b.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp8_to_bf16(w, DECODE: tl.constexpr):
    if DECODE == 1:
        return w.to(tl.bfloat16)
    return w.to(tl.float32).to(tl.bfloat16)   # Triton's interpreter mis-converts fp8 -> bf16 directly


@triton.jit
def _dot_bf16(a, b, DECODE: tl.constexpr):
    if DECODE == 1:
        return tl.dot(a, b)
    # "tl" mode exists for Triton's interpreter, whose bf16 dot is wrong: bf16 products are exact in fp32,
    # so an IEEE fp32 dot of the same values is the same math.
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _e8m0_to_f32(s):
    """UE8M0 bytes -> 2^(s-127) as fp32 (normal range; 0 and 255 never appear in real scales)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_w_block(w_base, s_base, offs_n, kb, KPACK: tl.constexpr, KSC: tl.constexpr, DECODE: tl.constexpr):
    """One 32-wide K block of an expert's [N, K] MXFP4 matrix: (float8 [BN, 32] worth value*2^-6, scale [BN])."""
    p = tl.load(w_base + offs_n[:, None] * KPACK + kb * 16 + tl.arange(0, 16)[None, :])
    s = tl.load(s_base + offs_n * KSC + kb)
    if DECODE == 1:
        w = _e2m1_to_e4m3_asm(p)
    else:
        w = _e2m1_to_e4m3_tl(p)
    return w, _e8m0_to_f32(s) * 64.0


@triton.jit
def _round_bf16(v):
    """fp32 -> nearest bf16 value (ties to even) as fp32, in integer arithmetic: the same as the hardware
    conversion for finite values, and also right in Triton's interpreter (whose fp32->bf16 cast truncates)."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(v):
    """Round fp32 (|v| <= 448) to the E4M3 grid, ties to even, in fp32 arithmetic (so the final conversion is
    exact whatever rounding the conversion instruction uses): add and subtract 2^(E+20), whose fp32 ulp is the
    E4M3 ulp 2^(E-3) of the binade E = max(floor(log2|v|), -6) (fixed 2^-9 in the subnormal range)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    c = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(v < 0, -r, r)


@triton.jit
def _fp8_quant_store(h, q_ptr, s_ptr, rows, rmask, offs_n, n0, NCOLS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, SCALE_U8: tl.constexpr = 0):
    """FP8 E4M3 per-32 quantisation of h (fp32 holding bf16 values) exactly as quant.fp8_quant, then store
    codes [rows, offs_n] and pow2 scales [rows, n0/32 + j]."""
    NB: tl.constexpr = BN // 32
    h3 = tl.reshape(h, (BM, NB, 32))
    amax = tl.max(tl.abs(h3), axis=2)                                   # [BM, NB]
    y = tl.maximum(amax, 1e-4) * (1.0 / 448.0)
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)            # ceil(log2 y) + 127
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)               # exact 1/s
    q = tl.minimum(tl.maximum(h3 * inv[:, :, None], -448.0), 448.0)
    q = tl.reshape(_round_e4m3(q), (BM, BN)).to(tl.float8e4nv)   # exact: q is already on the E4M3 grid
    tl.store(q_ptr + rows[:, None] * NCOLS + offs_n[None, :], q, mask=rmask[:, None])
    offs_b = n0 // 32 + tl.arange(0, NB)
    if SCALE_U8:
        tl.store(s_ptr + rows[:, None] * (NCOLS // 32) + offs_b[None, :], e.to(tl.uint8), mask=rmask[:, None])
    else:
        tl.store(s_ptr + rows[:, None] * (NCOLS // 32) + offs_b[None, :], s, mask=rmask[:, None])


@triton.jit
def _fp8_dequant_bf16(q, sc, BM: tl.constexpr, BK: tl.constexpr):
    """E4M3 codes [BM, BK] times f32 pow2 scales [BM, BK/32] -> bf16 (exact). Done in-kernel on purpose: XLA
    (allow_excess_precision) may drop an f32 -> f8 -> f32 convert pair inside one jitted program, so a JAX-side
    dequantisation next to the quantisation can silently skip the round trip."""
    q3 = tl.reshape(q.to(tl.float32), (BM, BK // 32, 32))
    return tl.reshape(q3 * sc[:, :, None], (BM, BK)).to(tl.bfloat16)


@triton.jit
def _fp8_roundtrip_store_bf16(h, q_ptr, rows, rmask, offs_n, NCOLS: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr):
    """h (fp32 holding bf16 values) -> its FP8 E4M3 per-32 round trip (quant.fp8_roundtrip), stored as bf16.
    Exact: codes have 4 significant bits and the scales are powers of two, so code * scale is a bf16 value."""
    NB: tl.constexpr = BN // 32
    h3 = tl.reshape(h, (BM, NB, 32))
    amax = tl.max(tl.abs(h3), axis=2)
    y = tl.maximum(amax, 1e-4) * (1.0 / 448.0)
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = _round_e4m3(tl.minimum(tl.maximum(h3 * inv[:, :, None], -448.0), 448.0))
    r = tl.reshape(q * s[:, :, None], (BM, BN))
    tl.store(q_ptr + rows[:, None] * NCOLS + offs_n[None, :], r.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _swiglu_h(acc_g, acc_u, rw, LIMIT: tl.constexpr):
    """The reference's rounding points up to h: the fp32 GEMM results x W1^T, x W3^T rounded to bf16 (an FP4
    linear's output dtype, SPEC §12), clamp, SiLU, routing weight (before W2), bf16 rounding. Every up kernel
    family (and the split-K epilogue, after its fixed-order sum) ends here."""
    g = tl.minimum(_round_bf16(acc_g), LIMIT)
    u = tl.minimum(tl.maximum(_round_bf16(acc_u), -LIMIT), LIMIT)
    return _round_bf16(g / (1.0 + tl.exp(-g)) * u * rw[:, None])


@triton.jit
def _store_h(hb, h_ptr, hs_ptr, rows, rmask, offs_n, n0, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             HOUT: tl.constexpr):
    """h (fp32 holding bf16 values) -> HOUT 0: FP8 codes + f32 pow2 scales; 1: bf16 carrier of its FP8 round
    trip; 2: plain bf16 (precision "bf16")."""
    if HOUT == 0:
        _fp8_quant_store(hb, h_ptr, hs_ptr, rows, rmask, offs_n, n0, I, BM, BN)
    elif HOUT == 1:
        _fp8_roundtrip_store_bf16(hb, h_ptr, rows, rmask, offs_n, I, BM, BN)
    else:
        tl.store(h_ptr + rows[:, None] * I + offs_n[None, :], hb.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's M-tile (``program_id(0)``) and N block (``program_id(1)``): the tile's expert e (-1 on a spare
    tile: the kernel returns at once; the tile tables have an entry for every tile, so the other loads are harmless),
    its first sorted row r0, rows r0 + [0, BM) masked to the end of the expert's run, nb and the N columns offs_n."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(tile_e_ptr + t)
    r0 = tl.load(tile_s_ptr + t)
    r1 = tl.load(tile_end_ptr + t)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r1
    offs_n = nb * BN + tl.arange(0, BN)
    return e, r0, rows, rmask, nb, offs_n


@triton.jit
def _expert_w(w_ptr, s_ptr, e, N: tl.constexpr, K: tl.constexpr):
    """Expert e's [N, K] MXFP4 matrix in [E, N, K/2] packed bytes and [E, N, K/32] scales: its two base pointers
    (int64 expert offset)."""
    e64 = e.to(tl.int64)
    return w_ptr + e64 * (N * (K // 2)), s_ptr + e64 * (N * (K // 32))


@triton.jit
def _up_block(xq_ptr, xs_ptr, tok, w1b, s1b, w3b, s3b, offs_n, kb, D: tl.constexpr, KPACK: tl.constexpr,
              KSC: tl.constexpr, ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    """Gate and up products [BM, BN] of the 32-wide K block kb, scales applied: ACT_FP8, FP8 MMA of the gathered x
    codes and the E4M3-mapped nibbles times act_scale * weight_scale * 2^6; else bf16 MMA of bf16 x."""
    xa = tl.load(xq_ptr + tok[:, None] * D + kb * 32 + tl.arange(0, 32)[None, :])
    wg, sg = _load_w_block(w1b, s1b, offs_n, kb, KPACK, KSC, DECODE)
    wu, su = _load_w_block(w3b, s3b, offs_n, kb, KPACK, KSC, DECODE)
    if ACT_FP8:
        sx = tl.load(xs_ptr + tok * KSC + kb)
        dg = tl.dot(xa, tl.trans(wg)) * (sx[:, None] * sg[None, :])
        du = tl.dot(xa, tl.trans(wu)) * (sx[:, None] * su[None, :])
    else:
        dg = _dot_bf16(xa, tl.trans(_fp8_to_bf16(wg, DECODE)), DECODE) * sg[None, :]
        du = _dot_bf16(xa, tl.trans(_fp8_to_bf16(wu, DECODE)), DECODE) * su[None, :]
    return dg, du


@triton.jit
def _down_block(h_ptr, hs_ptr, rows_c, w2b, s2b, offs_n, kb, I: tl.constexpr, KPACK: tl.constexpr,
                KSC: tl.constexpr, ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    """h (sorted rows rows_c; FP8 codes + f32 scales, or bf16) times W2 over the 32-wide K block kb -> [BM, BN],
    scales applied, as ``_up_block``."""
    ha = tl.load(h_ptr + rows_c[:, None] * I + kb * 32 + tl.arange(0, 32)[None, :])
    w, sw = _load_w_block(w2b, s2b, offs_n, kb, KPACK, KSC, DECODE)
    if ACT_FP8:
        sh = tl.load(hs_ptr + rows_c * KSC + kb)
        d = tl.dot(ha, tl.trans(w)) * (sh[:, None] * sw[None, :])
    else:
        d = _dot_bf16(ha, tl.trans(_fp8_to_bf16(w, DECODE)), DECODE) * sw[None, :]
    return d


@triton.jit
def _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D: tl.constexpr):
    """A tile's rows of o, rounded to bf16 once, stored at their unsorted slots of o [S, D]."""
    slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
    tl.store(o_ptr + slot[:, None] * D + offs_n[None, :], _round_bf16(acc).to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _moe_up_kernel(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                   w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                   hq_ptr, hs_ptr,
                   D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, KSUB: tl.constexpr,
                   ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for kk in tl.range(0, KSC, KSUB):
        for j in tl.static_range(KSUB):
            dg, du = _up_block(xq_ptr, xs_ptr, tok, w1b, s1b, w3b, s3b, offs_n, kk + j, D, KPACK, KSC, ACT_FP8,
                               DECODE)
            acc_g += dg
            acc_u += du
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    HOUT: tl.constexpr = 0 if ACT_FP8 else 2        # FP8 codes + f32 scales / plain bf16
    _store_h(_swiglu_h(acc_g, acc_u, rw, LIMIT), hq_ptr, hs_ptr, rows, rmask, offs_n, nb * BN, I, BM, BN, HOUT)


@triton.jit
def _moe_down_kernel(hq_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                     w2_ptr, s2_ptr,
                     o_ptr,
                     D: tl.constexpr, I: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, KSUB: tl.constexpr,
                     ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BM, BN), tl.float32)
    for kk in tl.range(0, KSC, KSUB):
        for j in tl.static_range(KSUB):
            acc += _down_block(hq_ptr, hs_ptr, rows_c, w2b, s2b, offs_n, kk + j, I, KPACK, KSC, ACT_FP8, DECODE)
    _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D)


@triton.jit
def _moe_up_kernel_ds(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      hq_ptr, hs_ptr,
                      D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT_FP8: tl.constexpr):
    """Gate/up via ``tl.dot_scaled``: x as E4M3 with UE8M0 scales per 32 (or bf16), W as packed E2M1 with its
    UE8M0 scales; on Hopper Triton upcasts both to bf16 with the scales applied (exact) and runs bf16 MMA with
    fp32 accumulation over a BK-wide chunk -- the reference's math, no per-32 accumulator rescaling."""
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    w1b = w1b + offs_n[:, None] * KPACK
    w3b = w3b + offs_n[:, None] * KPACK
    s1b = s1b + offs_n[:, None] * KSC
    s3b = s3b + offs_n[:, None] * KSC
    offs_k = tl.arange(0, BK)
    offs_kp = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 32)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, D, BK):
        xa = tl.load(xq_ptr + tok[:, None] * D + k0 + offs_k[None, :])
        wg = tl.load(w1b + k0 // 2 + offs_kp[None, :])
        wu = tl.load(w3b + k0 // 2 + offs_kp[None, :])
        sg = tl.load(s1b + k0 // 32 + offs_ks[None, :])
        su = tl.load(s3b + k0 // 32 + offs_ks[None, :])
        if ACT_FP8 == 1:
            sx = tl.load(xs_ptr + tok[:, None] * KSC + k0 // 32 + offs_ks[None, :])
            acc_g = tl.dot_scaled(xa, sx, "e4m3", tl.trans(wg), sg, "e2m1", acc_g)
            acc_u = tl.dot_scaled(xa, sx, "e4m3", tl.trans(wu), su, "e2m1", acc_u)
        elif ACT_FP8 == 2:
            sx = tl.load(xs_ptr + tok[:, None] * KSC + k0 // 32 + offs_ks[None, :])    # f32 pow2 scales
            xb = _fp8_dequant_bf16(xa, sx, BM, BK)
            acc_g = tl.dot_scaled(xb, None, "bf16", tl.trans(wg), sg, "e2m1", acc_g)
            acc_u = tl.dot_scaled(xb, None, "bf16", tl.trans(wu), su, "e2m1", acc_u)
        else:
            acc_g = tl.dot_scaled(xa, None, "bf16", tl.trans(wg), sg, "e2m1", acc_g)
            acc_u = tl.dot_scaled(xa, None, "bf16", tl.trans(wu), su, "e2m1", acc_u)
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    hb = _swiglu_h(acc_g, acc_u, rw, LIMIT)
    if ACT_FP8 == 1:
        _fp8_quant_store(hb, hq_ptr, hs_ptr, rows, rmask, offs_n, nb * BN, I, BM, BN, 1)
    elif ACT_FP8 == 2:
        _fp8_roundtrip_store_bf16(hb, hq_ptr, rows, rmask, offs_n, I, BM, BN)
    else:
        tl.store(hq_ptr + rows[:, None] * I + offs_n[None, :], hb.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _moe_down_kernel_ds(hq_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT_FP8: tl.constexpr):
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    w2b = w2b + offs_n[:, None] * KPACK
    s2b = s2b + offs_n[:, None] * KSC
    offs_k = tl.arange(0, BK)
    offs_kp = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 32)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, I, BK):
        ha = tl.load(hq_ptr + rows_c[:, None] * I + k0 + offs_k[None, :])
        w = tl.load(w2b + k0 // 2 + offs_kp[None, :])
        sw = tl.load(s2b + k0 // 32 + offs_ks[None, :])
        if ACT_FP8 == 1:
            sh = tl.load(hs_ptr + rows_c[:, None] * KSC + k0 // 32 + offs_ks[None, :])
            acc = tl.dot_scaled(ha, sh, "e4m3", tl.trans(w), sw, "e2m1", acc)
        else:
            acc = tl.dot_scaled(ha, None, "bf16", tl.trans(w), sw, "e2m1", acc)
    _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D)


# ---------------------------------------------------------------- split-K decode kernels (kind "sk")
@triton.jit
def _load_w_slab(w_base, s_base, offs_n, k0, KPACK: tl.constexpr, KSC: tl.constexpr, BK: tl.constexpr):
    """Raw BK-wide K slab of an expert's [N, K] MXFP4 matrix: packed bytes [BN, BK/2] (BK/2 contiguous bytes per
    row: 16-byte vector loads) and UE8M0 scale bytes [BN, BK/32]."""
    p = tl.load(w_base + offs_n[:, None] * KPACK + k0 // 2 + tl.arange(0, BK // 2)[None, :])
    s = tl.load(s_base + offs_n[:, None] * KSC + k0 // 32 + tl.arange(0, BK // 32)[None, :])
    return p, s


@triton.jit
def _slab_k(kbeg, i, KCH: tl.constexpr, BK: tl.constexpr):
    """K offsets of slab i of the chunk [kbeg, kbeg + KCH) and of the slab to prefetch with it (the next one; the
    last step re-reads its own slab: an L2/L1 hit)."""
    return kbeg + i * BK, kbeg + tl.minimum(i + 1, KCH // BK - 1) * BK


@triton.jit
def _decode_slab_bf16(p, s, BN: tl.constexpr, BK: tl.constexpr, DECODE: tl.constexpr):
    """Packed E2M1 [BN, BK/2] + UE8M0 [BN, BK/32] -> bf16 [BN, BK] = value * scale, exact (E2M1 values have two
    significant bits and the scales are powers of two)."""
    if DECODE == 1:
        w = _e2m1_to_e4m3_asm(p)
    else:
        w = _e2m1_to_e4m3_tl(p)
    sc = _e8m0_to_f32(s) * 64.0                                         # E4M3 byte holds value * 2^-6
    w3 = tl.reshape(w.to(tl.float32), (BN, BK // 32, 32)) * sc[:, :, None]
    return tl.reshape(w3, (BN, BK)).to(tl.bfloat16)


@triton.jit
def _moe_up_kernel_sk(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      h_ptr, hs_ptr,
                      S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KSUB: tl.constexpr,
                      KS: tl.constexpr, MMA: tl.constexpr, ACT_FP8: tl.constexpr, HOUT: tl.constexpr,
                      DECODE: tl.constexpr):
    """Gate/up over K chunk ``program_id(2)`` of KS (D / KS wide). KS == 1: the full epilogue here (h out as in
    ``_store_h``). KS > 1: fp32 partials [KS, S, 2, I] (g then u) for ``_moe_up_epilogue_sk``.
    MMA 1: per BK slab one bf16 MMA of the exact bf16 x (FP8 codes * scales, dequantised here) and the decoded,
    scaled weights; the next slab's raw bytes are loaded before this one is used (register double buffer).
    MMA 0: the fp8mma per-32 loop (``_moe_up_kernel``) restricted to the chunk."""
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    if MMA == 1:
        pg, sg = _load_w_slab(w1b, s1b, offs_n, kbeg, KPACK, KSC, BK)
        pu, su = _load_w_slab(w3b, s3b, offs_n, kbeg, KPACK, KSC, BK)
        for i in tl.range(0, KCH // BK):                     # constant bounds (also for Triton's interpreter)
            k0, kn = _slab_k(kbeg, i, KCH, BK)
            npg, nsg = _load_w_slab(w1b, s1b, offs_n, kn, KPACK, KSC, BK)
            npu, nsu = _load_w_slab(w3b, s3b, offs_n, kn, KPACK, KSC, BK)
            xa = tl.load(xq_ptr + tok[:, None] * D + k0 + tl.arange(0, BK)[None, :])
            if ACT_FP8:
                sx = tl.load(xs_ptr + tok[:, None] * KSC + k0 // 32 + tl.arange(0, BK // 32)[None, :])
                xb = _fp8_dequant_bf16(xa, sx, BM, BK)
            else:
                xb = xa
            acc_g += _dot_bf16(xb, tl.trans(_decode_slab_bf16(pg, sg, BN, BK, DECODE)), DECODE)
            acc_u += _dot_bf16(xb, tl.trans(_decode_slab_bf16(pu, su, BN, BK, DECODE)), DECODE)
            pg = npg
            sg = nsg
            pu = npu
            su = nsu
    else:
        for kk in tl.range(0, KCH // 32, KSUB):
            for j in tl.static_range(KSUB):
                dg, du = _up_block(xq_ptr, xs_ptr, tok, w1b, s1b, w3b, s3b, offs_n, kbeg // 32 + kk + j, D, KPACK,
                                   KSC, 1, DECODE)
                acc_g += dg
                acc_u += du
    if KS == 1:
        rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
        _store_h(_swiglu_h(acc_g, acc_u, rw, LIMIT), h_ptr, hs_ptr, rows, rmask, offs_n, nb * BN, I, BM, BN,
                 HOUT)
    else:
        base = h_ptr + (ks * S + rows[:, None]).to(tl.int64) * (2 * I) + offs_n[None, :]
        tl.store(base, acc_g, mask=rmask[:, None])
        tl.store(base + I, acc_u, mask=rmask[:, None])


@triton.jit
def _moe_up_epilogue_sk(part_ptr, rw_ptr, h_ptr, hs_ptr,
                        S: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        KS: tl.constexpr, HOUT: tl.constexpr):
    """Sum the KS fp32 gate/up partials (fixed order ks = 0..KS-1), then the up kernel's epilogue."""
    rb = tl.program_id(0)
    nb = tl.program_id(1)
    rows = rb * BM + tl.arange(0, BM)
    rmask = rows < S
    offs_n = nb * BN + tl.arange(0, BN)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for ks in tl.static_range(KS):
        base = part_ptr + (ks * S + rows[:, None]).to(tl.int64) * (2 * I) + offs_n[None, :]
        acc_g += tl.load(base, mask=rmask[:, None], other=0.0)
        acc_u += tl.load(base + I, mask=rmask[:, None], other=0.0)
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    _store_h(_swiglu_h(acc_g, acc_u, rw, LIMIT), h_ptr, hs_ptr, rows, rmask, offs_n, nb * BN, I, BM, BN, HOUT)


@triton.jit
def _moe_down_kernel_sk(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KSUB: tl.constexpr,
                        KS: tl.constexpr, MMA: tl.constexpr, DECODE: tl.constexpr):
    """h (sorted rows; MMA 1: bf16 [S, I], MMA 0: FP8 codes + f32 scales) times MXFP4 W2 over K chunk
    ``program_id(2)`` of KS. KS == 1: bf16-rounded rows at their unsorted slot of o [S, D]; KS > 1: fp32
    partials [KS, S, D] (unsorted slots) for ``_moe_down_reduce_sk``."""
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    ks = tl.program_id(2)
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BM, BN), tl.float32)
    if MMA == 1:
        pw, sw = _load_w_slab(w2b, s2b, offs_n, kbeg, KPACK, KSC, BK)
        for i in tl.range(0, KCH // BK):
            k0, kn = _slab_k(kbeg, i, KCH, BK)
            npw, nsw = _load_w_slab(w2b, s2b, offs_n, kn, KPACK, KSC, BK)
            ha = tl.load(h_ptr + rows_c[:, None] * I + k0 + tl.arange(0, BK)[None, :])
            acc += _dot_bf16(ha, tl.trans(_decode_slab_bf16(pw, sw, BN, BK, DECODE)), DECODE)
            pw = npw
            sw = nsw
    else:
        for kk in tl.range(0, KCH // 32, KSUB):
            for j in tl.static_range(KSUB):
                acc += _down_block(h_ptr, hs_ptr, rows_c, w2b, s2b, offs_n, kbeg // 32 + kk + j, I, KPACK, KSC, 1,
                                   DECODE)
    if KS == 1:
        _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D)
    else:
        slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        tl.store(o_ptr + (ks * S + slot[:, None]) * D + offs_n[None, :], acc, mask=rmask[:, None])


@triton.jit
def _gemv_slab(p, s, xf, BN: tl.constexpr, BK: tl.constexpr, DECODE: tl.constexpr):
    """One BK slab of a one-row product on the CUDA cores: [BN] = sum_k W[n, k] x[k]. Per 32-block the fp32 sum of
    x times the E4M3-mapped nibbles (value * 2^-6; products exact), then times scale * 2^6 (exact powers of two)."""
    if DECODE == 1:
        w = _e2m1_to_e4m3_asm(p)
    else:
        w = _e2m1_to_e4m3_tl(p)
    w3 = tl.reshape(w.to(tl.float32), (BN, BK // 32, 32))
    blk = tl.sum(w3 * tl.reshape(xf, (1, BK // 32, 32)), axis=2)           # [BN, BK/32]
    return tl.sum(blk * (_e8m0_to_f32(s) * 64.0), axis=1)


@triton.jit
def _moe_up_kernel_gemv(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                        h_ptr, hs_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, ACT_FP8: tl.constexpr,
                        HOUT: tl.constexpr, DECODE: tl.constexpr):
    """Gate/up for one-row tiles (BM = 1: every routed slot is its own tile) without tensor cores: no padding rows,
    no layout conversion for an MMA operand. Same K split, slab prefetch, partials and epilogue as
    ``_moe_up_kernel_sk`` (HOUT 1 or 2)."""
    e, r, _, _, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, 1, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + r).to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BN,), tl.float32)
    acc_u = tl.zeros((BN,), tl.float32)
    pg, sg = _load_w_slab(w1b, s1b, offs_n, kbeg, KPACK, KSC, BK)
    pu, su = _load_w_slab(w3b, s3b, offs_n, kbeg, KPACK, KSC, BK)
    for i in tl.range(0, KCH // BK):
        k0, kn = _slab_k(kbeg, i, KCH, BK)
        npg, nsg = _load_w_slab(w1b, s1b, offs_n, kn, KPACK, KSC, BK)
        npu, nsu = _load_w_slab(w3b, s3b, offs_n, kn, KPACK, KSC, BK)
        xa = tl.load(xq_ptr + tok * D + k0 + tl.arange(0, BK)).to(tl.float32)
        if ACT_FP8:
            sx = tl.load(xs_ptr + tok * KSC + k0 // 32 + tl.arange(0, BK // 32))
            xa = tl.reshape(tl.reshape(xa, (BK // 32, 32)) * sx[:, None], (BK,))   # exact round-tripped x
        acc_g += _gemv_slab(pg, sg, xa, BN, BK, DECODE)
        acc_u += _gemv_slab(pu, su, xa, BN, BK, DECODE)
        pg = npg
        sg = nsg
        pu = npu
        su = nsu
    rows = r + tl.arange(0, 1)
    rmask = rows < S
    if KS == 1:
        rw = tl.load(rw_ptr + rows)
        _store_h(_swiglu_h(acc_g[None, :], acc_u[None, :], rw, LIMIT), h_ptr, hs_ptr, rows, rmask, offs_n, nb * BN,
                 I, 1, BN, HOUT)
    else:
        base = h_ptr + (ks * S + r).to(tl.int64) * (2 * I) + offs_n
        tl.store(base, acc_g)
        tl.store(base + I, acc_u)


@triton.jit
def _moe_down_kernel_gemv(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                          w2_ptr, s2_ptr,
                          o_ptr,
                          S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, DECODE: tl.constexpr):
    """Down projection of one-row tiles (h as bf16 [S, I], sorted rows) on the CUDA cores; KS == 1: bf16-rounded
    row at its slot of o [S, D]; KS > 1: fp32 partials [KS, S, D] for ``_moe_down_reduce_sk``."""
    e, r0, _, _, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, 1, BN)
    if e < 0:
        return
    r = r0.to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BN,), tl.float32)
    pw, sw = _load_w_slab(w2b, s2b, offs_n, kbeg, KPACK, KSC, BK)
    for i in tl.range(0, KCH // BK):
        k0, kn = _slab_k(kbeg, i, KCH, BK)
        npw, nsw = _load_w_slab(w2b, s2b, offs_n, kn, KPACK, KSC, BK)
        ha = tl.load(h_ptr + r * I + k0 + tl.arange(0, BK)).to(tl.float32)
        acc += _gemv_slab(pw, sw, ha, BN, BK, DECODE)
        pw = npw
        sw = nsw
    slot = tl.load(slot_ptr + r).to(tl.int64)
    if KS == 1:
        tl.store(o_ptr + slot * D + offs_n, _round_bf16(acc).to(tl.bfloat16))
    else:
        tl.store(o_ptr + (ks * S + slot) * D + offs_n, acc)


@triton.jit
def _moe_down_reduce_sk(part_ptr, o_ptr, S: tl.constexpr, D: tl.constexpr, BR: tl.constexpr,
                        BN: tl.constexpr, KS: tl.constexpr):
    """o[slot] = bf16(sum over ks = 0..KS-1 of the fp32 partials): each expert's output rounded once, as in the
    reference (the rounding is done here, not in XLA, which could elide an f32 -> bf16 -> f32 pair)."""
    rb = tl.program_id(0)
    nb = tl.program_id(1)
    rows = rb * BR + tl.arange(0, BR)
    rmask = rows < S
    offs = rows[:, None].to(tl.int64) * D + nb * BN + tl.arange(0, BN)[None, :]
    acc = tl.zeros((BR, BN), tl.float32)
    for ks in tl.static_range(KS):
        acc += tl.load(part_ptr + ks * S * D + offs, mask=rmask[:, None], other=0.0)
    tl.store(o_ptr + offs, _round_bf16(acc).to(tl.bfloat16), mask=rmask[:, None])


# ------------------------------------------- swapped-operand kernels (kind "sk", mma "swap" / "swap_eo")
# The weights are the MMA's left operand: acc^T [BN, BM] += W [BN, BK] . x^T [BK, BM]. On Hopper a wgmma takes its
# A operand from registers, so the weights decoded in registers feed the tensor cores without a trip through
# shared memory, and BN (64-128 weight rows) fills the wgmma's M = 64 while the few token rows of a decode tile are
# its N (>= 16). "swap_eo" also drops the nibble interleave: the low nibbles (even K elements) and the high nibbles
# (odd K elements) stay two planes, each multiplied by the matching half of x.
@triton.jit
def _decode_planes_bf16(p, s, BN: tl.constexpr, BK: tl.constexpr, DECODE: tl.constexpr):
    """Packed E2M1 [BN, BK/2] + UE8M0 [BN, BK/32] -> (even, odd) bf16 planes [BN, BK/2] = value * scale (exact):
    plane column j is K element 2j (even) or 2j + 1 (odd) of the slab, in scale group j // 16."""
    if DECODE == 1:
        lo, hi = _e2m1_planes_asm(p)
    else:
        lo, hi = _e2m1_planes_tl(p)
    sc = (_e8m0_to_f32(s) * 64.0)[:, :, None]                          # E4M3 byte holds value * 2^-6
    wl = tl.reshape(lo.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BN, BK // 32, 16)) * sc
    wh = tl.reshape(hi.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BN, BK // 32, 16)) * sc
    return tl.reshape(wl, (BN, BK // 2)).to(tl.bfloat16), tl.reshape(wh, (BN, BK // 2)).to(tl.bfloat16)


@triton.jit
def _e2m1_bf16_planes_asm(p, s):
    """Packed E2M1 bytes p and their UE8M0 scale bytes s (same shape; four bytes of one scale group per register)
    -> (even, odd) bf16 planes = value * 2^(s - 127), built directly as bf16 bits: the nibble's three magnitude bits
    go to bf16 bits 6-8 and its sign to bit 15, which is exactly value * 2^-126 (the subnormal 0.5 included, as
    for the E4M3 mapping), then two exact power-of-two multiplies, 2^100 and 2^(s - 101) (bf16 exponent field
    s + 26: exact for 8 <= s <= 228; each byte uses its own scale byte, whatever elements a register packs).
    ~2.5 integer ops + 1 bf16x2 multiply per weight, no fp32."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 m, w, t, u, c;
        mov.b32 c, 0x71807180;
        prmt.b32 m, $5, 0, 0x4140;
        add.u32 m, m, 0x001A001A;
        shl.b32 m, m, 7;
        prmt.b32 w, $4, 0, 0x4140;
        shl.b32 t, w, 6;
        and.b32 t, t, 0x01C001C0;
        shl.b32 u, w, 12;
        and.b32 u, u, 0x80008000;
        or.b32 t, t, u;
        mul.rn.bf16x2 t, t, c;
        mul.rn.bf16x2 $0, t, m;
        shl.b32 t, w, 2;
        and.b32 t, t, 0x01C001C0;
        shl.b32 u, w, 8;
        and.b32 u, u, 0x80008000;
        or.b32 t, t, u;
        mul.rn.bf16x2 t, t, c;
        mul.rn.bf16x2 $2, t, m;
        prmt.b32 m, $5, 0, 0x4342;
        add.u32 m, m, 0x001A001A;
        shl.b32 m, m, 7;
        prmt.b32 w, $4, 0, 0x4342;
        shl.b32 t, w, 6;
        and.b32 t, t, 0x01C001C0;
        shl.b32 u, w, 12;
        and.b32 u, u, 0x80008000;
        or.b32 t, t, u;
        mul.rn.bf16x2 t, t, c;
        mul.rn.bf16x2 $1, t, m;
        shl.b32 t, w, 2;
        and.b32 t, t, 0x01C001C0;
        shl.b32 u, w, 8;
        and.b32 u, u, 0x80008000;
        or.b32 t, t, u;
        mul.rn.bf16x2 t, t, c;
        mul.rn.bf16x2 $3, t, m;
        }
        """,
        constraints="=r,=r,=r,=r,r,r",
        args=[p, s],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _e2m1_bf16_planes_tl(p, s):
    """``_e2m1_bf16_planes_asm`` in plain Triton ops (Triton's interpreter): the same bf16 bit construction, the
    scale applied in fp32 (exact either way)."""
    v = p.to(tl.uint32)
    lo = ((v & 7) << 6) | ((v & 8) << 12)
    hi = ((v & 0x70) << 2) | ((v & 0x80) << 8)
    f = ((s.to(tl.int32) + 26) << 23).to(tl.float32, bitcast=True)          # 2^(s - 101)
    wl = (lo << 16).to(tl.float32, bitcast=True) * 1.2676506002282294e30 * f   # * 2^100 * 2^(s - 101)
    wh = (hi << 16).to(tl.float32, bitcast=True) * 1.2676506002282294e30 * f
    return wl.to(tl.bfloat16), wh.to(tl.bfloat16)


@triton.jit
def _load_w_sw(w_base, s_base, offs_n, k0, KPACK: tl.constexpr, KSC: tl.constexpr, BK: tl.constexpr,
               EO: tl.constexpr):
    """The raw slab for ``_sw_mma``: as ``_load_w_slab``, or for EO == 2 the bytes as [BN, BK/32, 16] and their
    scale bytes as [BN, BK/32, 1] (so the decoder gets each byte's scale elementwise, by broadcast)."""
    if EO == 2:
        g = tl.arange(0, BK // 32)
        p = tl.load(w_base + offs_n[:, None, None] * KPACK + k0 // 2 + g[None, :, None] * 16
                    + tl.arange(0, 16)[None, None, :])
        s = tl.load(s_base + offs_n[:, None, None] * KSC + k0 // 32 + g[None, :, None])
    else:
        p, s = _load_w_slab(w_base, s_base, offs_n, k0, KPACK, KSC, BK)
    return p, s     # one return: the compiler refuses returns of different shapes, even under a constexpr branch


@triton.jit
def _sw_mma(acc, p, s, xb, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EO: tl.constexpr,
            DECODE: tl.constexpr):
    """acc^T [BN, BM] += decoded weight slab [BN, BK] . xb^T (xb: bf16 [BM, BK], exact carriers)."""
    if EO == 2:
        if DECODE == 1:
            wl, wh = _e2m1_bf16_planes_asm(p, s)
        else:
            wl, wh = _e2m1_bf16_planes_tl(p, s)
        wl = tl.reshape(wl, (BN, BK // 2))
        wh = tl.reshape(wh, (BN, BK // 2))
        xe, xo = tl.split(tl.reshape(xb, (BM, BK // 2, 2)))
        acc += _dot_bf16(wl, tl.trans(xe), DECODE)
        acc += _dot_bf16(wh, tl.trans(xo), DECODE)
    elif EO:
        wl, wh = _decode_planes_bf16(p, s, BN, BK, DECODE)
        xe, xo = tl.split(tl.reshape(xb, (BM, BK // 2, 2)))
        acc += _dot_bf16(wl, tl.trans(xe), DECODE)
        acc += _dot_bf16(wh, tl.trans(xo), DECODE)
    else:
        acc += _dot_bf16(_decode_slab_bf16(p, s, BN, BK, DECODE), tl.trans(xb), DECODE)
    return acc


@triton.jit
def _sw_up_out(acc_g, acc_u, rw_ptr, h_ptr, hs_ptr, rows, rmask, offs_n, nb, ks, S: tl.constexpr, I: tl.constexpr,
               LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, HOUT: tl.constexpr):
    """End of a swapped up kernel (acc^T tiles [BN, BM]): KS == 1, SwiGLU and h stored here; else the fp32
    partials [KS, S, 2, I] for ``_moe_up_epilogue_sk``."""
    if KS == 1:
        rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
        _store_h(_swiglu_h(tl.trans(acc_g), tl.trans(acc_u), rw, LIMIT), h_ptr, hs_ptr, rows, rmask, offs_n,
                 nb * BN, I, BM, BN, HOUT)
    else:
        base = h_ptr + (ks * S + rows[None, :]).to(tl.int64) * (2 * I) + offs_n[:, None]
        tl.store(base, acc_g, mask=rmask[None, :])
        tl.store(base + I, acc_u, mask=rmask[None, :])


@triton.jit
def _sw_down_out(acc, o_ptr, slot_ptr, rows, rmask, offs_n, ks, S: tl.constexpr, D: tl.constexpr,
                 KS: tl.constexpr):
    """End of a swapped down kernel: KS == 1, the rows stored by slot; else fp32 partials [KS, S, D] for
    ``_moe_down_reduce_sk``."""
    if KS == 1:
        _store_o(tl.trans(acc), o_ptr, slot_ptr, rows, rmask, offs_n, D)
    else:
        slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        tl.store(o_ptr + (ks * S + slot[None, :]) * D + offs_n[:, None], acc, mask=rmask[None, :])


@triton.jit
def _moe_up_kernel_sw(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      h_ptr, hs_ptr,
                      S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, EO: tl.constexpr,
                      PREFETCH: tl.constexpr, ACT_FP8: tl.constexpr, HOUT: tl.constexpr, DECODE: tl.constexpr):
    """``_moe_up_kernel_sk`` (mma "bf16") with the operands swapped (block comment above). PREFETCH: the next slab's
    raw bytes are loaded into registers before this one is used; else plain loads that Triton's pipeliner may stage
    (``num_stages``). KS > 1: fp32 partials [KS, S, 2, I] for ``_moe_up_epilogue_sk``; KS == 1: the epilogue here."""
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BN, BM), tl.float32)
    acc_u = tl.zeros((BN, BM), tl.float32)
    if PREFETCH:
        pg, sg = _load_w_sw(w1b, s1b, offs_n, kbeg, KPACK, KSC, BK, EO)
        pu, su = _load_w_sw(w3b, s3b, offs_n, kbeg, KPACK, KSC, BK, EO)
    for i in tl.range(0, KCH // BK):
        k0, kn = _slab_k(kbeg, i, KCH, BK)
        if PREFETCH:
            npg, nsg = _load_w_sw(w1b, s1b, offs_n, kn, KPACK, KSC, BK, EO)
            npu, nsu = _load_w_sw(w3b, s3b, offs_n, kn, KPACK, KSC, BK, EO)
        else:
            pg, sg = _load_w_sw(w1b, s1b, offs_n, k0, KPACK, KSC, BK, EO)
            pu, su = _load_w_sw(w3b, s3b, offs_n, k0, KPACK, KSC, BK, EO)
        xa = tl.load(xq_ptr + tok[:, None] * D + k0 + tl.arange(0, BK)[None, :])
        if ACT_FP8:
            sx = tl.load(xs_ptr + tok[:, None] * KSC + k0 // 32 + tl.arange(0, BK // 32)[None, :])
            xb = _fp8_dequant_bf16(xa, sx, BM, BK)
        else:
            xb = xa
        acc_g = _sw_mma(acc_g, pg, sg, xb, BM, BN, BK, EO, DECODE)
        acc_u = _sw_mma(acc_u, pu, su, xb, BM, BN, BK, EO, DECODE)
        if PREFETCH:
            pg = npg
            sg = nsg
            pu = npu
            su = nsu
    _sw_up_out(acc_g, acc_u, rw_ptr, h_ptr, hs_ptr, rows, rmask, offs_n, nb, ks, S, I, LIMIT, BM, BN, KS, HOUT)


@triton.jit
def _moe_down_kernel_sw(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, EO: tl.constexpr,
                        PREFETCH: tl.constexpr, DECODE: tl.constexpr):
    """``_moe_down_kernel_sk`` (mma "bf16", h as bf16 [S, I] in sorted rows) with the operands swapped."""
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    ks = tl.program_id(2)
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BN, BM), tl.float32)
    if PREFETCH:
        pw, sw = _load_w_sw(w2b, s2b, offs_n, kbeg, KPACK, KSC, BK, EO)
    for i in tl.range(0, KCH // BK):
        k0, kn = _slab_k(kbeg, i, KCH, BK)
        if PREFETCH:
            npw, nsw = _load_w_sw(w2b, s2b, offs_n, kn, KPACK, KSC, BK, EO)
        else:
            pw, sw = _load_w_sw(w2b, s2b, offs_n, k0, KPACK, KSC, BK, EO)
        ha = tl.load(h_ptr + rows_c[:, None] * I + k0 + tl.arange(0, BK)[None, :])
        acc = _sw_mma(acc, pw, sw, ha, BM, BN, BK, EO, DECODE)
        if PREFETCH:
            pw = npw
            sw = nsw
    _sw_down_out(acc, o_ptr, slot_ptr, rows, rmask, offs_n, ks, S, D, KS)


# --------------------------- swapped operands, scales applied after the MMA (kind "sk", mma "swap_ps", 2026-12-01)
# The weight path of "swap_eo" spends ~3.5 of its ~6.8 SASS instructions per weight element on float work: E4M3 ->
# f16 unpack, f16 -> f32, the fp32 scale multiply and the bf16 pack. Here nothing is scaled before the MMA: per
# 32-wide K group (one UE8M0 scale per weight row, one pow2 scale per activation row) the MMA multiplies the raw
# codes -- weight nibbles as E4M3 bytes unpacked to fp16 (value * 2^-6, exact) and the activation's E4M3 codes as
# fp16 (exact) -- into a fresh fp32 partial, and the partial is scaled once per accumulator element:
# acc^T[n, m] += part[n, m] * (2^(s_w[n] - 121) * s_x[m]) (powers of two: the multiply is exact, one rounding in the
# add, as when the MMA accumulates). Per weight element that leaves the nibble -> E4M3 bit ops and half an unpack;
# per accumulator element an FMUL and an FFMA per group (BM = 16, BN = 64, 128 threads: 0.5 + 0.5 per element).
# Needs FP8 activations (precision "reference"); h travels as FP8 codes + f32 pow2 scales (HOUT 0).
@triton.jit
def _dot_f16(a, b, DECODE: tl.constexpr):
    if DECODE == 1:
        return tl.dot(a, b)
    # Triton's interpreter: fp16 products are exact in fp32, so an IEEE fp32 dot of the same values is the same math
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _fp8_to_f16(v, DECODE: tl.constexpr):
    if DECODE == 1:
        return v.to(tl.float16)
    return v.to(tl.float32).to(tl.float16)     # exact either way (E4M3 values are fp16 values)


@triton.jit
def _ps_perm(t, R: tl.constexpr, PERM: tl.constexpr):
    """PERM: [R, 16] bytes of one K group (byte b = 4c + 2h + q) -> column order h*8 + c*2 + q. The MMA sums over K,
    so any order shared by both operands gives the same products; this one puts the 4 bytes a thread holds in the
    wgmma's 16-bit register fragment (columns 2c, 2c+1, 2c+8, 2c+9 of a 16-wide K step) next to each other in memory:
    one 32-bit word per row and thread instead of 2-byte pieces reassembled byte by byte (sm_90 up loop 746 -> 670 at
    BM 16). With BM 8 Triton lowers the dot to mma.sync, whose operand layout it builds differently: there the
    natural order is the cheap one (PERM 0: 458 SASS per iteration vs 595 permuted)."""
    if PERM:
        return tl.reshape(tl.permute(tl.reshape(t, (R, 4, 2, 2)), (0, 2, 1, 3)), (R, 16))
    return t


@triton.jit
def _ps_weight_planes(w_base, offs_n, kg, KPACK: tl.constexpr, BN: tl.constexpr, DECODE: tl.constexpr,
                      PERM: tl.constexpr):
    """One 32-wide K group of an expert's packed rows: (low-nibble, high-nibble) fp16 planes [BN, 16] worth
    E2M1 * 2^-6 (exact), columns in ``_ps_perm`` order."""
    p = _ps_perm(tl.load(w_base + offs_n[:, None] * KPACK + kg // 2 + tl.arange(0, 16)[None, :]), BN, PERM)
    if DECODE == 1:
        lo, hi = _e2m1_planes_asm(p)
    else:
        lo, hi = _e2m1_planes_tl(p)
    return (_fp8_to_f16(lo.to(tl.float8e4nv, bitcast=True), DECODE),
            _fp8_to_f16(hi.to(tl.float8e4nv, bitcast=True), DECODE))


@triton.jit
def _ps_group(acc, w_base, swf, offs_n, kg, x0, x1, sxf, KPACK: tl.constexpr, BN: tl.constexpr,
              DECODE: tl.constexpr, PERM: tl.constexpr):
    """acc^T [BN, BM] += (W_group [BN, 32] . x_group^T) * outer(weight scale swf [BN], activation scale sxf [BM])."""
    wl, wh = _ps_weight_planes(w_base, offs_n, kg, KPACK, BN, DECODE, PERM)
    part = _dot_f16(wl, tl.trans(x0), DECODE)
    part += _dot_f16(wh, tl.trans(x1), DECODE)
    return acc + part * (swf[:, None] * sxf[None, :])


@triton.jit
def _ps_wscales(s_base, offs_n, k0, KSC: tl.constexpr, G: tl.constexpr):
    """UE8M0 scale bytes of rows offs_n for the slab at k0: G contiguous bytes a row (G = BK / 32 in 1, 2, 4), read
    as one little-endian 8/16/32-bit word per row (aligned: BK divides K, so KSC = K / 32, k0 / 32 and the expert
    offset N * KSC are multiples of G); ``_ps_wscale`` picks a group. Loaded in the accumulator's row layout, so no
    shuffles (a [BN, G] tile needed warp shuffles to pick a column: 403 -> 376 SASS per iteration of the down kernel
    at BN 64, BK 128)."""
    tl.static_assert(G == 1 or G == 2 or G == 4, "swap_ps: BK must be 32, 64 or 128")
    ptr = s_base + offs_n * KSC + k0 // 32
    if G == 4:
        w = tl.load(ptr.to(tl.pointer_type(tl.uint32), bitcast=True)).to(tl.int32, bitcast=True)
    elif G == 2:
        w = tl.load(ptr.to(tl.pointer_type(tl.uint16), bitcast=True)).to(tl.int32)
    else:
        w = tl.load(ptr).to(tl.int32)
    return w


@triton.jit
def _ps_wscale(words, g: tl.constexpr):
    """Group g's scale byte s from ``_ps_wscales`` -> 2^(s - 127) * 2^6 as fp32 (the 2^6 undoes the E4M3 mapping's
    2^-6)."""
    s = (words >> (8 * g)) & 0xFF
    return ((s + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ps_act(q_ptr, rows_q, kg, NCOLS: tl.constexpr, BM: tl.constexpr, DECODE: tl.constexpr, PERM: tl.constexpr):
    """Activation codes of rows rows_q (FP8 [., NCOLS]) at K group kg as the two fp16 [BM, 16] operands matching
    ``_ps_weight_planes`` (even / odd K elements of the bytes in ``_ps_perm`` order)."""
    xa = _fp8_to_f16(tl.load(q_ptr + rows_q[:, None] * NCOLS + kg + tl.arange(0, 32)[None, :]), DECODE)
    if PERM:
        xa = tl.reshape(tl.permute(tl.reshape(xa, (BM, 4, 2, 2, 2)), (0, 2, 1, 3, 4)), (BM, 16, 2))
    else:
        xa = tl.reshape(xa, (BM, 16, 2))
    return tl.split(xa)


@triton.jit
def _moe_up_kernel_ps(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      h_ptr, hs_ptr,
                      S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                      ACT_FP8: tl.constexpr, HOUT: tl.constexpr, DECODE: tl.constexpr, PERM: tl.constexpr = 1):
    """``_moe_up_kernel_sw`` with the scales applied after the MMA, one 32-wide K group at a time (block comment
    above); BK / 32 groups per loop iteration (unrolled), the slab's scales loaded once per iteration (G contiguous
    bytes a row) and picked per group in registers. KS > 1: fp32 partials as the sw kernel; KS == 1: the epilogue
    here (HOUT 0: FP8 codes + f32 scales)."""
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BN, BM), tl.float32)
    acc_u = tl.zeros((BN, BM), tl.float32)
    G: tl.constexpr = BK // 32
    for i in tl.range(0, KCH // BK):
        k0 = kbeg + i * BK
        sg = _ps_wscales(s1b, offs_n, k0, KSC, G)
        su = _ps_wscales(s3b, offs_n, k0, KSC, G)
        for g in tl.static_range(G):
            kg = k0 + g * 32
            x0, x1 = _ps_act(xq_ptr, tok, kg, D, BM, DECODE, PERM)
            sxg = tl.load(xs_ptr + tok * KSC + kg // 32)
            acc_g = _ps_group(acc_g, w1b, _ps_wscale(sg, g), offs_n, kg, x0, x1, sxg, KPACK, BN, DECODE, PERM)
            acc_u = _ps_group(acc_u, w3b, _ps_wscale(su, g), offs_n, kg, x0, x1, sxg, KPACK, BN, DECODE, PERM)
    _sw_up_out(acc_g, acc_u, rw_ptr, h_ptr, hs_ptr, rows, rmask, offs_n, nb, ks, S, I, LIMIT, BM, BN, KS, HOUT)


@triton.jit
def _moe_down_kernel_ps(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                        DECODE: tl.constexpr, PERM: tl.constexpr = 1):
    """``_moe_down_kernel_sw`` with the scales applied after the MMA (as the up kernel); h as FP8 codes [S, I] + f32
    pow2 scales [S, I/32] in sorted rows."""
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    ks = tl.program_id(2)
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BN, BM), tl.float32)
    G: tl.constexpr = BK // 32
    for i in tl.range(0, KCH // BK):
        k0 = kbeg + i * BK
        sw = _ps_wscales(s2b, offs_n, k0, KSC, G)
        for g in tl.static_range(G):
            kg = k0 + g * 32
            h0, h1 = _ps_act(h_ptr, rows_c, kg, I, BM, DECODE, PERM)
            acc = _ps_group(acc, w2b, _ps_wscale(sw, g), offs_n, kg, h0, h1,
                            tl.load(hs_ptr + rows_c * KSC + kg // 32), KPACK, BN, DECODE, PERM)
    _sw_down_out(acc, o_ptr, slot_ptr, rows, rmask, offs_n, ks, S, D, KS)


# ------------------------------------------------------------------------------------------ JAX side
def _check_shapes(x, idx, w1, s1, w3, s3, w2, s2, cfg):
    T, d = x.shape
    E, I, dh = w1.shape
    assert dh * 2 == d and w3.shape == w1.shape and w2.shape == (E, d, I // 2), (x.shape, w1.shape, w2.shape)
    assert s1.shape == (E, I, d // 32) and s3.shape == s1.shape and s2.shape == (E, d, I // 32)
    for n, b in (("I", cfg.BN_UP), ("d", cfg.BN_DOWN)):
        size = I if n == "I" else d
        if size % b or b % 32:
            raise ValueError(f"{n}={size} must be a multiple of the block {b} (itself a multiple of 32)")
    if cfg.kind == "sk":
        unit = 32 * cfg.KSUB if cfg.mma == "fp8" else cfg.BK
        if d % unit or I % unit or unit % 32:
            raise ValueError(f"K unit {unit} (BK or 32*KSUB) must be a multiple of 32 dividing d={d} and I={I}")
    if cfg.kind == "ds" and (d % cfg.BK or I % cfg.BK or cfg.BK % 32):
        raise ValueError(f"BK={cfg.BK} must be a multiple of 32 dividing d={d} and I={I}")
    if (d // 32) % cfg.KSUB or (I // 32) % cfg.KSUB:
        raise ValueError(f"KSUB={cfg.KSUB} must divide d/32={d // 32} and I/32={I // 32}")


def _as_u8(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == jnp.int8 else a


def _launch(p, w1, s1, w3, s3, w2, s2, *, T, k, d, I, E, limit, act_fp8, cfg):
    """The two kernel launches on prepared inputs (``prepare``) -> (o [S, d] bf16 per slot, hq, hs)."""
    import jax_triton as jt  # lazy: GPU only

    S = T * k
    TM = num_tiles(S, E, cfg.BM)
    hdt = jnp.float8_e4m3fn if act_fp8 else jnp.bfloat16
    if cfg.kind == "ds":
        mode = (2 if cfg.act == "bf16rt" else 1) if act_fp8 else 0
        if mode == 2:
            # bf16 carriers of the FP8 round trips: x codes are dequantised to bf16 in-kernel (the reference's own
            # xa, bit for bit; not in JAX, where XLA may elide the f32->f8->f32 pair) and h leaves the gate/up
            # kernel already round-tripped as bf16, so both GEMMs take bf16 lhs.
            xq, xs = p["xq"], p["xs"]
            hdt = jnp.bfloat16
        else:
            xq = p["xq"]
            xs = quant.f32_pow2_to_e8m0(p["xs"]) if act_fp8 else p["xs"]
        hq, hs = jt.triton_call(
            xq, xs, p["tok"], p["rw"], p["tile_e"], p["tile_s"], p["tile_end"], w1, s1, w3, s3,
            kernel=_moe_up_kernel_ds,
            out_shape=(jax.ShapeDtypeStruct((S, I), hdt), jax.ShapeDtypeStruct((S, I // 32), jnp.uint8)),
            grid=(TM, I // cfg.BN_UP), num_warps=cfg.warps_up, num_stages=cfg.stages,
            D=d, I=I, LIMIT=float(limit), BM=cfg.BM, BN=cfg.BN_UP, BK=cfg.BK, ACT_FP8=mode)
        o = jt.triton_call(
            hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2,
            kernel=_moe_down_kernel_ds,
            out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
            grid=(TM, d // cfg.BN_DOWN), num_warps=cfg.warps_down, num_stages=cfg.stages,
            D=d, I=I, BM=cfg.BM, BN=cfg.BN_DOWN, BK=cfg.BK, ACT_FP8=mode)
        return o, hq, hs
    if cfg.kind == "sk":
        return _launch_sk(jt, p, w1, s1, w3, s3, w2, s2, S=S, TM=TM, d=d, I=I, E=E, limit=limit, act_fp8=act_fp8,
                          cfg=cfg)
    hq, hs = jt.triton_call(
        p["xq"], p["xs"], p["tok"], p["rw"], p["tile_e"], p["tile_s"], p["tile_end"], w1, s1, w3, s3,
        kernel=_moe_up_kernel,
        out_shape=(jax.ShapeDtypeStruct((S, I), hdt), jax.ShapeDtypeStruct((S, I // 32), jnp.float32)),
        grid=(TM, I // cfg.BN_UP), num_warps=cfg.warps_up, num_stages=cfg.stages,
        D=d, I=I, LIMIT=float(limit), BM=cfg.BM, BN=cfg.BN_UP, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8),
        DECODE=int(cfg.decode == "asm"))
    o = jt.triton_call(
        hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2,
        kernel=_moe_down_kernel,
        out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
        grid=(TM, d // cfg.BN_DOWN), num_warps=cfg.warps_down, num_stages=cfg.stages,
        D=d, I=I, BM=cfg.BM, BN=cfg.BN_DOWN, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8), DECODE=int(cfg.decode == "asm"))
    return o, hq, hs


def _block_dividing(n, cap):
    """Largest power-of-two block <= cap (and >= 32) dividing n (n is a multiple of 32)."""
    b = cap
    while n % b:
        b //= 2
    return b


def sk_plan(cfg: MoeConfig, S, E, d, I, act_fp8=True):
    """Static launch plan of a kind-"sk" config: K splits, the MMA flavour and how h travels."""
    ks_up, ks_down = split_ks(cfg, S, E, d, I)
    mma = {"fp8": 0, "bf16": 1, "gemv": 2, "swap": 3, "swap_eo": 4, "swap_bd": 5, "swap_ps": 6}[cfg.mma]
    if not act_fp8 and mma in (0, 6):
        raise NotImplementedError(f"kind 'sk' with mma={cfg.mma!r} needs FP8 activations (precision 'reference')")
    if mma == 2 and cfg.BM != 1:
        raise ValueError("mma='gemv' needs BM=1 (one row per tile)")
    hout = (0 if mma in (0, 6) else 1) if act_fp8 else 2   # FP8 codes + scales / bf16 carrier of the round trip / bf16
    return dict(ks_up=ks_up, ks_down=ks_down, mma=mma, hout=hout)


def _launch_sk(jt, p, w1, s1, w3, s3, w2, s2, *, S, TM, d, I, E, limit, act_fp8, cfg):
    """Split-K decode launches: up (+ epilogue when split), down (+ reduction when split)."""
    pl = sk_plan(cfg, S, E, d, I, act_fp8)
    ks_up, ks_down, mma, hout = pl["ks_up"], pl["ks_down"], pl["mma"], pl["hout"]
    dec = int(cfg.decode == "asm")
    hdt = jnp.float8_e4m3fn if hout == 0 else jnp.bfloat16
    h_shapes = (jax.ShapeDtypeStruct((S, I), hdt), jax.ShapeDtypeStruct((S, I // 32), jnp.float32))
    if mma == 6:
        kern_up, kern_down = _moe_up_kernel_ps, _moe_down_kernel_ps
        common = dict(D=d, I=I, BM=cfg.BM, BK=cfg.BK, DECODE=dec, PERM=int(cfg.BM >= 16))   # wgmma / mma.sync
    elif mma >= 3:
        kern_up, kern_down = _moe_up_kernel_sw, _moe_down_kernel_sw
        common = dict(D=d, I=I, BM=cfg.BM, BK=cfg.BK, EO=mma - 3, PREFETCH=int(cfg.prefetch), DECODE=dec)
    else:
        kern_up, kern_down = _moe_up_kernel_sk, _moe_down_kernel_sk
        common = dict(D=d, I=I, BM=cfg.BM, BK=cfg.BK, KSUB=cfg.KSUB, MMA=mma, DECODE=dec)
    up_args = (p["xq"], p["xs"], p["tok"], p["rw"], p["tile_e"], p["tile_s"], p["tile_end"], w1, s1, w3, s3)
    if mma == 2:
        return _launch_gemv(jt, p, up_args, w2, s2, h_shapes, S=S, TM=TM, d=d, I=I, limit=limit, act_fp8=act_fp8,
                            cfg=cfg, ks_up=ks_up, ks_down=ks_down, hout=hout, dec=dec)
    if ks_up == 1:
        hq, hs = jt.triton_call(
            *up_args, kernel=kern_up, out_shape=h_shapes,
            grid=(TM, I // cfg.BN_UP, 1), num_warps=cfg.warps_up, num_stages=cfg.stages,
            S=S, LIMIT=float(limit), BN=cfg.BN_UP, KS=1, ACT_FP8=int(act_fp8), HOUT=hout, **common)
    else:
        part, _ = jt.triton_call(
            *up_args, kernel=kern_up,
            out_shape=(jax.ShapeDtypeStruct((ks_up, S, 2 * I), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)),
            grid=(TM, I // cfg.BN_UP, ks_up), num_warps=cfg.warps_up, num_stages=cfg.stages,
            S=S, LIMIT=float(limit), BN=cfg.BN_UP, KS=ks_up, ACT_FP8=int(act_fp8), HOUT=hout, **common)
        hq, hs = _up_epilogue(jt, part, p, h_shapes, S=S, I=I, limit=limit, ks_up=ks_up, hout=hout)
    down_args = (hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2)
    if ks_down == 1:
        o = jt.triton_call(
            *down_args, kernel=kern_down, out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
            grid=(TM, d // cfg.BN_DOWN, 1), num_warps=cfg.warps_down, num_stages=cfg.stages,
            S=S, BN=cfg.BN_DOWN, KS=1, **common)
    else:
        part = jt.triton_call(
            *down_args, kernel=kern_down, out_shape=jax.ShapeDtypeStruct((ks_down, S, d), jnp.float32),
            grid=(TM, d // cfg.BN_DOWN, ks_down), num_warps=cfg.warps_down, num_stages=cfg.stages,
            S=S, BN=cfg.BN_DOWN, KS=ks_down, **common)
        o = _down_reduce(jt, part, S=S, d=d, ks_down=ks_down)
    return o, hq, hs


def _up_epilogue(jt, part, p, h_shapes, *, S, I, limit, ks_up, hout):
    BME, BNE = 16, _block_dividing(I, 128)
    return jt.triton_call(
        part, p["rw"], kernel=_moe_up_epilogue_sk, out_shape=h_shapes,
        grid=(triton.cdiv(S, BME), I // BNE), num_warps=4, num_stages=1,
        S=S, I=I, LIMIT=float(limit), BM=BME, BN=BNE, KS=ks_up, HOUT=hout)


def _down_reduce(jt, part, *, S, d, ks_down):
    BR, BNR = 8, _block_dividing(d, 512)
    return jt.triton_call(
        part, kernel=_moe_down_reduce_sk, out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
        grid=(triton.cdiv(S, BR), d // BNR), num_warps=4, num_stages=1, S=S, D=d, BR=BR, BN=BNR, KS=ks_down)


def _launch_gemv(jt, p, up_args, w2, s2, h_shapes, *, S, TM, d, I, limit, act_fp8, cfg, ks_up, ks_down, hout, dec):
    """mma="gemv" (BM = 1): the CUDA-core one-row kernels, same split / epilogue / reduction kernels."""
    kw = dict(S=S, D=d, I=I, BK=cfg.BK, DECODE=dec)
    if ks_up == 1:
        hq, hs = jt.triton_call(
            *up_args, kernel=_moe_up_kernel_gemv, out_shape=h_shapes,
            grid=(TM, I // cfg.BN_UP, 1), num_warps=cfg.warps_up, num_stages=cfg.stages,
            LIMIT=float(limit), BN=cfg.BN_UP, KS=1, ACT_FP8=int(act_fp8), HOUT=hout, **kw)
    else:
        part, _ = jt.triton_call(
            *up_args, kernel=_moe_up_kernel_gemv,
            out_shape=(jax.ShapeDtypeStruct((ks_up, S, 2 * I), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)),
            grid=(TM, I // cfg.BN_UP, ks_up), num_warps=cfg.warps_up, num_stages=cfg.stages,
            LIMIT=float(limit), BN=cfg.BN_UP, KS=ks_up, ACT_FP8=int(act_fp8), HOUT=hout, **kw)
        hq, hs = _up_epilogue(jt, part, p, h_shapes, S=S, I=I, limit=limit, ks_up=ks_up, hout=hout)
    down_args = (hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2)
    if ks_down == 1:
        o = jt.triton_call(
            *down_args, kernel=_moe_down_kernel_gemv, out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
            grid=(TM, d // cfg.BN_DOWN, 1), num_warps=cfg.warps_down, num_stages=cfg.stages,
            BN=cfg.BN_DOWN, KS=1, **kw)
    else:
        part = jt.triton_call(
            *down_args, kernel=_moe_down_kernel_gemv, out_shape=jax.ShapeDtypeStruct((ks_down, S, d), jnp.float32),
            grid=(TM, d // cfg.BN_DOWN, ks_down), num_warps=cfg.warps_down, num_stages=cfg.stages,
            BN=cfg.BN_DOWN, KS=ks_down, **kw)
        o = _down_reduce(jt, part, S=S, d=d, ks_down=ks_down)
    return o, hq, hs


def routed_moe_triton(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision="reference",
                      config: MoeConfig | None = None, return_intermediates=False):
    if precision not in ("reference", "bf16"):
        raise NotImplementedError(f"the Triton MoE GEMM implements precision 'reference' (FP8 activations) and "
                                  f"'bf16'; got {precision!r} (use backend='xla')")
    act_fp8 = precision == "reference"
    T, d = x.shape
    k = idx.shape[1]
    E, I, _ = w1.shape
    S = T * k
    cfg = config or fit_config(pick_config(S, E, act_fp8), d, I)
    _check_shapes(x, idx, w1, s1, w3, s3, w2, s2, cfg)
    p = prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=act_fp8)
    w1, w3, w2 = _as_u8(w1), _as_u8(w3), _as_u8(w2)
    o, hq, hs = _launch(p, w1, s1, w3, s3, w2, s2, T=T, k=k, d=d, I=I, E=E, limit=limit, act_fp8=act_fp8, cfg=cfg)
    # Slots routed to id E (ep_moe's marker for "not a local expert") sort last and belong to no tile, so their o
    # rows are never written (jax-triton does not zero outputs): mask them, as the reference's ragged_dot does.
    local = ((idx >= 0) & (idx < E)).reshape(T, k, 1)
    out = jnp.sum(jnp.where(local, o.reshape(T, k, d).astype(jnp.float32), 0.0), axis=1)
    if return_intermediates:
        return out, dict(p, hq=hq, hs=hs, o=o)
    return out


@functools.lru_cache(maxsize=None)
def jitted(limit, precision="reference", config: MoeConfig | None = None):
    return jax.jit(functools.partial(routed_moe_triton, limit=limit, precision=precision, config=config))
