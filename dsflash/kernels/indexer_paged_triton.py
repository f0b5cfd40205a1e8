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


# ---- session 30's forms (the module switches KEY_DECODE "table", PAIRED_ROUND, RELU_ONE_COMPARE below NUM_STAGES;
# the default since session 30's H100 run; the switches off compile to the same SASS as before them).
# KTAB_ASM: the MXFP4 key decode by byte tables. Per 32-bit word of packed codes (4 bytes = 8 nibbles n0..n7, n(2k)
# the low nibble of byte k): the word masked to 0x7777, low 16 bits, is four PRMT selectors = the magnitudes of
# n0..n3 (shifted down 16, of n4..n7); two 8-byte tables give the low and high byte of the bf16 bit pattern of each
# E2M1 magnitude (0, .5, 1, 1.5, 2, 3, 4, 6 = 0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0); the signs
# come as 0x00 / 0xFF bytes from PRMT's sign-replicate mode (selector nibble bit 3) on the word and the word << 4 and
# are ORed into the high bytes (LOP3); one PRMT a pair interleaves low and high bytes into bf16x2 (the low / high
# nibble planes of two bytes); one `mul.rn.bf16x2` a pair by 2^(s - 127) (bf16 bits max(s << 7, 0x0040): s = 0 is
# the subnormal 2^-127, s = 255 is inf, as _e8m0_f32). Every product is an E2M1 value times a power of two, so
# exact in bf16 (fp32's exponent range, subnormals kept), overflow (s >= 254) goes to inf and 0 x inf to NaN, as
# the fp32 form's product + cvt.rn. ~20 instructions per 8 key elements instead of ~14 an element (sm_90: the
# prologue 1,856 -> 698 SASS a warp, 168 -> 124 registers). Checked: scripts/ptx_emu.py on every byte x scale byte.
KTAB_ASM = """
{
.reg .b32 sel, selh, la, ha, lb, hb, wl, sa, sb, s01, s23, c40;
mov.b32 c40, 0x00400040;
and.b32 sel, $4, 0x77777777;
shr.b32 selh, sel, 16;
prmt.b32 la, 0xC0800000, 0xC0804000, sel;
prmt.b32 ha, 0x3F3F3F00, 0x40404040, sel;
prmt.b32 lb, 0xC0800000, 0xC0804000, selh;
prmt.b32 hb, 0x3F3F3F00, 0x40404040, selh;
shl.b32 wl, $4, 4;
prmt.b32 sa, wl, $4, 0xD9C8;
prmt.b32 sb, wl, $4, 0xFBEA;
and.b32 sa, sa, 0x80808080;
and.b32 sb, sb, 0x80808080;
or.b32 ha, ha, sa;
or.b32 hb, hb, sb;
prmt.b32 s01, $5, 0, 0x4140;
shl.b32 s01, s01, 7;
max.u16x2 s01, s01, c40;
prmt.b32 s23, $5, 0, 0x4342;
shl.b32 s23, s23, 7;
max.u16x2 s23, s23, c40;
prmt.b32 $0, la, ha, 0x6240;
prmt.b32 $2, la, ha, 0x7351;
prmt.b32 $1, lb, hb, 0x6240;
prmt.b32 $3, lb, hb, 0x7351;
mul.rn.bf16x2 $0, $0, s01;
mul.rn.bf16x2 $2, $2, s01;
mul.rn.bf16x2 $1, $1, s23;
mul.rn.bf16x2 $3, $3, s23;
}
"""
_KTAB_ASM = tl.constexpr(KTAB_ASM)      # a jit function reads module globals only as constexprs


@triton.jit
def _e2m1_table_asm(p, s):
    """Packed E2M1 bytes p (uint8) and each byte's UE8M0 scale byte s (same shape after broadcast) -> (low nibble,
    high nibble) values x 2^(s - 127) as bf16, by ``_KTAB_ASM`` (4 bytes a call: $4 the codes, $5 the scales;
    $0 / $1 the low nibbles of bytes 0-1 / 2-3, $2 / $3 the high nibbles)."""
    return tl.inline_asm_elementwise(asm=_KTAB_ASM, constraints="=r,=r,=r,=r,r,r", args=[p, s],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _e2m1_table_nibble(n):
    """``_KTAB_ASM``'s table lookup of one nibble (int32 0..15) in integer Triton ops: the bf16 bits, as the upper
    half of an fp32 bit pattern (int64 so the sign bit shifts up without overflow)."""
    m = (n & 7).to(tl.int64)
    lt = tl.where(m < 4, 0xC0800000, 0xC0804000).to(tl.int64)
    ht = tl.where(m < 4, 0x3F3F3F00, 0x40404040).to(tl.int64)
    lo = (lt >> ((m & 3) * 8)) & 0xFF
    hi = ((ht >> ((m & 3) * 8)) & 0xFF) | ((n & 8).to(tl.int64) << 4)
    return ((hi << 24) | (lo << 16)).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_table_tl(p, s):
    """``_e2m1_table_asm`` in plain Triton ops (Triton's interpreter): the same tables and scale bits; the product
    in fp32 (exact, as the bf16x2 multiply), then narrowed (exact values: the interpreter's truncating cast is
    enough)."""
    v = p.to(tl.int32)
    sc = tl.maximum(s.to(tl.int32) << 7, 0x40).to(tl.int64) << 16
    scf = sc.to(tl.uint32).to(tl.float32, bitcast=True)
    lo = (_e2m1_table_nibble(v & 0xF) * scf).to(tl.bfloat16)
    hi = (_e2m1_table_nibble(v >> 4) * scf).to(tl.bfloat16)
    return lo, hi


# PAIR_ASM: the epilogue's elementwise bf16 roundings a pair at a time: one cvt.rn.bf16x2.f32 (F2FP.BF16.F32.PACK_AB)
# for two fp32 values instead of one cvt.rn.bf16.f32 (F2F) each (cvt d, a, b puts a in the upper half), widened back
# by a shift / mask into two fp32 outputs (returning the bf16x2 and widening in Triton took PRMTs: 419 loop SASS
# against 394). The same rounding as ``_round``'s per-element convert: RNE, no .ftz, overflow to inf, NaN canonical.
PAIR_ASM = """
{
.reg .b32 p;
cvt.rn.bf16x2.f32 p, $3, $2;
shl.b32 $0, p, 16;
and.b32 $1, p, 0xFFFF0000;
}
"""
_PAIR_ASM = tl.constexpr(PAIR_ASM)


@triton.jit
def _round_pair(x, DECODE: tl.constexpr, PAIR: tl.constexpr):
    """``_round`` (fp32 -> bf16 -> fp32, RNE); PAIR 1 on the GPU: ``_PAIR_ASM`` (2 elements a call: $2, $3 in,
    $0, $1 out). The interpreter keeps ``_bf16_rne``."""
    if DECODE == 1 and PAIR == 1:
        return tl.inline_asm_elementwise(asm=_PAIR_ASM, constraints="=r,=r,r,r", args=[x], dtype=tl.float32,
                                         is_pure=True, pack=2)
    return _round(x, DECODE)


@triton.jit
def _mxfp4_tile(packed, s_ptrs, smask, BT: tl.constexpr, Di: tl.constexpr, KTAB: tl.constexpr,
                DECODE: tl.constexpr):
    """Packed E2M1 bytes [BT, Di/2] (element 2j in the low nibble of byte j) + the UE8M0 scale bytes at ``s_ptrs``
    [BT, Di/32] (127 where not ``smask``) -> the bf16 key tile [BT, Di]. KTAB 0 (the fp32 form): ``_e2m1_f32`` x
    ``_e8m0_f32`` in fp32, then the bf16 pack (exact: E2M1 x 2^e has <= 2 significant bits). KTAB 1: the byte tables
    (``_KTAB_ASM`` on the GPU, ``_e2m1_table_tl`` in the interpreter), each byte with its group's scale byte, two bf16
    planes joined. (The scales are loaded in here, after the codes' unpack, as before the helper existed: loading
    them first changed the KTAB 0 SASS.)"""
    if KTAB == 1:
        sb = tl.load(s_ptrs, mask=smask, other=127)
        p3 = tl.reshape(packed, (BT, Di // 32, 16))
        if DECODE == 1:
            lo, hi = _e2m1_table_asm(p3, sb[:, :, None])
        else:
            lo, hi = _e2m1_table_tl(p3, sb[:, :, None])
        kt = tl.reshape(tl.join(lo, hi), (BT, Di))
    else:
        packed = packed.to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BT, Di))
        sc = _e8m0_f32(tl.load(s_ptrs, mask=smask, other=127))
        vals = tl.reshape(_e2m1_f32(codes), (BT, Di // 32, 32)) * sc[:, :, None]
        kt = tl.reshape(vals, (BT, Di)).to(tl.bfloat16)
    return kt


@triton.jit
def _key_tile_kernel(kq_ptr, ks_ptr, o_ptr, KTAB: tl.constexpr, BT: tl.constexpr, Di: tl.constexpr,
                     DECODE: tl.constexpr):
    """Checks only (the interpreter script and the GPU test of the switches): ``_mxfp4_tile`` of BT rows of packed
    codes [R, Di/2] + scale bytes [R, Di/32] -> its bf16 bits [R, Di]."""
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    packed = tl.load(kq_ptr + r[:, None] * (Di // 2) + tl.arange(0, Di // 2)[None, :])
    kt = _mxfp4_tile(packed, ks_ptr + r[:, None] * (Di // 32) + tl.arange(0, Di // 32)[None, :], r[:, None] >= 0,
                     BT, Di, KTAB, DECODE)
    tl.store(o_ptr + r[:, None] * Di + tl.arange(0, Di)[None, :], kt.to(tl.uint16, bitcast=True))


@triton.jit
def _indexer_paged_kernel(q_ptr, w_ptr, kq_ptr, ks_ptr, kx_ptr, pt_ptr, lim_ptr, cand_ptr, o_ptr,
                          S: tl.constexpr, T: tl.constexpr, P: tl.constexpr, PER_PAGE: tl.constexpr,
                          NPOOL: tl.constexpr, Hi: tl.constexpr, HP: tl.constexpr, Di: tl.constexpr, SB: tl.constexpr,
                          BT: tl.constexpr, MXFP4: tl.constexpr, HAS_CAND: tl.constexpr, DECODE: tl.constexpr,
                          KTAB: tl.constexpr = 0, PAIR: tl.constexpr = 0, RELU1: tl.constexpr = 0):
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
        offs_g = tl.arange(0, Di // 32)
        kt = _mxfp4_tile(packed, ks_ptr + row[:, None] * (Di // 32) + offs_g[None, :], tmask[:, None], BT, Di, KTAB,
                         DECODE)
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
        qk = _round_pair(_dot_bf16(kt, qt, DECODE), DECODE, PAIR)   # [BT, HP] fp32, bf16-valued
        # a padded head contributes relu(0) * -1 = -0.0, the exact identity of an IEEE sum (+0.0 would turn a
        # -0.0 score into +0.0)
        w = tl.load(w_ptr + base + offs_hd, mask=rin & hmask, other=-1.0).to(tl.float32)
        if RELU1 == 1:   # the same relu with one compare (NaN <= 0 is false: NaN kept; -0.0 -> +0.0 as _relu_nan)
            c = _round_pair(tl.where(qk <= 0.0, 0.0, qk) * w[None, :], DECODE, PAIR)
        else:
            c = _round_pair(_relu_nan(qk) * w[None, :], DECODE, PAIR)   # bf16 x bf16 is exact in fp32: one rounding
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

# Session 30's forms of the scorer (NOTES: "The paged indexer scorer: table key decode and paired roundings"), read
# when the launch is traced, like NUM_STAGES; all three on by default since session 30's H100 run (bit-identical to
# the fp32 forms in the GPU test tests/gpu/test_indexer_paged_switches.py; 128K ratio 1 scorer -25 to -29 %, the 32 x
# 6 @ 128K step 11.11 -> 10.34 ms, benchmarks/results/step128k_20261207_h100_s30_ktab_*). Each can be set back for A/Bs:
# KEY_DECODE "table" (_KTAB_ASM: byte tables by PRMT + one bf16x2 multiply a pair; the interpreter runs
# _e2m1_table_tl) or "where" (_e2m1_f32 x _e8m0_f32 in fp32, then the bf16 pack). The same bf16 key tile for every
# code and scale byte (tests/test_kernels_indexer_paged.py enumerates them).
KEY_DECODE = "table"
# PAIRED_ROUND: the epilogue's two elementwise roundings (qk, c) by cvt.rn.bf16x2.f32 a pair (_PAIR_ASM) instead of
# cvt.rn.bf16.f32 an element. The interpreter keeps _bf16_rne either way.
PAIRED_ROUND = True
# RELU_ONE_COMPARE: relu as where(x <= 0, 0, x) instead of _relu_nan's where(x > 0, x, where(x != x, x, 0)): the same
# value for every x (NaN kept, -0.0 -> +0.0), which ptxas turns into one FMNMX.NAN an element (the other form takes
# FSETP + FSEL + HSETP2). Together with PAIRED_ROUND the row loop goes 426 -> 330 SASS a warp.
RELU_ONE_COMPARE = True
KEY_DECODES = ("where", "table")


def switch_constexprs():
    """The constexprs of the module switches (KEY_DECODE, PAIRED_ROUND, RELU_ONE_COMPARE) as the launch passes
    them."""
    if KEY_DECODE not in KEY_DECODES:
        raise ValueError(f"indexer_paged_triton.KEY_DECODE must be one of {KEY_DECODES}; got {KEY_DECODE!r}")
    return dict(KTAB=int(KEY_DECODE == "table"), PAIR=int(bool(PAIRED_ROUND)), RELU1=int(bool(RELU_ONE_COMPARE)))


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
                 HAS_CAND=int(cand is not None), **switch_constexprs(), **prm)
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
