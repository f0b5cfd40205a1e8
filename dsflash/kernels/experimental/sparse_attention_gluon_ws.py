"""The prefill flash sparse-attention kernel with the latent dimension split between two warpgroups (Gluon
``warp_specialize``; experimental, written in session 25 and only compiled so far: not yet run on a GPU).

Same contract and error band as ``sparse_attention_gluon.flash_gluon_kernel`` (one query row a CTA, all 64 heads,
RoPE around it). What changes, from session 25's measurement of that kernel (kernels/NOTES.md: ~7,000 cycles a
64-entry block on an H100, with ~2,050 of tensor work and QK's operand reads over the shared memory's 128 B a cycle):

* Warpgroup w (the default partition, w = 0, and one 4-warp worker, w = 1) owns the latent channels
  [256 w, 256 w + 256) of everything: its half of q, its half of each gathered kv row, its half of the output. Both
  products use only that half -- S_w = q[:, half] kv[:, half]^T is a partial sum of S over its channels, and
  O[:, half] += P kv[:, half] -- so a warpgroup never reads the other's kv (each gathers 32 KB a block, not 64).
* The two partial S [64, 64] fp32 are exchanged through shared memory (mbarriers full / empty per warpgroup); each
  warpgroup adds them (fp32 addition commutes, so both hold the same bits) and runs the whole softmax itself: the row
  max and sum need no exchange, and P goes straight from registers into PV's A operand (no shared-memory P).
* QK at n64 (not n32) and no P round trip: per block ~192 KB of shared-memory traffic instead of ~346 KB.

Shared memory: q 64 KB + kv 2 buffers x 2 halves x 32 KB + the exchange 32 KB = 224 KB (one CTA a SM).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from dsflash.kernels.sparse_attention_gluon import BK, _block_ids, _gather_kv, _online_softmax, pad_entries


@gluon.jit
def _half(q_s, kv_s, x_s, bars, q_ptr, kv_base, i_base, sink_ptr, o_ptr, row, N, K,
          W: gl.constexpr, H: gl.constexpr, D: gl.constexpr, SCALE: gl.constexpr, BK: gl.constexpr,
          NB: gl.constexpr):
    """One warpgroup's work on channels [W * D / 2, W * D / 2 + D / 2) of query row ``row``."""
    DH: gl.constexpr = D // 2
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    q_w = q_s.index(W)
    x_mine = x_s.index(W)
    x_other = x_s.index(1 - W)
    full_mine = bars.index(W)
    full_other = bars.index(1 - W)
    empty_mine = bars.index(2 + W)          # the other warpgroup has read my partial
    empty_other = bars.index(3 - W)
    kv_base = kv_base + W * DH              # this half's columns of every kv row
    hs = gl.arange(0, H, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, DH, layout=gl.SliceLayout(0, ld))
    async_copy.async_copy_global_to_shared(q_w, q_ptr + row * H * D + W * DH + hs[:, None] * D + cols[None, :])
    async_copy.commit_group()
    _gather_kv(kv_s.index(2 * W), kv_base, _block_ids(i_base, 0, K, BK, gl.SliceLayout(1, ld)), N, D, ld, DH)
    ids_g = _block_ids(i_base, 1, K, BK, gl.SliceLayout(1, ld))
    ids_m = _block_ids(i_base, 0, K, BK, gl.SliceLayout(0, s_l))

    m = gl.full([H], -1e30, gl.float32, layout=gl.SliceLayout(1, s_l))
    l = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([H, DH], gl.float32, layout=o_l)
    s0 = gl.zeros([H, BK], gl.float32, layout=s_l)
    for j in range(NB):
        buf = j % 2
        if j + 1 < NB:
            _gather_kv(kv_s.index(2 * W + 1 - buf), kv_base, ids_g, N, D, ld, DH)
            async_copy.wait_group(1)
        else:
            async_copy.wait_group(0)
        ids_g = _block_ids(i_base, j + 2, K, BK, gl.SliceLayout(1, ld))
        fence_async_shared()
        gl.thread_barrier()                 # this warpgroup's copies of block j landed
        kv_j = kv_s.index(2 * W + buf)
        s_w = warpgroup_mma(q_w, kv_j.permute((1, 0)), s0, use_acc=False)
        # exchange the partial S: wait until the other has read my previous one, publish mine, read theirs
        mbarrier.wait(empty_mine, (j & 1) ^ 1, pred=j > 0)
        x_mine.store(s_w)
        gl.thread_barrier()
        mbarrier.arrive(full_mine, count=1)
        mbarrier.wait(full_other, j & 1)
        s = s_w + x_other.load(s_l)
        gl.thread_barrier()
        mbarrier.arrive(empty_other, count=1)
        p, alpha, m = _online_softmax(s, ids_m, m, SCALE)
        ids_m = _block_ids(i_base, j + 1, K, BK, gl.SliceLayout(0, s_l))
        l = l * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_op), kv_j, acc)
        gl.thread_barrier()                 # kv_j read by every warp before block j + 2 overwrites it

    hs_s = gl.arange(0, H, layout=gl.SliceLayout(1, s_l))
    den = l + gl.exp(gl.load(sink_ptr + hs_s) - m)          # inf for a row with no valid entry: 0 / inf = 0
    o = acc / gl.convert_layout(den, gl.SliceLayout(1, o_l))[:, None]
    ho = gl.arange(0, H, layout=gl.SliceLayout(1, o_l))
    co = W * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_l))
    gl.store(o_ptr + row * H * D + ho[:, None] * D + co[None, :], o.to(gl.bfloat16))


@gluon.jit
def _half0(q_s, kv_s, x_s, bars, q_ptr, kv_base, i_base, sink_ptr, o_ptr, row, N, K, H: gl.constexpr,
           D: gl.constexpr, SCALE: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr):
    _half(q_s, kv_s, x_s, bars, q_ptr, kv_base, i_base, sink_ptr, o_ptr, row, N, K, 0, H, D, SCALE, BK, NB)


@gluon.jit
def _half1(q_s, kv_s, x_s, bars, q_ptr, kv_base, i_base, sink_ptr, o_ptr, row, N, K, H: gl.constexpr,
           D: gl.constexpr, SCALE: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr):
    _half(q_s, kv_s, x_s, bars, q_ptr, kv_base, i_base, sink_ptr, o_ptr, row, N, K, 1, H, D, SCALE, BK, NB)


@gluon.jit
def flash_ws_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, S, N, K, o_ptr,
                    H: gl.constexpr, D: gl.constexpr, SCALE: gl.constexpr, BK: gl.constexpr, NB: gl.constexpr,
                    WORKER_REGS: gl.constexpr):
    """grid (rows,), launched with 4 warps (the default partition) + one 4-warp worker; arguments as
    ``flash_gluon_kernel``'s."""
    gl.static_assert(H == 64, "one warpgroup row tile: H = 64 heads")
    row = gl.program_id(0).to(gl.int64)
    kv_base = kv_ptr + (row // S) * N * D
    i_base = idx_ptr + row * K
    DH: gl.constexpr = D // 2
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2, H, DH], gl.NVMMASharedLayout.get_default_for([H, DH], gl.bfloat16))
    kv_s = gl.allocate_shared_memory(gl.bfloat16, [4, BK, DH],
                                     gl.NVMMASharedLayout.get_default_for([BK, DH], gl.bfloat16))
    x_s = gl.allocate_shared_memory(gl.float32, [2, H, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()
    # the argument tuples written out in the call: a tuple bound to a name first turns its constexprs into tensors
    gl.warp_specialize([(_half0, (q_s, kv_s, x_s, bars, q_ptr, kv_base, i_base, sink_ptr, o_ptr, row, N, K, H, D,
                                  SCALE, BK, NB)),
                        (_half1, (q_s, kv_s, x_s, bars, q_ptr, kv_base, i_base, sink_ptr, o_ptr, row, N, K, H, D,
                                  SCALE, BK, NB))], [4], [WORKER_REGS])


def flash_prefill_gluon_ws(q, kv, idx, sink, scale, *, worker_regs: int = 232):
    """o [B, S, H, D] (bf16) of ``sparse_sink_attention`` without RoPE, by ``flash_ws_kernel`` (H 64, D 512, bf16);
    ``ValueError`` for any other shape or dtype."""
    from dsflash.kernels.triton_call import jax_triton
    B, S, H, D = q.shape
    if H != 64 or D != 512 or q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16:
        raise ValueError(f"flash_prefill_gluon_ws takes bf16 q [.., 64, 512]; got q {q.shape} {q.dtype}, "
                         f"kv {kv.dtype}")
    N = kv.shape[1]
    idx = pad_entries(idx.astype(jnp.int32))
    K = idx.shape[2]
    return jax_triton().triton_call(
        q, kv, idx, sink.astype(jnp.float32), S, N, K, kernel=flash_ws_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(B * S,), num_warps=4,
        H=H, D=D, SCALE=float(scale), BK=BK, NB=-(-K // BK), WORKER_REGS=int(worker_regs))
