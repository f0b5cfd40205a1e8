"""Gluon kernels launched through jax-triton 0.3.1 (``dsflash.kernels.gluon_launch``) on the GPU: an elementwise
kernel (arrays, a float scalar, a constexpr) and a bf16 ``warpgroup_mma`` GEMM tile, against jnp, inside one jit with
an ordinary Triton kernel (which must still go through jax-triton's own compile)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytest.importorskip("triton.experimental.gluon")
from dsflash.kernels import gluon_launch, triton_call  # noqa: E402

pytestmark = pytest.mark.gpu


def _probe():
    from dsflash.kernels.experimental import gluon_probe
    return gluon_probe


def test_elementwise_gluon_kernel_matches_jnp_beside_a_triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _neg(x_ptr, o_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + i, -tl.load(x_ptr + i))

    gp = _probe()
    jt = triton_call.jax_triton()
    x = jnp.linspace(-2.0, 2.0, 8192, dtype=jnp.float32)

    @jax.jit
    def f(v):
        y = jt.triton_call(v, kernel=gp.axpb_kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                           grid=(v.size // 1024,), a=0.75, BLOCK=1024)
        return jt.triton_call(y, kernel=_neg, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
                              grid=(v.size // 1024,), BLOCK=1024)

    np.testing.assert_allclose(np.asarray(f(x)), -(np.asarray(x) * 0.75 + 1.0), rtol=1e-6, atol=1e-6)
    assert gluon_launch.is_gluon(gp.axpb_kernel) and not gluon_launch.is_gluon(_neg)


@pytest.mark.parametrize("mnk", [(64, 64, 64), (256, 192, 512)])
def test_wgmma_gemm_tile_matches_jnp(mnk):
    m, n, k = mnk
    gp = _probe()
    jt = triton_call.jax_triton()
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(jnp.bfloat16)
    c = jax.jit(lambda a, b: jt.triton_call(
        a, b, m, n, k, kernel=gp.wgmma_gemm_kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // 64, n // 64), num_warps=4, BM=64, BN=64, BK=64))(a, b)
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    np.testing.assert_allclose(np.asarray(c), ref, rtol=2e-3, atol=2e-3 * np.sqrt(k))
