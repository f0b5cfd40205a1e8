"""Quantisation formats of SPEC_V41 §12 / §16b.7, as pure jnp functions.

Every round trip is written as ``quantise`` (codes + scales) and ``dequantise`` so the same code serves
the reference numerics (round trip in place), packed cache storage and the checkpoint loader.
Scale arithmetic follows the released numerics exactly:
* FP8 activations / window KV: ``s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448)))``, E4M3 RNE.
* MXFP4 (index q/k):           ``s = 2^ceil(log2(max(amax, 6*2^-126) * f32(1/6)))``, E2M1 RNE.
* FP4 main KV (NVFP4-like):    ``s = e4m3(max(amax, 6*2^-9) / 6)``, E2M1 RNE, groups of 16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
FP8_MAX = 448.0
FP4_MAX = 6.0


def _ceil_pow2(y):
    """2^ceil(log2(y)) for normal fp32 y > 0, exactly, by bit arithmetic (cheap to compile, no rounding):
    a power of two stays, anything else rounds its exponent up."""
    bits = jax.lax.bitcast_convert_type(y.astype(jnp.float32), jnp.uint32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(exp << 23, jnp.float32)


def _grouped(x, block):
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


# ---------------------------------------------------------------- FP8 E4M3 with pow2 (UE8M0) scales
def fp8_quant(x, block: int = 32):
    """-> (codes float8_e4m3fn [..., D], scales float32 pow2 [..., D/block])."""
    g = _grouped(x.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    s = _ceil_pow2(jnp.maximum(amax, 1e-4) * jnp.float32(1.0 / FP8_MAX))
    q = jnp.clip(g / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), s[..., 0]


def fp8_dequant(q, s, block: int = 32, dtype=jnp.float32):
    g = _grouped(q.astype(jnp.float32), block) * s[..., None]
    return g.reshape(q.shape).astype(dtype)


def fp8_roundtrip(x, block: int = 32):
    q, s = fp8_quant(x, block)
    return fp8_dequant(q, s, block, x.dtype)


# ---------------------------------------------------------------- E2M1 helpers
def e2m1_round(v):
    """Round fp32 values (already in [-6, 6]) to E2M1, ties to the even code."""
    return v.astype(jnp.float4_e2m1fn).astype(jnp.float32)


def e2m1_codes(v):
    """E2M1 values -> 4-bit codes (uint8, bit 3 = sign)."""
    mags = jnp.asarray(E2M1_VALUES[1:8])
    a = jnp.abs(v)
    mag_code = jnp.sum(a[..., None] >= mags, axis=-1).astype(jnp.uint8)
    sign = (jnp.signbit(v)).astype(jnp.uint8) << 3
    return mag_code | sign


def e2m1_from_codes(codes):
    return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]


def pack_nibbles(codes):
    """[..., 2k] codes -> [..., k] uint8, element 2k in the low nibble."""
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_nibbles(packed):
    p = packed.astype(jnp.uint8)
    lo, hi = p & 0xF, p >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# ---------------------------------------------------------------- MXFP4 (E2M1 + pow2 per 32)
def mxfp4_quant(x, block: int = 32):
    """-> (E2M1 values as float32 [..., D], pow2 scales float32 [..., D/block])."""
    g = _grouped(x.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    s = _ceil_pow2(jnp.maximum(amax, FP4_MAX * 2.0 ** -126) * jnp.float32(1.0 / FP4_MAX))
    q = e2m1_round(jnp.clip(g / s, -FP4_MAX, FP4_MAX))
    return q.reshape(x.shape), s[..., 0]


def mxfp4_roundtrip(x, block: int = 32):
    q, s = mxfp4_quant(x, block)
    return (_grouped(q, block) * s[..., None]).reshape(x.shape).astype(x.dtype)


# ---------------------------------------------------------------- FP4 main KV (E2M1 + E4M3 per 16)
# Both divisions of the NVFP4-style quantiser (``amax / 6`` and ``x / s``, SPEC §12 / §16b.7) are written without a
# division. XLA's algebraic simplifier turns ``a / broadcast(b)`` into ``a * broadcast(1 / b)`` and ``a / 6`` into
# ``a * f32(1/6)`` (seen on CPU in every jitted and eager call; an optimization_barrier on ``b`` does not stop it,
# one on the broadcast divisor did on CPU but depends on where each backend expands the barriers). With the E4M3
# scale not a power of two the product can land one ulp off the IEEE quotient and round to the other side of an
# E2M1 / E4M3 tie (1.171875 / 0.46875 = 2.5 exactly, came out 2.5000002 -> 3 instead of 2).
#
# What is computed instead is exactly ``rne(fl32(a / b))`` for the target format: compare ``a`` with ``b`` times every
# midpoint of the target grid. Those products are exact in fp32 (an E2M1 midpoint has <= 3 significant bits, an
# E4M3 scale <= 4; an E4M3 midpoint <= 5 bits, 6 has 2), and rounding the fp32 quotient equals rounding the real
# quotient here: where a/b is not a midpoint t, a and b t are distinct fp32 values, so |a - b t| >= ulp(b t) / 2,
# which puts a/b at least half an fp32 ulp of t away from t (t and b have few bits; exactly half only when t is a
# power of two and a/b is then itself an fp32 value just below it), so the fp32 rounding of a/b cannot land on or
# cross t. Ties (a == b t) go to the even code, as RNE does. Checked against numpy's IEEE float32 division next to
# every midpoint for every scale (tests/test_model_numerics.py).
_E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)     # between codes c and c + 1
_E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])        # code c + 1 even
_E4M3_VALS = np.arange(128, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float64)   # codes 0..127 (127 = NaN)
_E4M3_MIDS = np.append((_E4M3_VALS[:126] + _E4M3_VALS[1:127]) / 2, 464.0)      # 464: 448 vs overflow (NaN)
_E4M3_TIE_UP = (np.arange(1, 128) % 2) == 0


def _e2m1_of_quotient(g, s):
    """``e2m1(clip(g / s, -6, 6))`` (RNE, fp32 IEEE quotient) for s > 0 (E4M3 values as fp32, broadcastable)."""
    a = jnp.abs(g)[..., None]
    t = s[..., None] * jnp.asarray(_E2M1_MIDS)                                  # exact
    code = jnp.sum(jnp.where(jnp.asarray(_E2M1_TIE_UP), a >= t, a > t), axis=-1)
    mag = jnp.asarray(E2M1_VALUES[:8])[code]
    return jnp.where(jnp.isnan(g), g, jnp.copysign(mag, g))


def _e4m3_of_div6(a):
    """``(a / 6).astype(float8_e4m3fn)`` (RNE, fp32 IEEE quotient; NaN above the E4M3 range, as the conversion)."""
    t = jnp.asarray((6.0 * _E4M3_MIDS).astype(np.float32))                     # exact: 6 * mid has <= 7 bits
    a1 = a[..., None]
    code = jnp.sum(jnp.where(jnp.asarray(_E4M3_TIE_UP), a1 >= t, a1 > t), axis=-1)
    code = jnp.where(jnp.isnan(a), 127, code).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(code, jnp.float8_e4m3fn)


def nvfp4_quant(x, block: int = 16):
    """-> (E2M1 values float32 [..., D], E4M3 scales as float8_e4m3fn [..., D/block]).
    ``s = e4m3(max(amax, 6*2^-9) / 6)``, ``q = e2m1(clip(x / s, -6, 6))``, both quotients exactly as IEEE fp32
    division rounds them (block comment above)."""
    g = _grouped(x.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    s8 = _e4m3_of_div6(jnp.maximum(amax, FP4_MAX * 2.0 ** -9))
    q = _e2m1_of_quotient(g, s8.astype(jnp.float32))
    return q.reshape(x.shape), s8[..., 0]


def nvfp4_roundtrip(x, block: int = 16):
    q, s8 = nvfp4_quant(x, block)
    return (_grouped(q, block) * s8.astype(jnp.float32)[..., None]).reshape(x.shape).astype(x.dtype)


# ---------------------------------------------------------------- UE8M0 bytes
def e8m0_to_f32(b):
    """UE8M0 byte b -> 2^(b-127) as float32 (b = 0 is the subnormal 2^-127; 255 is NaN in the format)."""
    b = b.astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    return jnp.where(b == 0, jnp.float32(2.0 ** -127), normal)


def f32_pow2_to_e8m0(s):
    """A normal fp32 power of two -> its UE8M0 byte (the biased exponent)."""
    return ((jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32) >> 23) & 0xFF).astype(jnp.uint8)


# ---------------------------------------------------------------- stored weights
def dequant_fp8_weight(w, scale, dtype=jnp.float32):
    """FP8 E4M3 weight [..., out, in] with UE8M0 32x32 block scales [..., out/32, in/32]."""
    if scale is None:
        return w.astype(dtype)
    s = e8m0_to_f32(scale)
    s = jnp.repeat(jnp.repeat(s, 32, axis=-2), 32, axis=-1)
    return (w.astype(jnp.float32) * s).astype(dtype)


def dequant_mxfp4_weight(packed, scale, dtype=jnp.float32):
    """MXFP4 expert weight: int8 [..., out, in/2] (low nibble first), UE8M0 [..., out, in/32]."""
    if scale is None:
        return packed.astype(dtype)
    if packed.dtype == jnp.int8:
        packed = jax.lax.bitcast_convert_type(packed, jnp.uint8)
    vals = e2m1_from_codes(unpack_nibbles(packed))
    s = jnp.repeat(e8m0_to_f32(scale), 32, axis=-1)
    return (vals * s).astype(dtype)


def quantize_fp8_weight(w):
    """float weight [..., out, in] -> (E4M3 [out, in], UE8M0 [out/32, in/32]) with pow2 block scales."""
    *lead, o, i = w.shape
    g = w.astype(jnp.float32).reshape(*lead, o // 32, 32, i // 32, 32)
    amax = jnp.max(jnp.abs(g), axis=(-3, -1), keepdims=True)
    s = _ceil_pow2(jnp.maximum(amax, 1e-10) * jnp.float32(1.0 / FP8_MAX))
    q = jnp.clip(g / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).reshape(w.shape)
    return q, f32_pow2_to_e8m0(s[..., 0, :, 0])


def quantize_mxfp4_weight(w):
    """float weight [..., out, in] -> (int8 packed [out, in/2], UE8M0 [out, in/32])."""
    q, s = mxfp4_quant(w, 32)
    packed = pack_nibbles(e2m1_codes(q))
    return jax.lax.bitcast_convert_type(packed, jnp.int8), f32_pow2_to_e8m0(s)
