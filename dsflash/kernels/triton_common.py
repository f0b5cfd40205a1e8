"""Triton helpers shared by more than one kernel module (the MoE grouped GEMM families, the FP8 dense linear):
the number formats' exact roundings and conversions, and the bf16 dot that also runs in Triton's interpreter.
Kept apart so a kernel module imports these without importing another kernel family."""
from __future__ import annotations

import triton
import triton.language as tl


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
def _bf16_round(x, HW_ROUND: tl.constexpr):
    """fp32 -> bf16 -> fp32, round to nearest even. HW_ROUND 0 (the default): ``_bf16_rne``, integer ops, what
    Triton's interpreter can run. 1: the hardware convert (sm_90 PTX
    ``cvt.rn.bf16.f32`` / ``cvt.rn.bf16x2.f32``: RNE, no .ftz, so subnormals kept, inf kept, overflow to inf) for
    every value but NaN, and for NaN ``_bf16_rne``'s bits (top half of x with the quiet bit set; the convert would
    give the canonical 0x7FFF), selected in the bf16 domain: so the bits are ``_bf16_rne``'s for every input by
    construction, given that the bf16 -> fp32 widening is a bit move (it is: the sm_90 SASS has no F2F.F32.BF16;
    tests/test_kernels_indexer_rows.py asserts it). The select costs ~450 SASS an indexer tile (selected in fp32
    instead: ~670). 2: the convert alone (NaN canonical), the indexer scorer's default on a GPU since session 22, where only
    NaN bits could differ and fp32 arithmetic follows every rounding (``indexer_topk_triton.HW_ROUND_DEFAULT``). The interpreter's casts
    truncate, so the callers keep HW_ROUND 0 there (``indexer_topk_triton.hw_round_supported``, the mHC
    ``launch_config``). Used by the indexer scorer (the default on a GPU since session 18) and the fused mHC kernel
    (its plan's ``hw_round``, from 1024 tokens since session 21)."""
    if HW_ROUND == 0:
        r = _bf16_rne(x)
    elif HW_ROUND == 1:
        u = x.to(tl.uint32, bitcast=True)
        nan_bits = ((u >> 16) | 0x0040).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        r = tl.where(x != x, nan_bits, x.to(tl.bfloat16)).to(tl.float32)
    else:
        r = x.to(tl.bfloat16).to(tl.float32)
    return r
