"""Two small Gluon kernels that check the Gluon launch path (``kernels/gluon_launch.py``) before anything large is
built on it: an elementwise kernel (the launch ABI: arrays, a scalar, a constexpr) and a bf16 GEMM tile on Hopper's
``warpgroup_mma`` with operands staged in NVMMA-swizzled shared memory (what an attention kernel with warpgroup roles
is made of). No TMA: jax-triton passes no host tensor descriptors and a null global-scratch pointer, so operands are
loaded with plain pointer loads. jax-triton passes the inputs (arrays and scalars, in call order) and then the
outputs, so an output pointer is the last runtime parameter. References are the jnp one-liners in
``tests/gpu/test_gluon_launch.py``."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def axpb_kernel(x_ptr, o_ptr, a, BLOCK: gl.constexpr):
    """o = x * a + 1 over BLOCK elements a program (n a multiple of BLOCK)."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    i = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    gl.store(o_ptr + i, gl.load(x_ptr + i) * a + 1.0)


@gluon.jit
def wgmma_gemm_kernel(a_ptr, b_ptr, M, N, K, c_ptr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """c[M, N] (fp32) = a[M, K] @ b[K, N] (bf16, row-major; M, N, K multiples of the tile), one [BM, BN] tile a program,
    4 warps: each K step loads both operand tiles into NVMMA shared memory and issues one ``warpgroup_mma``."""
    pm = gl.program_id(0)
    pn = gl.program_id(1)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                    instr_shape=[16, BN, 16])
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [BM, BK], a_sl)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [BK, BN], b_sl)
    am = pm * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, ld))
    bk = gl.arange(0, BK, layout=gl.SliceLayout(1, ld))
    bn = pn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, ld))
    acc = gl.zeros([BM, BN], gl.float32, layout=acc_l)
    for k0 in range(0, K, BK):
        a_s.store(gl.load(a_ptr + am[:, None] * K + (k0 + ak)[None, :]))
        b_s.store(gl.load(b_ptr + (k0 + bk)[:, None] * N + bn[None, :]))
        fence_async_shared()
        acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()     # every warp's MMA has read the tiles before the next K step overwrites them
    cm = pm * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
    cn = pn * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
    gl.store(c_ptr + cm[:, None] * N + cn[None, :], acc)
