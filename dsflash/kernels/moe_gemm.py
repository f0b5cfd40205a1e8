"""Routed-expert grouped GEMM (SwiGLU) over MXFP4 expert weights.

``routed_moe(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision, backend)`` (backend: see ``dispatch``)
  x [T, d] bf16 (or f32 in "fp32" precision); idx [T, k] int32 expert ids; weight [T, k] f32 routing weights
  w1/w3 [E, I, d/2] int8 (E2M1 nibble pairs, low nibble first), s1/s3 [E, I, d/32] uint8 UE8M0
  w2 [E, d, I/2] int8, s2 [E, d, I/32] uint8
  (or all six in the load-time "il" layout of ``moe_layout``: uint16 [E, N, K/4] + uint32 [E, N, K/128])
  -> [T, d] float32: the sum over the k routed experts (each expert's output rounded to the compute dtype).

Numerics (SPEC §8, §12): in "reference" precision the activations entering each expert GEMM take the FP8
E4M3 round trip per 32; x W1^T and x W3^T accumulate in fp32 and are rounded to bf16 (the output dtype of an
FP8/FP4 linear), then ``g = min(x W1^T, limit)``, ``u = clip(x W3^T, -limit, limit)`` in fp32,
``h = silu(g) * u * weight`` (routing weight applied before W2), h rounded to bf16 (and FP8 round trip),
``out = h W2^T`` accumulated in fp32 then rounded to bf16. "bf16": the same roundings without the FP8 round trips;
"fp32": no rounding anywhere.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.kernels import dispatch, moe_layout
from dsflash import quant


def _compute_dtype(precision):
    return jnp.float32 if precision == "fp32" else jnp.bfloat16


# CPU path of grouped_dot: rows per block, and the cap on its gathered per-block weights (bytes) above which it
# falls back to lax.ragged_dot
_CPU_BLOCK_ROWS = 8
_CPU_MAX_GATHER_BYTES = 256 << 20


def grouped_dot(xs, w, group_sizes):
    """``lax.ragged_dot(xs, w, group_sizes)`` with fp32 accumulation: xs [M, K] rows sorted by group, w [G, K, N],
    group_sizes [G] -> [M, N] f32; rows past the last group are 0.

    On CPU, XLA lowers ``ragged_dot`` to a product of every row with every group's matrix (its cost analysis counts
    G x the grouped flops), which made the routed MoE most of a demo-model forward. The CPU path here cuts each
    group's rows into blocks of ``_CPU_BLOCK_ROWS`` (a static bound of M / 8 + G blocks), gathers each block's rows
    and matrix and runs one batched matmul: the grouped flops plus block padding. Measured (demo MoE, G=8, K=256,
    N=128, bf16, 2 cores): 0.31 vs 1.43 ms at 96 rows, 2.7 vs 11.5 ms at 1,024. Results equal ``ragged_dot``'s to
    fp32 accumulation order (~3e-7 relative) and a row's result does not depend on the other rows (fixed block
    shape; tested). Other platforms keep ``ragged_dot``, a real grouped GEMM there."""
    def ragged(xs, w, group_sizes):
        return jax.lax.ragged_dot(xs, w, group_sizes, preferred_element_type=jnp.float32)

    M, K = xs.shape
    G, _, N = w.shape
    b = _CPU_BLOCK_ROWS
    nb = -(-M // b) + G                                     # each group wastes < 1 block
    if nb * K * N * w.dtype.itemsize > _CPU_MAX_GATHER_BYTES:
        return ragged(xs, w, group_sizes)

    def blocked(xs, w, group_sizes):
        ends = jnp.cumsum(group_sizes)
        starts = ends - group_sizes
        blocks = -(-group_sizes // b)
        bend = jnp.cumsum(blocks)
        j = jnp.arange(nb)
        grp = jnp.searchsorted(bend, j, side="right")       # G: an unused block
        g = jnp.minimum(grp, G - 1)
        rows = (starts[g] + (j - (bend - blocks)[g]) * b)[:, None] + jnp.arange(b)[None]      # [nb, b]
        ok = (grp < G)[:, None] & (rows < ends[g][:, None])
        xb = jnp.where(ok[..., None], xs[jnp.clip(rows, 0, M - 1)], 0)
        # XLA fuses the caller's weight dequantisation into this gather, so each group's matrix is dequantised once
        # per block (~2.5x the dequantisation at 96 rows; an optimisation barrier is removed before fusion and a
        # one-hot product instead of the gather was 2x slower overall)
        ob = jnp.einsum("jbk,jkn->jbn", xb, w[g], preferred_element_type=jnp.float32)
        out = jnp.zeros((M + 1, N), jnp.float32).at[jnp.where(ok, rows, M).reshape(-1)].set(ob.reshape(-1, N))
        return out[:M]

    return jax.lax.platform_dependent(xs, w, group_sizes, cpu=blocked, default=ragged)


def routed_moe_reference(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision="reference"):
    if moe_layout.is_il(w1):      # weights in the load-time il layout (opt-in, kernels/moe_layout.py): convert back
        w1, s1 = moe_layout.to_checkpoint(w1, s1)
        w3, s3 = moe_layout.to_checkpoint(w3, s3)
        w2, s2 = moe_layout.to_checkpoint(w2, s2)
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
    # an FP4 linear accumulates in fp32 and outputs the compute dtype (SPEC §12; the official Expert runs
    # ``self.w1(x).float()``): x W1^T and x W3^T are rounded to bf16 before the clamp and SiLU (a no-op in "fp32")
    g = grouped_dot(xs, jnp.swapaxes(W1, 1, 2), group_sizes).astype(cdt).astype(jnp.float32)
    u = grouped_dot(xs, jnp.swapaxes(W3, 1, 2), group_sizes).astype(cdt).astype(jnp.float32)
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    h = jax.nn.silu(g) * u * weight.reshape(-1)[order][:, None].astype(jnp.float32)
    h = h.astype(cdt)
    if precision == "reference":
        h = quant.fp8_roundtrip(h, 32)
    o = grouped_dot(h, jnp.swapaxes(W2, 1, 2), group_sizes)
    o = o.astype(cdt).astype(jnp.float32)
    return jnp.zeros((T, d), jnp.float32).at[tok].add(o)


def routed_moe(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision="reference", backend="auto", layer=None):
    """The reference or the Triton kernel, as ``dispatch.use_triton("moe", ...)`` decides (the kernel on a GPU at
    every size; "auto" keeps precision "fp32", which the kernel lacks, on the reference). ``layer`` (the block
    name) is accepted for hook compatibility and unused here."""
    dispatch.check_backend(backend)         # before touching the arrays: a bad setting fails the same way always
    if not dispatch.use_triton("moe", backend, idx.shape[0] * idx.shape[1], precision=precision):
        return routed_moe_reference(x, idx, weight, w1, s1, w3, s3, w2, s2, limit=limit, precision=precision)
    from dsflash.kernels import moe_gemm_triton  # lazy: needs a CUDA GPU and jax-triton
    return moe_gemm_triton.routed_moe_triton(x, idx, weight, w1, s1, w3, s3, w2, s2, limit=limit,
                                             precision=precision)
