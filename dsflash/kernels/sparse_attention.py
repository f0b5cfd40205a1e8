"""Sparse attention with an attention sink over gathered KV rows (SPEC_V41 §4.6, §16b.7).

``sparse_sink_attention(q, kv, idx, sink, scale, *, backend)``
  q    [B, S, H, D]  bf16 (or f32) queries, H heads sharing one latent KV row (MQA, D = 512 in V4.1)
  kv   [B, N, D]     bf16 (or f32) KV rows (the caller lays the SWA window and the compressed entries into
                     one buffer, already dequantised: the reference reads values, not packed bytes)
  idx  [B, S, K]     int32 row ids into kv per query row; -1 = empty slot (contributes nothing)
  sink [H]           f32 per-head sink logit: a "null" key with zero value, in the denominator only
  scale              python float (V4.1: 512 ** -0.5)
  rope               optional (cos, sin), each [B, S, rd/2] fp32 (``rope.rope_table`` of the rows' positions): q's
                     last rd channels are rotated by it first (rounded to q.dtype), o's get the inverse last
                     (rounded to out_dtype), exactly as ``rope.rotate_tail`` does; the one-split flash kernel can do
                     both itself on the tails (``sparse_attention_triton.ROPE_IN_KERNEL``), so that neither q nor
                     o is re-written by a concatenation for it
  -> [B, S, H, D] in ``out_dtype`` (default q.dtype)

Numerics (the contract every backend is checked against):
  s_e = (q_h . kv_e) * scale        fp32 accumulation of the q/kv products, masked to -inf where idx < 0
  m   = max(max_e s_e, -1e30)       so a row with no valid entry gives exp(-inf - m) = 0, output 0
  p_e = exp(s_e - m)                fp32
  den = sum_e p_e + exp(sink_h - m) fp32
  o_h = (sum_e bf16(p_e) * kv_e) / den   P rounded to bf16 before P.V (fp32 accumulation); in "fp32"
                                          precision P stays fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.kernels import dispatch
from dsflash.kernels.rope import check_rope, rope_o, rope_q

NEG_CLAMP = -1e30


def _attend_chunk(q, kv, idx, sink, scale, p_dtype):
    # q [B, s, H, D], kv [B, N, D], idx [B, s, K]
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    rows = jax.vmap(lambda kvb, ib: kvb[ib])(kv, safe)                      # [B, s, K, D]
    logits = jnp.einsum("bshd,bskd->bshk", q, rows, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(scale)
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), jnp.float32(NEG_CLAMP))
    p = jnp.exp(logits - m)                                                  # [B, s, H, K] fp32
    den = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink.astype(jnp.float32)[None, None, :, None] - m)
    pv = jnp.einsum("bshk,bskd->bshd", p.astype(p_dtype), rows.astype(p_dtype),
                    preferred_element_type=jnp.float32)
    return pv / den


def sparse_sink_attention_reference(q, kv, idx, sink, scale, *, out_dtype=None, precision="reference",
                                    chunk=None, rope=None):
    """Pure-JAX reference. ``chunk`` (rows of S per step, optional) bounds the gathered [B, s, K, D] buffer
    for long prefills; it does not change the result. ``rope``: the module docstring's."""
    check_rope(rope, q)
    out_dtype = q.dtype if out_dtype is None else out_dtype
    o = _attend(rope_q(q, rope), kv, idx, sink, scale, out_dtype, precision, chunk)
    return rope_o(o, rope)


def _attend(q, kv, idx, sink, scale, out_dtype, precision, chunk):
    B, S, H, D = q.shape
    if kv.ndim != 3 or kv.shape[0] != B or kv.shape[2] != D:
        raise ValueError(f"kv must be [B={B}, N, D={D}], got {kv.shape}")
    if idx.ndim != 3 or idx.shape[:2] != (B, S):
        raise ValueError(f"idx must be [B={B}, S={S}, K], got {idx.shape}")
    if sink.shape != (H,):
        raise ValueError(f"sink must be [H={H}], got {sink.shape}")
    p_dtype = jnp.float32 if precision == "fp32" else jnp.bfloat16
    idx = idx.astype(jnp.int32)
    if chunk is None or chunk >= S:
        return _attend_chunk(q, kv, idx, sink, scale, p_dtype).astype(out_dtype)
    if S % chunk:
        raise ValueError(f"chunk {chunk} must divide S={S}")
    qc = q.reshape(B, S // chunk, chunk, H, D).swapaxes(0, 1)
    ic = idx.reshape(B, S // chunk, chunk, -1).swapaxes(0, 1)
    out = jax.lax.map(lambda a: _attend_chunk(a[0], kv, a[1], sink, scale, p_dtype).astype(out_dtype),
                      (qc, ic))
    return out.swapaxes(0, 1).reshape(B, S, H, D)


def sparse_sink_attention(q, kv, idx, sink, scale, *, out_dtype=None, precision="reference", backend="auto",
                          force=False, rope=None):
    """The reference or the Triton kernel, as ``dispatch.use_triton("sparse_attention", ...)`` decides at B*S query
    rows (the kernel on a GPU from 128 rows; ``force``: at any size, for tests and the bench). The kernel itself:
    ``sparse_attention_triton.sparse_sink_attention_triton`` (always runs it). ``rope``: the module docstring's."""
    if not dispatch.use_triton("sparse_attention", backend, q.shape[0] * q.shape[1], precision=precision,
                               force=force):
        return sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=out_dtype, precision=precision,
                                               rope=rope)
    from dsflash.kernels import sparse_attention_triton  # lazy: needs a CUDA GPU and jax-triton
    return sparse_attention_triton.sparse_sink_attention_triton(q, kv, idx, sink, scale, out_dtype=out_dtype,
                                                                precision=precision, rope=rope)


def gather_decoded(pool, addr, decode, dtype):
    """The pool's rows at ``addr`` [B, n], decoded: [B, n, D] (``attention.gather_pool``'s ops)."""
    return decode(jax.tree.map(lambda a: a[addr], pool), dtype)


def sparse_sink_attention_paged_reference(q, win, win_idx, pool, addr, valid, sink, scale, *, decode,
                                          out_dtype=None, precision="reference", backend="auto", rope=None):
    """Attention over window rows and pool entries, the model's way: ``sparse_sink_attention`` (which may run the
    plain kernel) over ``paged_buffer``'s materialised rows and ids.

    win [B, NW, D]; win_idx [B, S, KW] ids into win; pool: the pool's leaves ([P, ...] each, decoded by ``decode``
    (leaves, dtype)); addr / valid [B, S, K]: each pick's pool row (always a readable row) and whether it is real."""
    kv, idx = paged_buffer(win, win_idx, pool, addr, valid, decode)
    return sparse_sink_attention(q, kv, idx, sink, scale, out_dtype=out_dtype, precision=precision, backend=backend,
                                 rope=rope)


def paged_buffer(win, win_idx, pool, addr, valid, decode):
    """The one buffer the plain attention reads: (kv = window rows ++ the picks decoded to ``win.dtype``, ids =
    ``win_idx`` ++ each pick's row there, -1 where not ``valid``). Entry s*K + k of a sequence is its row s's pick k."""
    B, S, K = addr.shape
    picked = gather_decoded(pool, addr.reshape(B, S * K), decode, win.dtype)
    kv = jnp.concatenate([win, picked], axis=1)
    local = win.shape[1] + jnp.arange(S * K, dtype=jnp.int32).reshape(1, S, K)
    return kv, jnp.concatenate([win_idx, jnp.where(valid, local, -1)], axis=-1)


def paged_kernel_fits(pool, precision) -> bool:
    """The paged kernel reads NVFP4 pools ("q" nibbles + "s" E4M3 scales, the "reference" precision's encoding)."""
    return precision == "reference" and set(pool) == {"q", "s"}


def sparse_sink_attention_paged(q, win, win_idx, pool, addr, valid, sink, scale, *, decode, out_dtype=None,
                                precision="reference", backend="auto", force=False, rope=None):
    """``sparse_sink_attention_paged_reference`` or the paged kernel (``sparse_attention_paged_triton``), as
    ``dispatch.use_triton("sparse_attention_paged", ...)`` decides at B*S query rows, for NVFP4 pools only.
    ``rope``: as ``sparse_sink_attention``'s; around the paged kernel it runs in XLA (decode-sized q and o)."""
    if paged_kernel_fits(pool, precision) and dispatch.use_triton(
            "sparse_attention_paged", backend, q.shape[0] * q.shape[1], precision=precision, force=force):
        from dsflash.kernels import sparse_attention_paged_triton as spt  # lazy: needs a CUDA GPU and jax-triton
        check_rope(rope, q)
        out_dtype = q.dtype if out_dtype is None else out_dtype
        o = spt.sparse_sink_attention_paged_triton(rope_q(q, rope), win, win_idx, pool["q"], pool["s"], addr, valid,
                                                   sink, scale, out_dtype=out_dtype, precision=precision)
        return rope_o(o, rope)
    return sparse_sink_attention_paged_reference(q, win, win_idx, pool, addr, valid, sink, scale, decode=decode,
                                                 out_dtype=out_dtype, precision=precision, backend=backend, rope=rope)
