"""The default Triton kernels of the MoE grouped GEMM: the swapped-operand family (``mma`` "swap" / "swap_eo" /
"swap_bd", kind "sk"; the defaults ``sw_eo_np`` / ``sw_eo_np_bm8`` / ``sw_eo_prefill_w8`` are "swap_eo"), the split-K
epilogue / reduction kernels with their launches, and the helpers the experimental families
(``kernels/experimental/moe_families.py``) share with it. The JAX front end is ``moe_gemm_triton``; how the kernels
work is described there."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.triton_common import _dot_bf16, _e8m0_to_f32, _round_bf16, _round_e4m3


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
    r = _fp8_roundtrip_bf16(h, BM, BN)
    tl.store(q_ptr + rows[:, None] * NCOLS + offs_n[None, :], r.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _fp8_roundtrip_bf16(h, BM: tl.constexpr, BN: tl.constexpr):
    """``_fp8_roundtrip_store_bf16``'s values (fp32 [BM, BN] holding bf16 values), not stored."""
    NB: tl.constexpr = BN // 32
    h3 = tl.reshape(h, (BM, NB, 32))
    amax = tl.max(tl.abs(h3), axis=2)
    y = tl.maximum(amax, 1e-4) * (1.0 / 448.0)
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = _round_e4m3(tl.minimum(tl.maximum(h3 * inv[:, :, None], -448.0), 448.0))
    return tl.reshape(q * s[:, :, None], (BM, BN))


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
    return _tile_at(tile_e_ptr, tile_s_ptr, tile_end_ptr, tl.program_id(0), tl.program_id(1), BM, BN)


@triton.jit
def _tile_at(tile_e_ptr, tile_s_ptr, tile_end_ptr, t, nb, BM: tl.constexpr, BN: tl.constexpr):
    """``_tile`` for M-tile ``t`` and N block ``nb`` (the il kernels choose which program id names which)."""
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
def _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D: tl.constexpr):
    """A tile's rows of o, rounded to bf16 once, stored at their unsorted slots of o [S, D]."""
    slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
    tl.store(o_ptr + slot[:, None] * D + offs_n[None, :], _round_bf16(acc).to(tl.bfloat16), mask=rmask[:, None])


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


# ------------------------------------------------------- JAX side: the split-K epilogue / reduction launches
def _block_dividing(n, cap):
    """Largest power-of-two block <= cap (and >= 32) dividing n (n is a multiple of 32)."""
    b = cap
    while n % b:
        b //= 2
    return b


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
