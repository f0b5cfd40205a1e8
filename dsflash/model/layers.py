"""Small numeric building blocks shared by every block: linears by storage format, RMSNorm, RoPE.

Precision policy (``RunOptions.precision``):
* "reference": bf16 activations, FP8 E4M3 activation round trip (per 32) before every FP8 linear,
  fp32 accumulation, bf16 outputs — the released numerics.
* "bf16": the same casting points without any quantise-dequantise round trip.
* "fp32": everything in fp32, no round trips (the ideal model).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dsflash.config import ModelConfig
from dsflash import quant
from dsflash.kernels.rope import rope_table, rotate_tail

HIGHEST = jax.lax.Precision.HIGHEST


def act_dtype(precision: str):
    return jnp.float32 if precision == "fp32" else jnp.bfloat16


def tensor_cores() -> bool:
    """Whether bf16-exact operands go to the bf16 tensor cores as they are (a GPU) instead of being widened to
    fp32 first (the CPU path, bit-stable with every earlier run). Either way every product is exact and the sum is
    fp32: the values that differ are fp32 accumulation-order ulps, as between any two GEMM libraries. On a GPU the
    widened form ran as an fp32 SGEMM over a materialised fp32 copy of each weight (issue 19: most of a decode
    step's dense-linear and head time)."""
    return jax.default_backend() == "gpu"


def _dot(x, w_t, precision, out_dtype=jnp.float32):
    """x [..., K] @ w_t [K, N] with fp32 accumulation, the fp32 sums rounded once to ``out_dtype``. On the tensor
    cores a bf16 ``out_dtype`` is the dot's own result type: the GEMM rounds its fp32 accumulators in its epilogue
    instead of writing them as fp32 for a separate convert (H100, 4096-token prefill: wq_b's [4096, 32768] fp32
    output and its convert were 0.26 ms a layer of pure traffic)."""
    if x.dtype == jnp.bfloat16 and w_t.dtype == jnp.bfloat16 and tensor_cores():
        return jnp.einsum("...k,kn->...n", x, w_t, preferred_element_type=out_dtype)
    y = jnp.einsum("...k,kn->...n", x, w_t, preferred_element_type=jnp.float32, precision=HIGHEST)
    return y.astype(out_dtype)


def linear_fp8(x, params, name, precision, act_quant=True, backend="xla"):
    """An FP8-stored linear (``{name}.weight`` E4M3 [out, in] + ``{name}.scale`` UE8M0 32x32 blocks).

    ``backend`` other than "xla": the Triton FP8-weight kernel where ``kernels.fp8_linear.use_triton`` says it wins
    (row count and weight size gate; same products, fp32 accumulation, its own summation order)."""
    dt = act_dtype(precision)
    scale = params.get(f"{name}.scale")          # absent: float master weights (training)
    if backend != "xla" and scale is not None:
        from dsflash.kernels import fp8_linear
        w = params[f"{name}.weight"]
        if fp8_linear.use_triton(backend, fp8_linear.rows_of(x), precision, scale=scale, weight_shape=w.shape):
            from dsflash.kernels import fp8_linear_triton  # lazy: needs a CUDA GPU and jax-triton
            return fp8_linear_triton.fp8_linear_triton(x, w, scale, precision=precision, act_quant=act_quant)
    if precision == "reference":
        # dequantised weights (E4M3 x 2^k) and round-tripped activations are exact in bf16: keep them bf16 where
        # the tensor cores take them (the same products), widen to fp32 elsewhere
        wdt = jnp.bfloat16 if tensor_cores() and scale is not None else jnp.float32
        w = quant.dequant_fp8_weight(params[f"{name}.weight"], scale, wdt)
        xa = quant.fp8_roundtrip(x.astype(jnp.bfloat16), 32).astype(wdt) if act_quant \
            else x.astype(jnp.bfloat16).astype(wdt)
    else:
        w = quant.dequant_fp8_weight(params[f"{name}.weight"], scale, dt)
        xa = x.astype(dt)
    return _dot(xa, w.T, precision, dt)


def linear_fp8_grouped(x, params, name, precision, backend="xla"):
    """x [..., G, K] through the G diagonal blocks of an FP8-stored [G No, K] weight -> [..., G, No], activations in
    the run's dtype without the FP8 round trip (V4.1's grouped wo_a). ``backend`` as ``linear_fp8`` (the kernel's
    grouped launch: one program per (row tile, output block) reads only its group's K slice; on by default since
    H200 run 24, ``kernels.fp8_linear.GROUPED``)."""
    dt = act_dtype(precision)
    *lead, G, K = x.shape
    w8, scale = params[f"{name}.weight"], params.get(f"{name}.scale")
    if backend != "xla" and scale is not None:
        from dsflash.kernels import fp8_linear
        if fp8_linear.use_triton(backend, math.prod(lead), precision, scale=scale, weight_shape=w8.shape,
                                 grouped=True):
            from dsflash.kernels import fp8_linear_triton  # lazy: needs a CUDA GPU and jax-triton
            y = fp8_linear_triton.fp8_linear_triton(x.reshape(*lead, G * K), w8, scale, precision=precision,
                                                    act_quant=False, groups=G)
            return y.reshape(*lead, G, -1)
    w = quant.dequant_fp8_weight(w8, scale, dt).reshape(G, -1, K)
    return jnp.einsum("...gk,gok->...go", x.astype(dt), w, preferred_element_type=jnp.float32).astype(dt)


def linear_bf16(x, w, precision, out_dtype=None):
    """A bf16-stored linear without activation quantisation."""
    dt = act_dtype(precision)
    return _dot(x.astype(dt), w.astype(dt).T, precision, out_dtype or dt)


def linear_f32(x, w):
    """Linears the reference runs in fp32 (gate, compressor ratio 2, LM head, confidence head). With bf16
    activations and bf16 weights the fp32 products are exact, so the tensor cores may take them as they are."""
    if x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and tensor_cores():
        return _dot(x, w.T, "fp32")
    return _dot(x.astype(jnp.float32), w.astype(jnp.float32).T, "fp32")


def rms_norm(x, w, eps, precision):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(act_dtype(precision))


# ------------------------------------------------------------------ RoPE (interleaved pairs, tail dims)
def rope_freqs(cfg: ModelConfig, compressed: bool) -> np.ndarray:
    """Per-pair angular frequencies omega_i (i < rd/2); YaRN-corrected on compressed (ratio > 0) layers."""
    rd = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    i = np.arange(rd // 2, dtype=np.float64)
    omega = base ** (-2.0 * i / rd)
    if compressed and cfg.rope_scaling.get("rope_type") == "yarn":
        rs = cfg.rope_scaling
        factor, orig = float(rs["factor"]), float(rs["original_max_position_embeddings"])

        def corr(r):
            return rd * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))

        low = max(math.floor(corr(rs["beta_fast"])), 0)
        high = min(math.ceil(corr(rs["beta_slow"])), rd - 1)
        ramp = np.clip((i - low) / max(high - low, 1e-3), 0, 1)
        omega = omega * (1 - ramp) + omega / factor * ramp
    return omega.astype(np.float32)


def apply_rope(x, pos, omega, inverse=False):
    """Rotate the last ``2*len(omega)`` channels of x (pairs (2i, 2i+1)) by pos*omega (conjugate if inverse).

    x [..., S, (H,) D]; pos broadcastable to x.shape[:-1] without the head axis handled by caller. The arithmetic
    is ``kernels.rope``'s, which the attention front-ends share."""
    return rotate_tail(x, *rope_table(pos, omega), inverse=inverse)
