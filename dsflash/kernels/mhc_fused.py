"""Fused mHC (SPEC_V41 §7): one pass over a token's streams does what the delayed wiring needs at a sublayer
boundary. The model's mHC math lives here so ``dsflash.model.mhc`` and the kernel share one definition.

``mhc_fused(X, a, fn, base, scale, expand=None, *, eps, rms_eps, iters, out_dtype, backend)``
  X       [T, n, d]   residual streams (activation dtype)
  a       [T, n]      fp32 pre-mix for the collapse (delayed wiring: the previous boundary's ``pre``)
  fn      [2n + n*n, n*d] fp32, base [2n + n*n] fp32, scale [3] fp32: the coefficient generator
  expand  None, or (y [T, d], post [T, n], comb [T, n, n]): first X <- hc_post(y, X, post, comb) in out_dtype
  -> (X [T, n, d] (the expanded streams, or the input), h = hc_pre(X, a) [T, d] out_dtype,
      (pre [T, n], post [T, n], comb [T, n, n]) = H(X) in fp32)
Leading dims other than T are flattened by the caller (``dsflash.model.mhc``).

Numerics: H(X): v = X (fp32), r = rsqrt(mean(v^2) + rms_eps), m = (v . fn^T) * r with fp32 products (HIGHEST),
pre = sigmoid(m*s0 + b) + eps, post = 2 sigmoid(m*s1 + b), comb = softmax_b(M) + eps, columns normalised, then
``iters - 1`` row / column normalisations (each x / (sum + eps)). Collapse and expand accumulate in fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.kernels import dispatch
from dsflash.kernels.mhc_fused_plan import (  # noqa: F401  (the plan, shared with mhc_fused_triton)
    BD_CHOICES, EPI_ROW_TILE_CAP, EPI_TILE_CAP, MIN_PROGRAMS, NARROW_BD, NARROW_BT, NARROW_FROM,
    PARTIAL_FLOOR, PARTIAL_X_FRAC, SMS, TARGET_PROGRAMS, TILE_CAP, _cdiv, _next_pow2, check_plan, check_shapes,
    kernel_plan, num_warps, partial_bytes)


# fp32 products for the collapse / expand contractions. Without it JAX's DEFAULT precision runs an fp32 einsum in
# TF32 on recent GPUs (comb rounded to 10 mantissa bits, ~2^-11 relative): on the H200 (2026-11-30) the expand
# then differed from fp32 math in one bf16 ulp on ~6 % of elements (rel 8.6e-4; reproduced on CPU by rounding comb
# to TF32: 6.1 %, 8.5e-4). No effect on CPU (fp32 there already).
_F32 = jax.lax.Precision.HIGHEST


def sinkhorn_coefficients(X, fn, base, scale, *, eps, rms_eps, iters):
    """H(X) for streams X [..., n, d] -> (pre [..., n], post [..., n], comb [..., n, n]) in fp32."""
    n = X.shape[-2]
    v = X.astype(jnp.float32).reshape(*X.shape[:-2], -1)
    r = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + rms_eps)
    m = jnp.einsum("...k,mk->...m", v, fn, precision=jax.lax.Precision.HIGHEST) * r
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    M = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*m.shape[:-1], n, n)
    comb = jax.nn.softmax(M, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    # a loop, not an unrolled chain: 19 iterations x 2 sublayers x every block dominated compile time
    comb = jax.lax.fori_loop(0, iters - 1, sinkhorn, comb)
    return pre, post, comb


def collapse(X, a, out_dtype):
    """hc_pre: sum_c a[c] X[c] (fp32 accumulate)."""
    return jnp.einsum("...c,...cd->...d", a, X.astype(jnp.float32), precision=_F32).astype(out_dtype)


def expand(y, X, post, comb, out_dtype):
    """hc_post: out[k] = post[k] y + sum_j comb[j, k] X[j]."""
    out = post[..., :, None] * y.astype(jnp.float32)[..., None, :] + jnp.einsum(
        "...jk,...jd->...kd", comb, X.astype(jnp.float32), precision=_F32)
    return out.astype(out_dtype)


def mhc_fused_reference(X, a, fn, base, scale, expand_args=None, *, eps, rms_eps, iters, out_dtype):
    check_shapes(X, a, fn, base, scale, expand_args)
    if expand_args is not None:
        X = expand(*expand_args[:1], X, *expand_args[1:], out_dtype)
    return X, collapse(X, a, out_dtype), sinkhorn_coefficients(X, fn, base, scale, eps=eps, rms_eps=rms_eps,
                                                               iters=iters)


def mhc_fused(X, a, fn, base, scale, expand_args=None, *, eps, rms_eps, iters, out_dtype, backend="auto",
              force=False):
    """The reference or the Triton kernel, as ``dispatch.use_triton("mhc", ...)`` decides at T tokens (the kernel
    on a GPU at every size today; ``force``: at any size whatever the table says, for tests and the bench)."""
    kw = dict(eps=eps, rms_eps=rms_eps, iters=iters, out_dtype=out_dtype)
    if not dispatch.use_triton("mhc", backend, X.shape[0], force=force):
        return mhc_fused_reference(X, a, fn, base, scale, expand_args, **kw)
    from dsflash.kernels import mhc_fused_triton  # lazy: needs a CUDA GPU and jax-triton
    return mhc_fused_triton.mhc_fused_triton(X, a, fn, base, scale, expand_args, **kw)
