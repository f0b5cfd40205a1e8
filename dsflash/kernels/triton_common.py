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
