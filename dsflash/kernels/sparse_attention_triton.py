"""Triton (jax-triton) sparse sink attention, same contract as ``sparse_attention.sparse_sink_attention_reference``.

STATUS (2026-11-30): first version, checked against the reference in Triton's interpreter only
(``scripts/triton_interpret_sparse_attention.py``); ``tests/gpu/test_sparse_attention.py`` is written but has not
run on a GPU yet, and nothing here is timed. Not used by default anywhere.

Design (exact two-pass, so P is rounded exactly as the reference rounds it):
* one program per (query row b*S+s, slice of DV output channels); H heads (64 in V4.1) share the gathered latent
  rows (MQA), so each KV row gathered serves all heads: logits [H, BK] = q[H, D] . kv[idx, D]^T in fp32;
* pass 1 over the K selected entries (blocks of BK): the row max m = max(max_e s_e, -1e30) per head;
* pass 2: p = exp(s - m) in fp32, den += sum p (fp32), P rounded to bf16 (``precision="reference"``), acc += P . V
  for this program's DV channels; finally o = acc / (den + exp(sink_h - m));
* entries with idx < 0 contribute nothing (their rows are never read: the gather index is clamped and the logit
  is -inf); a row with no valid entry gives 0.
Costs: the QK product is computed twice per DV slice (D/DV + 1 times in all); the KV rows come from L2 after the
first read. A one-pass online-softmax variant would change the bf16 rounding of P and is left out on purpose.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _logits(q_base, kv_base, safe, H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
            IEEE: tl.constexpr):
    offs_h = tl.arange(0, H)
    offs_c = tl.arange(0, DC)
    s = tl.zeros((H, BK), tl.float32)
    for d0 in tl.static_range(0, D, DC):
        qc = tl.load(q_base + offs_h[:, None] * D + d0 + offs_c[None, :])
        kc = tl.load(kv_base + safe[:, None] * D + d0 + offs_c[None, :])
        s += _mm(qc, tl.trans(kc), IEEE)
    return s


@triton.jit
def _sparse_sink_attn_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr,
                             S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                             K: tl.constexpr, SCALE: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
                             DV: tl.constexpr, P_BF16: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dv = tl.program_id(1)
    b = row // S
    q_base = q_ptr + row * (H * D)
    kv_base = kv_ptr + b * (N * D)
    i_base = idx_ptr + row * K
    offs_h = tl.arange(0, H)
    offs_k = tl.arange(0, BK)
    # pass 1: row max per head (clamped like the reference)
    m = tl.full((H,), -1e30, tl.float32)
    for k0 in tl.range(0, K, BK):
        ids = tl.load(i_base + k0 + offs_k, mask=k0 + offs_k < K, other=-1)
        valid = ids >= 0
        safe = tl.where(valid, ids, 0).to(tl.int64)
        s = _logits(q_base, kv_base, safe, H, D, BK, DC, IEEE) * SCALE
        s = tl.where(valid[None, :], s, float("-inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
    # pass 2: probabilities, denominator, P.V for this program's channels
    offs_v = dv * DV + tl.arange(0, DV)
    acc = tl.zeros((H, DV), tl.float32)
    den = tl.zeros((H,), tl.float32)
    for k0 in tl.range(0, K, BK):
        ids = tl.load(i_base + k0 + offs_k, mask=k0 + offs_k < K, other=-1)
        valid = ids >= 0
        safe = tl.where(valid, ids, 0).to(tl.int64)
        s = _logits(q_base, kv_base, safe, H, D, BK, DC, IEEE) * SCALE
        s = tl.where(valid[None, :], s, float("-inf"))
        p = tl.exp(s - m[:, None])
        den += tl.sum(p, axis=1)
        v = tl.load(kv_base + safe[:, None] * D + offs_v[None, :])
        if P_BF16:
            # integer RNE to bf16 (exact same result as the hardware cast; Triton's interpreter truncates)
            pb = ((p.to(tl.uint32, bitcast=True) + 0x7FFF + ((p.to(tl.uint32, bitcast=True) >> 16) & 1))
                  & 0xFFFF0000).to(tl.float32, bitcast=True)
            acc += _mm(pb.to(tl.bfloat16), v.to(tl.bfloat16), IEEE)
        else:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    sink = tl.load(sink_ptr + offs_h)
    den += tl.exp(sink - m)
    o = acc / den[:, None]
    tl.store(o_ptr + row * (H * D) + offs_h[:, None] * D + offs_v[None, :], o.to(o_ptr.dtype.element_ty))


def launch_params(H, D, K, precision):
    BK = 32
    DC = 64 if D % 64 == 0 else 32
    DV = 128 if D % 128 == 0 else D
    return dict(BK=BK, DC=DC, DV=DV, P_BF16=int(precision != "fp32"))


def sparse_sink_attention_triton(q, kv, idx, sink, scale, *, out_dtype=None, precision="reference",
                                 block_k=None, block_dv=None):
    import jax_triton as jt  # lazy: GPU only

    B, S, H, D = q.shape
    N = kv.shape[1]
    K = idx.shape[2]
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if H & (H - 1) or H < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two head count >= 16, got {H}")
    prm = launch_params(H, D, K, precision)
    if block_k:
        prm["BK"] = block_k
    if block_dv:
        prm["DV"] = block_dv
    ieee = int(q.dtype == jnp.float32)
    return jt.triton_call(
        q, kv, idx.astype(jnp.int32), sink.astype(jnp.float32),
        kernel=_sparse_sink_attn_kernel,
        out_shape=jax.ShapeDtypeStruct((B, S, H, D), out_dtype),
        grid=(B * S, D // prm["DV"]), num_warps=4, num_stages=2,
        S=S, N=N, H=H, D=D, K=K, SCALE=float(scale), IEEE=ieee, **prm)
