"""Routed-expert grouped GEMM (SwiGLU) over MXFP4 expert weights.

``routed_moe(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision, backend)``
  x [T, d] bf16 (or f32 in "fp32" precision); idx [T, k] int32 expert ids; weight [T, k] f32 routing weights
  w1/w3 [E, I, d/2] int8 (E2M1 nibble pairs, low nibble first), s1/s3 [E, I, d/32] uint8 UE8M0
  w2 [E, d, I/2] int8, s2 [E, d, I/32] uint8
  -> [T, d] float32: the sum over the k routed experts (each expert's output rounded to the compute dtype).

Numerics (SPEC §8, §12): in "reference" precision the activations entering each expert GEMM take the FP8
E4M3 round trip per 32; ``g = min(x W1^T, limit)``, ``u = clip(x W3^T, -limit, limit)`` in fp32,
``h = silu(g) * u * weight`` (routing weight applied before W2), h rounded to bf16 (and FP8 round trip),
``out = h W2^T`` accumulated in fp32 then rounded to bf16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.model import quant


def _compute_dtype(precision):
    return jnp.float32 if precision == "fp32" else jnp.bfloat16


def routed_moe_reference(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision="reference"):
    T, d = x.shape
    k = idx.shape[1]
    E = w1.shape[0]
    cdt = _compute_dtype(precision)
    xa = x.astype(cdt)
    if precision == "reference":
        xa = quant.fp8_roundtrip(xa, 32)
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    xs = xa[tok]
    W1 = quant.dequant_mxfp4_weight(w1, s1, cdt)
    W3 = quant.dequant_mxfp4_weight(w3, s3, cdt)
    W2 = quant.dequant_mxfp4_weight(w2, s2, cdt)
    g = jax.lax.ragged_dot(xs, jnp.swapaxes(W1, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, jnp.swapaxes(W3, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    h = jax.nn.silu(g) * u * weight.reshape(-1)[order][:, None].astype(jnp.float32)
    h = h.astype(cdt)
    if precision == "reference":
        h = quant.fp8_roundtrip(h, 32)
    o = jax.lax.ragged_dot(h, jnp.swapaxes(W2, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    o = o.astype(cdt).astype(jnp.float32)
    return jnp.zeros((T, d), jnp.float32).at[tok].add(o)


def routed_moe(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision="reference", backend="xla", layer=None):
    """Dispatch by backend. ``layer`` (the block name) is accepted for hook compatibility and unused here."""
    if backend == "xla":
        return routed_moe_reference(x, idx, weight, w1, s1, w3, s3, w2, s2, limit=limit, precision=precision)
    if backend == "triton":
        from dsflash.kernels import moe_gemm_triton  # lazy: needs a CUDA GPU and jax-triton
        return moe_gemm_triton.routed_moe_triton(x, idx, weight, w1, s1, w3, s3, w2, s2, limit=limit,
                                                 precision=precision)
    raise ValueError(f"backend must be 'xla' or 'triton', got {backend!r}")
