"""mma "swap_il" (2026-12-03, CPU-checked only, not yet run on a GPU): the swapped-operand decode kernels of
``moe_gemm_kernels`` ("swap_eo": acc^T [BN, BM] += W_even . x_even^T + W_odd . x_odd^T per 128-wide K slab) reading
the routed-expert weights in the load-time "il" layout of ``kernels/moe_layout.py`` instead of the checkpoint's.

Same operands, same two dots per slab, same epilogues as ``_moe_*_kernel_sw`` with EO = 1, so the outputs are
bit-identical to ``sw_eo_np``'s (the interpreter checks that; on the GPU the MMAs get identical inputs). What changes
is how the bf16 weight planes are made:

* checkpoint layout (swap_eo): nibble -> E4M3 byte (bit ops), E4M3x2 -> f16x2 (F2FP), f16 -> f32 (2 HADD2.F32),
  x scale (2 FMUL), f32x2 -> bf16x2 (F2FP), plus byte gathers (PRMT) and 2-byte shared-memory loads to build the
  MMA fragment: ~6.8 SASS per weight element in the loop (NOTES.md 2026-12-01 table).
* il layout: a thread's 16 fragment bytes per row are one 16-byte load; per 32-bit word (8 weights) one shift + mask
  (LOP3) per bf16x2 output for three of the four outputs and three pieces for the fourth (11 integer ops), then one
  ``mul.rn.bf16x2`` by 2^(s - 1) each (4): value * 2^-126 bit patterns (exact, subnormals included) times a power of
  two = value * 2^(s - 127), exact for scales <= 128. The group scale bytes of a slab are one word per row; the
  kernel builds the bf16 2^(s - 1) of two groups with one shift + mask, used through the HMUL2 operand's half
  selector.
* Rows: the 64-row block is loaded with its rows permuted (``_il_rows``) and un-permuted in registers, which makes
  the coalesced load layout Triton picks (16 bytes per thread, rows over lanes and warps) equal to the wgmma A
  operand layout up to register order, so no shared-memory round trip or shuffle sits between the decode and the
  MMA (checked in the sm_90 compile: no STSM / LDSM / SHFL in the loop). Written for BN = 64 and 4 warps (BM >= 16:
  wgmma); BM 8 tiles (mma.sync, kWidth 4) need another K order and are not supported.

* Tile-major weights (constexpr TM, config ``tile_major``; session 28, revived with blocked scales in session 30; NOT
  RUN ON A GPU): the il arrays permuted by ``moe_layout.to_tiles``, so a program's 64 rows x 64 bytes of one K step
  are one 4 KB run and its 64 scale words one 256-byte run (TM 2: in load order, contiguous addresses; the same
  4-byte copies); only ``_il_load``'s addresses change.

``DECODE`` 1: the inline PTX; 0: the same bit operations in plain Triton (the interpreter).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsflash.kernels import moe_layout
from dsflash.kernels.moe_gemm_kernels import (_fp8_dequant_bf16, _fp8_roundtrip_bf16, _sw_down_out, _sw_up_out,
                                              _swiglu_h, _tile_at)
from dsflash.kernels.triton_common import _dot_bf16

# the inline PTX lives in kernels/moe_layout.py (IL_ASM) so that its CPU test can emulate it without triton
_IL_ASM = tl.constexpr(moe_layout.IL_ASM)
# rows of a tile of the tile-major layout (``moe_layout.to_tiles``): the kernels' row block
_TILE_ROWS = tl.constexpr(moe_layout.BN)


@triton.jit
def _il_decode_asm(wh, f):
    """uint16 halfwords [R, C] + uint16 bf16-bit scales 2^(s-1) [R, C] -> outputs A, B, C, D (bf16 [R, C])."""
    return tl.inline_asm_elementwise(asm=_IL_ASM, constraints="=r,=r,=r,=r,r,r", args=[wh, f],
                                     dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _il_bits_to_bf16(x, fs):
    """bf16 bit pattern x (uint32, low 16 bits) times fs (f32 power of two) -> bf16 (exact)."""
    return ((x << 16).to(tl.float32, bitcast=True) * fs).to(tl.bfloat16)


@triton.jit
def _il_decode_tl(wh, f):
    """``_il_decode_asm`` in plain Triton ops (interpreter): per halfword the same masks and shifts, the multiply in
    f32 (exact: the product is a bf16 value)."""
    v = wh.to(tl.uint32)
    fs = (f.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    a = v & 0x81C0
    b = (v << 3) & 0x81C0
    c = (v << 6) & 0x81C0
    d = ((v >> 4) & 0xC0) | ((v >> 5) & 0x100) | ((v << 1) & 0x8000)
    return _il_bits_to_bf16(a, fs), _il_bits_to_bf16(b, fs), _il_bits_to_bf16(c, fs), _il_bits_to_bf16(d, fs)


@triton.jit
def _il_rows(nb, BN: tl.constexpr):
    """Memory rows of the loaded block, in load order: logical row rho (bits g = rho % 8, rho3, rho4, rho5) holds
    memory row g + 8 rho5 + 16 rho3 + 32 rho4 (see ``_il_unpermute``)."""
    r = tl.arange(0, BN)
    return nb * BN + ((r & 7) | (((r >> 5) & 1) << 3) | (((r >> 3) & 3) << 4))


@triton.jit
def _il_unpermute(t, BN: tl.constexpr, C: tl.constexpr):
    """Rows of a block loaded in ``_il_rows`` order back to memory order: [BN, C] with row rho -> row r."""
    return tl.reshape(tl.permute(tl.reshape(t, (2, 2, 2, 8, C)), (1, 2, 0, 3, 4)), (BN, C))


@triton.jit
def _il_scales(sw, BN: tl.constexpr):
    """Scale words [BN] (byte kk = bf16 exponent field of 2^(s - 1) of group kk) -> uint16 bf16 bits [BN, 32], one per
    halfword (8 c + 2 kk + q -> group kk). Groups 0 and 2 come from one shift + mask, 1 and 3 from another."""
    g02 = (sw << 7) & 0x7F807F80
    g13 = (sw >> 1) & 0x7F807F80
    # tl.join stacks along a new last axis: [n, a, b] = group 2a + b
    f = tl.join(tl.join((g02 & 0xFFFF).to(tl.uint16), (g02 >> 16).to(tl.uint16)),
                tl.join((g13 & 0xFFFF).to(tl.uint16), (g13 >> 16).to(tl.uint16)))
    f = tl.reshape(f, (BN, 4))
    return tl.reshape(tl.broadcast_to(f[:, None, :, None], (BN, 4, 4, 2)), (BN, 32))


@triton.jit
def _il_planes(wh, sw, BN: tl.constexpr, DECODE: tl.constexpr):
    """One 128-wide K slab of a row block in the il layout (halfwords [BN, 32], scale words [BN], both in load
    order) -> (even, odd) bf16 planes [BN, 64] in memory row order: plane column j = K element 2j (+1), exactly
    ``moe_gemm_kernels._decode_planes_bf16``'s planes."""
    f = _il_scales(sw, BN)
    if DECODE == 1:
        a, b, c, d = _il_decode_asm(wh, f)
    else:
        a, b, c, d = _il_decode_tl(wh, f)
    # halfword 8c + 2kk + q, output (h, p): plane column 16kk + 8h + 2c + q
    lo = tl.reshape(tl.permute(tl.reshape(tl.join(a, b), (BN, 4, 4, 2, 2)), (0, 2, 4, 1, 3)), (BN, 64))
    hi = tl.reshape(tl.permute(tl.reshape(tl.join(c, d), (BN, 4, 4, 2, 2)), (0, 2, 4, 1, 3)), (BN, 64))
    return _il_unpermute(lo, BN, 64), _il_unpermute(hi, BN, 64)


@triton.jit
def _il_wload(w_base, offs_l, nb, k0, KH: tl.constexpr, KW: tl.constexpr, TM: tl.constexpr):
    """``_il_load``'s halfwords [BN, 32] alone (the ladder's rungs 5 / 6 load them without their scale words)."""
    if TM:
        row = (nb * KW + k0 // 128) * _TILE_ROWS + (offs_l - nb * _TILE_ROWS)
        wh = tl.load(w_base + row[:, None] * 32 + tl.arange(0, 32)[None, :])
    else:
        wh = tl.load(w_base + offs_l[:, None] * KH + k0 // 4 + tl.arange(0, 32)[None, :])
    return wh


@triton.jit
def _il_load(w_base, s_base, offs_l, nb, k0, KH: tl.constexpr, KW: tl.constexpr, TM: tl.constexpr):
    """Raw slab at K offset k0 (multiple of 128): halfwords [BN, 32] (64 contiguous bytes a row) and the scale word of
    each row [BN], rows in ``_il_rows`` order (offs_l = ``_il_rows(nb, BN)``). TM (config ``tile_major``): the
    weights are ``moe_layout.to_tiles``' permutation, where block nb's slab k0 // 128 is the contiguous tile
    t = nb * KW + k0 // 128: halfwords [t * 64 * 32, (t + 1) * 64 * 32), rows in memory order (one 4 KB run), and
    scale words [t * 64, (t + 1) * 64) (one 256-byte run): TM 1 rows in memory order, read at the load order's
    permuted addresses; TM 2 (level 2) already in load order, read at contiguous addresses (Triton still makes one
    4-byte copy a word: 64 words over 128 threads; sm_90 compile, session 30)."""
    wh = _il_wload(w_base, offs_l, nb, k0, KH, KW, TM)
    if TM:
        t = nb * KW + k0 // 128
        if TM == 2:
            sw = tl.load(s_base + t * _TILE_ROWS + tl.arange(0, _TILE_ROWS))
        else:
            sw = tl.load(s_base + t * _TILE_ROWS + (offs_l - nb * _TILE_ROWS))
    else:
        sw = tl.load(s_base + offs_l * KW + k0 // 128)
    return wh, sw


@triton.jit
def _il_expert(w_ptr, s_ptr, e, N: tl.constexpr, K: tl.constexpr):
    """Expert e's [N, K] matrix in the il layout ([E, N, K/4] halfwords, [E, N, K/128] scale words)."""
    e64 = e.to(tl.int64)
    return w_ptr + e64 * (N * (K // 4)), s_ptr + e64 * (N * (K // 128))


@triton.jit
def _il_mma(acc, wh, sw, xb, BM: tl.constexpr, BN: tl.constexpr, DECODE: tl.constexpr):
    """acc^T [BN, BM] += decoded slab [BN, 128] . xb^T (xb: bf16 [BM, 128]); the even / odd planes as in swap_eo."""
    wl, wo = _il_planes(wh, sw, BN, DECODE)
    xe, xo = tl.split(tl.reshape(xb, (BM, 64, 2)))
    acc += _dot_bf16(wl, tl.trans(xe), DECODE)
    acc += _dot_bf16(wo, tl.trans(xo), DECODE)
    return acc


@triton.jit
def _plane_pair(row_ptr, k0, BK: tl.constexpr):
    """The two planes of a plane-order slab (``plane_h`` / ``plane_x``): row_ptr [BM, 1] row starts, K offset k0 ->
    (even, odd) [BM, BK / 2], plain tile loads Triton can stage straight into the wgmma's shared-memory operand."""
    p = row_ptr + k0 + tl.arange(0, BK // 2)[None, :]
    return tl.load(p), tl.load(p + BK // 2)


@triton.jit
def _il_mma_planes(acc, wh, sw, xe, xo, BN: tl.constexpr, DECODE: tl.constexpr):
    """``_il_mma`` with the B operand already in its two planes (xe, xo: bf16 [BM, 64])."""
    wl, wo = _il_planes(wh, sw, BN, DECODE)
    acc += _dot_bf16(wl, tl.trans(xe), DECODE)
    acc += _dot_bf16(wo, tl.trans(xo), DECODE)
    return acc


# ---- the decode ladder (config ``probe``, session 29): the loop with pieces taken out, to time each piece -------
# PROBE 0 is the kernel. PROBE > 0 keeps the grid, tiles, K loop, ``_il_load`` and ``tl.range`` of the kernel and
# replaces pieces of the loop body by a trivial use of what they would consume (one 32-bit xor a pair of halfwords
# into a loop-carried sink, folded into the accumulator after the loop, so no load or op is dead); the outputs are
# garbage by design. 1: weight + scale loads only; 2: loads + the weight decode (scales and nibbles -> bf16 planes),
# no x, no MMA; 3: loads + the x / h slab + the MMAs on the raw halfwords reinterpreted as bf16 planes, no decode;
# 4: loads + the decode + the x / h slab, no MMA. So 1 -> 2 adds the decode, 2 -> 4 the x slab, 4 -> 0 the MMA,
# and 3 -> 0 the decode with everything else in place.


@triton.jit
def _xor_bits(s, t, DECODE: tl.constexpr):
    """s ^ the bits of t (uint16 s, any 16-bit t, same shape): one xor.b32 per pair of elements (pack 2), as the
    decode's own inline PTX takes its halfwords; plain Triton ops for the interpreter."""
    if DECODE == 1:
        r = tl.inline_asm_elementwise(asm="xor.b32 $0, $1, $2;", constraints="=r,r,r", args=[s, t],
                                      dtype=tl.uint16, is_pure=True, pack=2)
    else:
        r = s ^ t.to(tl.uint16, bitcast=True)
    return r


@triton.jit
def _il_decode_sink(sk, wh, sw, BN: tl.constexpr, DECODE: tl.constexpr):
    """The decode of ``_il_planes`` (scales, then the four bf16 outputs of each halfword), its outputs xor-ed into
    the sink [BN, 32] in the load layout instead of being arranged into planes for the MMA."""
    f = _il_scales(sw, BN)
    if DECODE == 1:
        a, b, c, d = _il_decode_asm(wh, f)
    else:
        a, b, c, d = _il_decode_tl(wh, f)
    return _xor_bits(_xor_bits(_xor_bits(_xor_bits(sk, a, DECODE), b, DECODE), c, DECODE), d, DECODE)


@triton.jit
def _il_raw_planes(wh, BN: tl.constexpr):
    """The raw halfwords as bf16 bits arranged as ``_il_planes`` arranges the decoded outputs (each halfword in the
    place of all four of its outputs): MMA operands of the right shape and layout with no decode."""
    a = wh.to(tl.bfloat16, bitcast=True)
    lo = tl.reshape(tl.permute(tl.reshape(tl.join(a, a), (BN, 4, 4, 2, 2)), (0, 2, 4, 1, 3)), (BN, 64))
    p = _il_unpermute(lo, BN, 64)
    return p, p


@triton.jit
def _il_raw_mma(acc, wh, xb, BM: tl.constexpr, BN: tl.constexpr, DECODE: tl.constexpr):
    """``_il_mma`` on ``_il_raw_planes`` (rung 3)."""
    wl, wo = _il_raw_planes(wh, BN)
    xe, xo = tl.split(tl.reshape(xb, (BM, 64, 2)))
    acc += _dot_bf16(wl, tl.trans(xe), DECODE)
    acc += _dot_bf16(wo, tl.trans(xo), DECODE)
    return acc


# ---- ladder 2 (session 30): the up kernel's load stream varied (rungs 5-8; H100 ladder 1: the up kernel's rung 1 ran
# at its kernel's rate, 1.8 TB/s, the down kernel's at 2.4-2.5). 5: rung 1 without the scale loads (weights only);
# 6: rung 1 with each step's BN scale words read from one contiguous 4 * BN-byte run of the expert's scale buffer
# (the same words a step, permuted within the run, so each is still its own 4-byte copy as in il; garbage values)
# instead of one word a row K / 32 bytes apart; 7: rung 1 on W1 only (W3 and its scales not loaded: half the
# bytes, one request stream a program); 8 (with split_gate_up): rung 7's loop in the split programs, so each
# program streams one matrix and the grid has twice the programs: all the bytes, one stream a program. The down
# kernel has one matrix: there 7 and 8 are rung 1.


@triton.jit
def _il_sload_contig(s_base, offs_l, nb, k0, KW: tl.constexpr, BN: tl.constexpr):
    """BN scale words a step from one contiguous run (rung 6): step k0 / 128 of row block nb reads words
    (nb * KW + k0 / 128) * BN + [0, BN) of the expert's [N * KW] words (in bounds: the block's own KW * BN words,
    re-cut), in ``_il_rows``' permuted order, so Triton cannot prove them contiguous and keeps one 4-byte copy a
    word, as the il load does: same words a step, same copies, 8 sectors instead of BN."""
    return tl.load(s_base + (nb * KW + k0 // 128) * BN + (offs_l - nb * BN))


@triton.jit
def _probe_fold(acc, sk_w, sk_s, sk_x):
    """The sinks into the accumulator [BN, BM] after the loop: row n gets its weight and scale sinks' xor and the x
    sink's total xor, as an fp32 number (garbage, but every loaded and decoded bit reaches the kernel's output)."""
    v = tl.xor_sum(sk_w.to(tl.uint32), axis=1) ^ sk_s ^ tl.xor_sum(tl.xor_sum(sk_x.to(tl.uint32), axis=1), axis=0)
    return acc + v.to(tl.float32)[:, None]


@triton.jit
def _il_x_slab(xq_ptr, xs_ptr, tok, k0, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ACT_FP8: tl.constexpr):
    """x [BM, BK] at K offset k0 for the tile's token rows, as bf16 carriers (FP8 codes x their per-32 scales when
    ACT_FP8, else x is bf16 already)."""
    xa = tl.load(xq_ptr + tok[:, None] * D + k0 + tl.arange(0, BK)[None, :])
    if ACT_FP8:
        sx = tl.load(xs_ptr + tok[:, None] * (D // 32) + k0 // 32 + tl.arange(0, BK // 32)[None, :])
        xb = _fp8_dequant_bf16(xa, sx, BM, BK)
    else:
        xb = xa
    return xb    # one return: the compiler checks every return's type, even under a constexpr branch


@triton.jit
def _il_up_out_planes(acc_g, acc_u, rw_ptr, h_ptr, rows, rmask, nb, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, HOUT: tl.constexpr):
    """``_sw_up_out`` at KS 1 (HOUT 1 / 2: bf16 h) with h stored in plane order: the block's even columns as one
    contiguous run, its odd ones as another 64 columns on (per-element scattered stores spilled the up kernel)."""
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    hb = _swiglu_h(tl.trans(acc_g), tl.trans(acc_u), rw, LIMIT)
    if HOUT == 1:
        hb = _fp8_roundtrip_bf16(hb, BM, BN)
    he, ho = tl.split(tl.reshape(hb.to(tl.bfloat16), (BM, BN // 2, 2)))
    c0 = nb * BN
    base = h_ptr + rows[:, None] * I + ((c0 // 128) * 128 + (c0 % 128) // 2 + tl.arange(0, BN // 2))[None, :]
    tl.store(base, he, mask=rmask[:, None])
    tl.store(base + 64, ho, mask=rmask[:, None])


def h_from_planes(h):
    """h in plane order (within each 128-wide K slab column 2j at j, 2j + 1 at 64 + j: the order of ``_il_mma``'s
    two dots) back to the natural column order (JAX): [S, I] -> [S, I]."""
    S, I = h.shape
    return h.reshape(S, I // 128, 2, 64).transpose(0, 1, 3, 2).reshape(S, I)


@triton.jit
def _tile_il(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM: tl.constexpr, BN: tl.constexpr, NF: tl.constexpr,
             GM: tl.constexpr):
    """``moe_gemm_kernels._tile`` with the grid's first two axes chosen by NF (config ``n_fast``): 0 = M tile
    ``program_id(0)``, column block ``program_id(1)``; 1 = the other way round (column blocks launch fastest). GM > 1
    (config ``group_m``, with NF): the launch order read as groups of GM M tiles, each group's tiles fastest and then
    its column blocks; the last group may be short. Every (tile, block) pair is still one program."""
    if NF and GM > 1:
        nbs = tl.num_programs(0)
        lin = tl.program_id(1) * nbs + tl.program_id(0)      # the launch order: program_id(0) fastest
        per = GM * nbs
        first = (lin // per) * GM
        gs = tl.minimum(tl.num_programs(1) - first, GM)
        within = lin % per
        t = first + within % gs
        nb = within // gs
    elif NF:
        t = tl.program_id(1)
        nb = tl.program_id(0)
    else:
        t = tl.program_id(0)
        nb = tl.program_id(1)
    return _tile_at(tile_e_ptr, tile_s_ptr, tile_end_ptr, t, nb, BM, BN)


@triton.jit
def _moe_up_kernel_il(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      h_ptr, hs_ptr,
                      S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                      ACT_FP8: tl.constexpr, HOUT: tl.constexpr, GU: tl.constexpr, DECODE: tl.constexpr,
                      NF: tl.constexpr, GM: tl.constexpr, HP: tl.constexpr = 0, XP: tl.constexpr = 0,
                      PROBE: tl.constexpr = 0, NSTAGE: tl.constexpr = None, TM: tl.constexpr = 0):
    """``moe_gemm_kernels._moe_up_kernel_sw`` (EO 1, no hand prefetch) on il-layout W1 / W3.

    PROBE (config ``probe``; the decode ladder above ``_il_x_slab``): 0 the kernel; 1-4 the same loop with pieces
    taken out, 5-8 rung 1's load stream varied (ladder 2; garbage outputs, for timing only). Not with XP; with GU
    only 8 (and 8 only with GU). NSTAGE: the K loop's own num_stages (None: none
    set, the launch's applies); the ladder sets the launch's, because Triton pipelines the loads of a loop without
    a dot (rungs 1, 2, 4) only when the loop carries num_stages.

    XP (config ``plane_x``): x is bf16 in plane order (``x_dequant(planes=True)`` / ``to_planes``), loaded as its two
    [BM, 64] planes per slab; the same two dots as ``_il_mma`` on the same operands.

    GU (config ``split_gate_up``): the gate and up rows in separate programs -- column block ``nb`` <
    I / BN is a block of W1 (gate), the rest of W3 (up). Such a program keeps one accumulator and decodes one matrix
    (about half the registers of the joint loop), and writes its fp32 sums to the gate or up half of the partials
    [KS, S, 2, I] (``h_ptr``) that ``_moe_up_epilogue_sk`` turns into h: the same dots in the same order and the same
    SwiGLU on the same fp32 values, so h is bit-identical to the joint kernel's at the same K split.

    TM (config ``tile_major``, session 28 / 30, experimental): W1 / W3 in ``moe_layout.to_tiles``' tile-major order
    (level TM); only the load addresses change (``_il_load``), the same values reach the same dots: bit-identical.
    Rungs 1-5, 7 and 8 read the tiled addresses too (not 6, whose scale run is rung 6's own)."""
    e, _, rows, rmask, nb, offs_n = _tile_il(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN, NF, GM)
    if e < 0:
        return
    if GU:
        NB: tl.constexpr = I // BN
        up = nb // NB
        nb = nb % NB
        offs_n = nb * BN + tl.arange(0, BN)
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    ks = tl.program_id(2)
    KH: tl.constexpr = D // 4
    KW: tl.constexpr = D // 128
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _il_expert(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _il_expert(w3_ptr, s3_ptr, e, I, D)
    if GU:
        if up == 1:
            w1b = w3b
            s1b = s3b
    offs_l = _il_rows(nb, BN)
    acc_g = tl.zeros((BN, BM), tl.float32)
    acc_u = tl.zeros((BN, BM), tl.float32)
    if PROBE:
        tl.static_assert(not XP, "PROBE: the up kernel with x in natural order only")
        tl.static_assert((PROBE == 8) == (GU == 1), "PROBE: the joint up kernel; 8 (and only 8) with split_gate_up")
        sk_w = tl.zeros((BN, 32), tl.uint16)
        sk_s = tl.zeros((BN,), tl.uint32)
        sk_x = tl.zeros((BM, BK), tl.uint16)
    for i in tl.range(0, KCH // BK, num_stages=NSTAGE):
        k0 = kbeg + i * BK
        if PROBE == 5:      # ladder 2: both matrices' weights, no scales
            pg = _il_wload(w1b, offs_l, nb, k0, KH, KW, TM)
            pu = _il_wload(w3b, offs_l, nb, k0, KH, KW, TM)
        elif PROBE == 6:    # ladder 2: both matrices, scale words from a contiguous run
            pg = _il_wload(w1b, offs_l, nb, k0, KH, KW, TM)
            pu = _il_wload(w3b, offs_l, nb, k0, KH, KW, TM)
            sg = _il_sload_contig(s1b, offs_l, nb, k0, KW, BN)
            su = _il_sload_contig(s3b, offs_l, nb, k0, KW, BN)
        elif PROBE >= 7:    # ladder 2: one matrix (W1; with GU, the program's own)
            pg, sg = _il_load(w1b, s1b, offs_l, nb, k0, KH, KW, TM)
        else:
            pg, sg = _il_load(w1b, s1b, offs_l, nb, k0, KH, KW, TM)
            if not GU:
                pu, su = _il_load(w3b, s3b, offs_l, nb, k0, KH, KW, TM)
        if PROBE == 1 or PROBE == 6:    # loads only
            sk_w = _xor_bits(_xor_bits(sk_w, pg, DECODE), pu, DECODE)
            sk_s = sk_s ^ sg ^ su
        elif PROBE == 2:    # loads + decode
            sk_w = _il_decode_sink(_il_decode_sink(sk_w, pg, sg, BN, DECODE), pu, su, BN, DECODE)
        elif PROBE == 3:    # loads + x slab + MMA on the raw bits
            xb = _il_x_slab(xq_ptr, xs_ptr, tok, k0, D, BM, BK, ACT_FP8)
            acc_g = _il_raw_mma(acc_g, pg, xb, BM, BN, DECODE)
            acc_u = _il_raw_mma(acc_u, pu, xb, BM, BN, DECODE)
            sk_s = sk_s ^ sg ^ su
        elif PROBE == 4:    # loads + decode + x slab
            xb = _il_x_slab(xq_ptr, xs_ptr, tok, k0, D, BM, BK, ACT_FP8)
            sk_w = _il_decode_sink(_il_decode_sink(sk_w, pg, sg, BN, DECODE), pu, su, BN, DECODE)
            sk_x = _xor_bits(sk_x, xb, DECODE)
        elif PROBE == 5:    # weights only
            sk_w = _xor_bits(_xor_bits(sk_w, pg, DECODE), pu, DECODE)
        elif PROBE >= 7:    # one matrix's loads
            sk_w = _xor_bits(sk_w, pg, DECODE)
            sk_s = sk_s ^ sg
        elif XP:      # x in plane order
            xe, xo = _plane_pair(xq_ptr + tok[:, None] * D, k0, BK)
            acc_g = _il_mma_planes(acc_g, pg, sg, xe, xo, BN, DECODE)
            if not GU:
                acc_u = _il_mma_planes(acc_u, pu, su, xe, xo, BN, DECODE)
        else:
            xb = _il_x_slab(xq_ptr, xs_ptr, tok, k0, D, BM, BK, ACT_FP8)
            acc_g = _il_mma(acc_g, pg, sg, xb, BM, BN, DECODE)
            if not GU:
                acc_u = _il_mma(acc_u, pu, su, xb, BM, BN, DECODE)
    if PROBE:
        acc_g = _probe_fold(acc_g, sk_w, sk_s, sk_x)
    if GU:
        base = h_ptr + (ks * S + rows[None, :]).to(tl.int64) * (2 * I) + up * I + offs_n[:, None]
        tl.store(base, acc_g, mask=rmask[None, :])
    elif HP:
        _il_up_out_planes(acc_g, acc_u, rw_ptr, h_ptr, rows, rmask, nb, I, LIMIT, BM, BN, HOUT)
    else:
        _sw_up_out(acc_g, acc_u, rw_ptr, h_ptr, hs_ptr, rows, rmask, offs_n, nb, ks, S, I, LIMIT, BM, BN, KS, HOUT)


@triton.jit
def _moe_down_kernel_il(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                        DECODE: tl.constexpr, NF: tl.constexpr, GM: tl.constexpr, HP: tl.constexpr = 0,
                        DP: tl.constexpr = 0, PROBE: tl.constexpr = 0, NSTAGE: tl.constexpr = None,
                        TM: tl.constexpr = 0):
    """``moe_gemm_kernels._moe_down_kernel_sw`` (EO 1, no hand prefetch; h bf16 [S, I] in sorted rows) on il W2.
    HP: h in plane order (``h_from_planes``): the two B planes are plain tile loads that Triton stages straight into
    the wgmma's shared-memory operand, instead of one [BM, 128] load split in registers and stored back.
    DP (config ``down_pair``, with HP): the program's column blocks are 2 nb and 2 nb + 1, both from one read of each h
    slab (two accumulators); each column's dots are the single-block kernel's.
    PROBE, NSTAGE: the decode ladder as in the up kernel (h's slab in the place of x's); not with HP or DP.
    TM (config ``tile_major``): W2 in ``moe_layout.to_tiles``' tile-major order (addresses only, bit-identical)."""
    e, r0, rows, rmask, nb, offs_n = _tile_il(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN, NF, GM)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    ks = tl.program_id(2)
    KH: tl.constexpr = I // 4
    KW: tl.constexpr = I // 128
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _il_expert(w2_ptr, s2_ptr, e, D, I)
    if DP:
        offs_l = _il_rows(2 * nb, BN)
        offs_l1 = _il_rows(2 * nb + 1, BN)
        acc1 = tl.zeros((BN, BM), tl.float32)
    else:
        offs_l = _il_rows(nb, BN)
    acc = tl.zeros((BN, BM), tl.float32)
    if PROBE:
        tl.static_assert(not HP and not DP, "PROBE: the down kernel with h in natural order only")
        sk_w = tl.zeros((BN, 32), tl.uint16)
        sk_s = tl.zeros((BN,), tl.uint32)
        sk_x = tl.zeros((BM, BK), tl.uint16)
    for i in tl.range(0, KCH // BK, num_stages=NSTAGE):
        k0 = kbeg + i * BK
        if PROBE == 5:      # ladder 2: weights, no scales
            pw = _il_wload(w2b, offs_l, nb, k0, KH, KW, TM)
        elif PROBE == 6:    # ladder 2: scale words from a contiguous run
            pw = _il_wload(w2b, offs_l, nb, k0, KH, KW, TM)
            sw = _il_sload_contig(s2b, offs_l, nb, k0, KW, BN)
        elif DP:
            pw, sw = _il_load(w2b, s2b, offs_l, 2 * nb, k0, KH, KW, TM)
        else:
            pw, sw = _il_load(w2b, s2b, offs_l, nb, k0, KH, KW, TM)
        if PROBE == 1 or PROBE >= 6:    # loads only (one matrix: 7 and 8 are rung 1 here)
            sk_w = _xor_bits(sk_w, pw, DECODE)
            sk_s = sk_s ^ sw
        elif PROBE == 2:    # loads + decode
            sk_w = _il_decode_sink(sk_w, pw, sw, BN, DECODE)
        elif PROBE == 3:    # loads + h slab + MMA on the raw bits
            ha = tl.load(h_ptr + rows_c[:, None] * I + k0 + tl.arange(0, BK)[None, :])
            acc = _il_raw_mma(acc, pw, ha, BM, BN, DECODE)
            sk_s = sk_s ^ sw
        elif PROBE == 4:    # loads + decode + h slab
            ha = tl.load(h_ptr + rows_c[:, None] * I + k0 + tl.arange(0, BK)[None, :])
            sk_w = _il_decode_sink(sk_w, pw, sw, BN, DECODE)
            sk_x = _xor_bits(sk_x, ha, DECODE)
        elif PROBE == 5:    # weights only
            sk_w = _xor_bits(sk_w, pw, DECODE)
        elif DP:
            pw1, sw1 = _il_load(w2b, s2b, offs_l1, 2 * nb + 1, k0, KH, KW, TM)
            he, ho = _plane_pair(h_ptr + rows_c[:, None] * I, k0, BK)
            acc = _il_mma_planes(acc, pw, sw, he, ho, BN, DECODE)
            acc1 = _il_mma_planes(acc1, pw1, sw1, he, ho, BN, DECODE)
        elif HP:
            he, ho = _plane_pair(h_ptr + rows_c[:, None] * I, k0, BK)
            acc = _il_mma_planes(acc, pw, sw, he, ho, BN, DECODE)
        else:
            ha = tl.load(h_ptr + rows_c[:, None] * I + k0 + tl.arange(0, BK)[None, :])
            acc = _il_mma(acc, pw, sw, ha, BM, BN, DECODE)
    if PROBE:
        acc = _probe_fold(acc, sk_w, sk_s, sk_x)
    if DP:
        _sw_down_out(acc, o_ptr, slot_ptr, rows, rmask, 2 * nb * BN + tl.arange(0, BN), ks, S, D, KS)
        _sw_down_out(acc1, o_ptr, slot_ptr, rows, rmask, (2 * nb + 1) * BN + tl.arange(0, BN), ks, S, D, KS)
    else:
        _sw_down_out(acc, o_ptr, slot_ptr, rows, rmask, offs_n, ks, S, D, KS)


@triton.jit
def _x_dequant_kernel(xq_ptr, xs_ptr, o_ptr, T: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      PLANES: tl.constexpr = 0):
    """x's FP8 codes [T, D] times their per-32 pow2 scales [T, D/32] -> bf16 [T, D] (exact: ``_fp8_dequant_bf16``,
    the up kernel's own in-loop step), once per token for ``act="bf16rt"`` (the up kernel otherwise dequantises x
    again in each of its I / BN column tiles: at BM 128 that is 384 of the loop's 846 SASS per iteration)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    k0 = tl.program_id(1) * BK
    rm = rows[:, None] < T
    r64 = rows.to(tl.int64)[:, None]
    q = tl.load(xq_ptr + r64 * D + k0 + tl.arange(0, BK)[None, :], mask=rm, other=0.0)
    sc = tl.load(xs_ptr + r64 * (D // 32) + k0 // 32 + tl.arange(0, BK // 32)[None, :], mask=rm, other=0.0)
    xb = _fp8_dequant_bf16(q, sc, BT, BK)
    if PLANES:      # within each 128-wide slab: element 2j at column j, 2j + 1 at 64 + j (``to_planes``)
        xe, xo = tl.split(tl.reshape(xb, (BT, BK // 2, 2)))
        j = tl.arange(0, BK // 2)
        col = k0 + (j // 64) * 128 + j % 64
        tl.store(o_ptr + r64 * D + col[None, :], xe, mask=rm)
        tl.store(o_ptr + r64 * D + col[None, :] + 64, xo, mask=rm)
    else:
        tl.store(o_ptr + r64 * D + k0 + tl.arange(0, BK)[None, :], xb, mask=rm)


def x_dequant(jt, xq, xs, *, BT: int = 16, BK: int = 256, planes: bool = False):
    """bf16 carriers of x's FP8 round trip (``_x_dequant_kernel``), bit for bit what the up kernel would make; with
    ``planes`` in plane order (``to_planes``)."""
    import jax
    import jax.numpy as jnp

    T, D = xq.shape
    while D % BK:
        BK //= 2
    return jt.triton_call(xq, xs, kernel=_x_dequant_kernel, out_shape=jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
                          grid=(triton.cdiv(T, BT), D // BK), num_warps=4, T=T, D=D, BT=BT, BK=BK,
                          PLANES=int(planes))


def to_planes(x):
    """[T, D] in natural column order -> plane order (within each 128-wide K slab the 64 even then the 64 odd
    elements; the inverse of ``h_from_planes``): what ``plane_x``'s up kernel reads (JAX)."""
    T, D = x.shape
    return x.reshape(T, D // 128, 64, 2).transpose(0, 1, 3, 2).reshape(T, D)


PROBES = {0: "kernel", 1: "loads", 2: "loads+decode", 3: "loads+x+mma(raw)", 4: "loads+decode+x",
          5: "weights only", 6: "scales contig", 7: "W1 only", 8: "1 matrix/prog"}


def check_config(cfg):
    """The geometry the il kernels are written for (the layout's slab and the row permutation's block)."""
    if cfg.BK != moe_layout.BK or cfg.BN_UP != moe_layout.BN or cfg.BN_DOWN != moe_layout.BN:
        raise ValueError(f"mma 'swap_il' needs BK={moe_layout.BK}, BN_UP=BN_DOWN={moe_layout.BN}; got {cfg}")
    if cfg.act not in ("fp8", "bf16rt"):
        raise ValueError(f"mma 'swap_il' takes act 'fp8' (x dequantised in the up kernel's loop) or 'bf16rt' (once, "
                         f"before it); got {cfg.act!r}")
    if cfg.down_pair and not cfg.plane_h:
        raise ValueError(f"down_pair reads h's two planes once for two column blocks: it needs plane_h; got {cfg}")
    if cfg.plane_x and cfg.act != "bf16rt":
        raise ValueError(f"plane_x reads x dequantised once, before the up kernel: it needs act 'bf16rt'; got "
                         f"{cfg.act!r}")
    if cfg.tile_major not in (0, 1, 2):
        raise ValueError(f"tile_major is 0 (plain il), 1 or 2 (moe_layout.to_tiles' levels); got {cfg.tile_major!r}")
    if cfg.tile_major and cfg.probe == 6:
        raise ValueError(f"probe 6 reads rung 6's own contiguous scale run from plain il scales: not with tile_major; "
                         f"got {cfg}")
    if cfg.probe not in PROBES:
        raise ValueError(f"probe is one of {sorted(PROBES)} (the decode ladder); got {cfg.probe}")
    if cfg.probe and (cfg.plane_x or cfg.plane_h or cfg.down_pair or (cfg.split_gate_up and cfg.probe != 8)):
        raise ValueError(f"the decode ladder (probe) is written for the plain il loops: no plane_x / plane_h / "
                         f"down_pair / split_gate_up (but probe 8); got {cfg}")
    if cfg.probe == 8 and not cfg.split_gate_up:
        raise ValueError(f"probe 8 is rung 7's loop in split_gate_up programs (one matrix a program): it needs "
                         f"split_gate_up; got {cfg}")
    if cfg.warps_up != 4 or cfg.warps_down != 4 or cfg.BM < 16:
        raise ValueError(f"mma 'swap_il' needs 4 warps and BM >= 16 (wgmma; BM 8 lowers to mma.sync with another "
                         f"operand layout); got {cfg}")


def il_kernels(cfg, *, d, I, dec):
    """(up kernel, down kernel, common constexprs) for ``moe_gemm_triton._launch_sk``; with ``split_gate_up`` the up
    kernel always writes fp32 partials (the launcher then runs the split-K epilogue, at any KS)."""
    check_config(cfg)
    return _moe_up_kernel_il, _moe_down_kernel_il, dict(D=d, I=I, BM=cfg.BM, BK=cfg.BK, DECODE=dec,
                                                        NF=int(cfg.n_fast), GM=cfg.group_m, HP=int(cfg.plane_h),
                                                        TM=int(cfg.tile_major))


def _probe(cfg, stages):
    """PROBE and the K loop's num_stages (NSTAGE: the launch's own ``stages`` at a probe, None -- the loop's default --
    at probe 0). Always passed: jax-triton sends a constexpr the launch leaves out as None, not as its default
    (tests/test_kernels_launch_constexprs.py); at probe 0 both select the kernels' code as it was."""
    return dict(PROBE=cfg.probe, NSTAGE=stages if cfg.probe else None)


def il_up_constexprs(cfg):
    """The up kernel's own constexprs (``il_kernels``' common ones go to both launches)."""
    return dict(GU=int(cfg.split_gate_up), XP=int(cfg.plane_x), **_probe(cfg, cfg.stages))


def il_down_constexprs(cfg):
    """The down kernel's own constexprs."""
    return dict(DP=int(cfg.down_pair), **_probe(cfg, cfg.stages_down or cfg.stages))
