"""The prefill flash sparse-attention kernel in Gluon: the default for one-split bf16 launches from
``sparse_attention_triton.GLUON_FROM_ROWS`` (4,096) query rows since session 26, where it measured faster than the
Triton ``flash_bk64_s2`` on an H100 (16,384 rows 5.22 -> 4.41 ms; 4,096 1.40 -> 1.32; 2,048 0.76 -> 0.78, slower).

Same contract and numerics as ``sparse_attention_triton._flash_kernel`` with one split and RoPE around it (q's and o's
tails rotated by the caller): per query row all H = 64 heads (the MMA's M) over its K selected entries of the shared
latent kv [N, D = 512], an online softmax with P rounded to bf16 against the running max (error band
``sparse_attention_triton.flash_bound``), o = acc / (l + exp(sink - m)).

Why Gluon (kernels/NOTES.md, session 24, "The flash kernel's TTGIR"): Triton 3.6 lays S = q kv^T [64, 64] over both
warpgroups stacked along M, so both compute the whole S (the SM's tensor work is 1.5x the attention's flops), and two
layout conversions a block serialise softmax and MMA. Here the layouts are chosen, not inferred:

* S [64 heads, BK entries] is ``NVMMADistributedLayout`` with ``warps_per_cta [4, 2]``: warpgroup w computes the
  entries [w * BK / 2, (w + 1) * BK / 2) of the block -- each product once (QK MACs a block 64 x 64 x 512, not twice).
* The row max crosses the two warpgroups (a shared-memory reduction Triton inserts for ``gl.max``); the row sum does
  not: l is kept as per-column partials [64, BK] and summed once at the end.
* O [64, 512] is ``[4, 2]`` too: warpgroup w owns output channels [256 w, 256 w + 256); P [64, BK] goes through shared
  memory (each warpgroup writes its half of the columns) as PV's A operand; kv's [BK, 512] tile in shared memory is
  QK's B (transposed view) and PV's B.
* kv blocks are gathered with ``cp.async`` into a two-buffer ring, block j + 1 in flight while block j computes;
  invalid entries (idx < 0) gather row 0 (always readable, finite) and get logit -inf, so they add nothing. Every
  thread fences its own shared-memory writes (cp.async, P) to the async proxy before the barrier the MMA waits at.

``OVERLAP`` (1): the QK of block j + 1 is issued (asynchronously) before the softmax of block j, so the tensor cores
work while the warps compute exponentials (the intra-warpgroup overlap of FlashAttention-3); 0: QK, softmax, PV in
series. Both are launched by ``flash_prefill_gluon`` and checked by ``tests/gpu/test_sparse_attention_gluon.py``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _block_ids(i_base, blk, K, BK: gl.constexpr, layout: gl.constexpr):
    """idx[blk * BK : blk * BK + BK] in ``layout`` (-1 past K: nothing is read there)."""
    offs = blk * BK + gl.arange(0, BK, layout=layout)
    return gl.load(i_base + offs, mask=offs < K, other=-1)


@gluon.jit
def _gather_kv(kv_s, kv_base, ids, N, D: gl.constexpr, ld: gl.constexpr, DW: gl.constexpr):
    """cp.async of kv[ids, :DW] [BK, DW] (rows of D elements from ``kv_base``; ids < 0: row 0) into ``kv_s``,
    committed as one group."""
    safe = gl.minimum(gl.where(ids >= 0, ids, 0), N - 1).to(gl.int64)
    cols = gl.arange(0, DW, layout=gl.SliceLayout(0, ld))
    async_copy.async_copy_global_to_shared(kv_s, kv_base + safe[:, None] * D + cols[None, :])
    async_copy.commit_group()


@gluon.jit
def _online_softmax(s, ids, m, SCALE: gl.constexpr):
    """One block's step of the online softmax: logits ``s * SCALE`` (-inf where ``ids`` < 0), the new running max
    ``m_new`` (>= the old ``m``; -1e30 while nothing is valid), p = exp(s - m_new) and alpha = exp(m - m_new), the
    factor the sums so far are rescaled by: (p, alpha, m_new)."""
    s = gl.where((ids >= 0)[None, :], s * SCALE, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1))
    return gl.exp(s - m_new[:, None]), gl.exp(m - m_new), m_new


@gluon.jit
def flash_gluon_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, S, N, K, o_ptr,
                       H: gl.constexpr, D: gl.constexpr, SCALE: gl.constexpr, BK: gl.constexpr,
                       NB: gl.constexpr, OVERLAP: gl.constexpr):
    """grid (rows,), 8 warps; q [rows, H, D], kv [B, N, D] bf16, idx [rows, K] int32, sink [H] fp32, o [rows, H, D]
    bf16 (last: jax-triton passes the outputs after every input, scalars included); NB = ceil(K / BK) blocks."""
    gl.static_assert(H == 64, "one warpgroup row tile: H = 64 heads")
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    row = gl.program_id(0).to(gl.int64)
    kv_base = kv_ptr + (row // S) * N * D
    i_base = idx_ptr + row * K

    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BK // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.bfloat16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BK], gl.bfloat16)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [H, D], q_sl)
    kv_s = gl.allocate_shared_memory(gl.bfloat16, [2, BK, D], kv_sl)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [H, BK], p_sl)

    hs = gl.arange(0, H, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    async_copy.async_copy_global_to_shared(q_s, q_ptr + row * H * D + hs[:, None] * D + cols[None, :])
    async_copy.commit_group()
    _gather_kv(kv_s.index(0), kv_base, _block_ids(i_base, 0, K, BK, gl.SliceLayout(1, ld)), N, D, ld, D)
    # the ids are loaded one block ahead of their use (their latency hides behind a block's MMA): ids_g for the
    # gather of block j + 1, ids_m for the mask of block j
    ids_g = _block_ids(i_base, 1, K, BK, gl.SliceLayout(1, ld))
    ids_m = _block_ids(i_base, 0, K, BK, gl.SliceLayout(0, s_l))

    m = gl.full([H], -1e30, gl.float32, layout=gl.SliceLayout(1, s_l))
    l2 = gl.zeros([H, BK], gl.float32, layout=s_l)          # per-column partial sums of p (summed once, at the end)
    acc = gl.zeros([H, D], gl.float32, layout=o_l)
    s0 = gl.zeros([H, BK], gl.float32, layout=s_l)
    if OVERLAP:
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        s_tok = warpgroup_mma(q_s, kv_s.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
    for j in range(NB):
        buf = j % 2
        if j + 1 < NB:                      # block j + 1 in flight while j computes; its buffer's readers are done
            _gather_kv(kv_s.index(1 - buf), kv_base, ids_g, N, D, ld, D)
        ids_g = _block_ids(i_base, j + 2, K, BK, gl.SliceLayout(1, ld))
        if OVERLAP:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        else:
            if j + 1 < NB:
                async_copy.wait_group(1)
            else:
                async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
            s = warpgroup_mma(q_s, kv_s.index(buf).permute((1, 0)), s0, use_acc=False)
        p, alpha, m = _online_softmax(s, ids_m, m, SCALE)
        ids_m = _block_ids(i_base, j + 1, K, BK, gl.SliceLayout(0, s_l))
        l2 = l2 * alpha[:, None] + p
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()                 # both warpgroups' halves of P written
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        pv_tok = warpgroup_mma(p_s, kv_s.index(buf), acc, is_async=True)
        if OVERLAP:
            if j + 1 < NB:                  # S of block j + 1 queued behind PV of block j
                async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
                s_tok = warpgroup_mma(q_s, kv_s.index(1 - buf).permute((1, 0)), s0, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(pv_tok,))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok,))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok,))
        gl.thread_barrier()                 # P and kv[buf] read by both warpgroups before they are overwritten

    l = gl.sum(l2, axis=1)
    hs_s = gl.arange(0, H, layout=gl.SliceLayout(1, s_l))
    den = l + gl.exp(gl.load(sink_ptr + hs_s) - m)          # inf for a row with no valid entry: 0 / inf = 0
    den_o = gl.convert_layout(den, gl.SliceLayout(1, o_l))
    o = acc / den_o[:, None]
    ho = gl.arange(0, H, layout=gl.SliceLayout(1, o_l))
    co = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    gl.store(o_ptr + row * H * D + ho[:, None] * D + co[None, :], o.to(gl.bfloat16))


BK = 64


def pad_entries(idx):
    """idx [B, S, K] with at least two blocks of BK entries (-1 = empty, adds nothing): a one-block launch stops
    Triton 3.6's TTGIR -> LLVM lowering with an assertion (sm_90 compile, session 25)."""
    K = idx.shape[-1]
    if K > BK:
        return idx
    return jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, 2 * BK - K)], constant_values=-1)


def flash_prefill_gluon(q, kv, idx, sink, scale, *, overlap: int = 0):
    """o [B, S, H, D] (q's dtype, bf16) of ``sparse_sink_attention`` without RoPE, by ``flash_gluon_kernel`` (H 64,
    D 512, bf16 q / kv: the only shape it is tested at; any other is a ``ValueError``). ``overlap`` 0 (QK, softmax,
    PV in series) is the default: 0.91x flash_bk64_s2's time at 16K rows against 0.92x for 1 (H100, session 25;
    0.85x since the ids are loaded a block ahead, session 26)."""
    from dsflash.kernels.triton_call import jax_triton
    B, S, H, D = q.shape
    if H != 64 or D != 512 or q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16:
        raise ValueError(f"flash_prefill_gluon takes bf16 q [.., 64, 512]; got q {q.shape} {q.dtype}, kv {kv.dtype}")
    N = kv.shape[1]
    idx = pad_entries(idx.astype(jnp.int32))
    K = idx.shape[2]
    jt = jax_triton()
    return jt.triton_call(
        q, kv, idx, sink.astype(jnp.float32), S, N, K, kernel=flash_gluon_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(B * S,), num_warps=8,
        H=H, D=D, SCALE=float(scale), BK=BK, NB=-(-K // BK), OVERLAP=int(overlap))
