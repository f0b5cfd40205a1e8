"""``moe_gemm.grouped_dot``, the grouped product of the XLA MoE reference: on CPU blocks of 8 rows per group and one
batched matmul (XLA's CPU ``ragged_dot`` multiplies every row by every group), elsewhere ``lax.ragged_dot``. The
CPU path must give ``ragged_dot``'s result (to fp32 accumulation order), rows past the last group (EP's non-local
slots) and empty groups included, and a row's result must not depend on the other rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.kernels import moe_gemm


@pytest.mark.parametrize("M,G,K,N,dtype,cut", [
    (16, 8, 256, 128, jnp.bfloat16, 0),     # demo decode: 8 tokens x top-2
    (96, 8, 128, 256, jnp.bfloat16, 0),     # demo verification rows, the down projection's shape
    (37, 5, 64, 48, jnp.float32, 0),        # fp32 precision, odd sizes
    (40, 6, 64, 32, jnp.bfloat16, 11),      # the last 11 rows belong to no group (EP: non-local slots)
])
def test_cpu_path_equals_ragged_dot(M, G, K, N, dtype, cut):
    rng = np.random.default_rng(M + G)
    xs = jnp.asarray(rng.normal(size=(M, K)), dtype)
    w = jnp.asarray(rng.normal(size=(G, K, N)), dtype)
    ids = np.sort(rng.integers(0, G, size=M - cut))
    ids[ids == 1] = 2                                                   # group 1 empty
    gs = jnp.asarray(np.bincount(ids, minlength=G), jnp.int32)
    got = jax.jit(moe_gemm.grouped_dot)(xs, w, gs)
    want = jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, b, c, preferred_element_type=jnp.float32))(xs, w, gs)
    assert got.dtype == jnp.float32 and got.shape == (M, N)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    if cut:
        assert not np.asarray(got[-cut:]).any()
    # and it is the grouped product, not some other one
    ref = np.concatenate([np.asarray(xs[i:i + 1], np.float32) @ np.asarray(w[g], np.float32)
                          for i, g in enumerate(ids)] + [np.zeros((cut, N), np.float32)])
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    """Decode (8 rows), verification (48) and prefill rows of one sequence see the same MoE numbers."""
    rng = np.random.default_rng(5)
    M, G, K, N = 256, 8, 256, 128
    xs = jnp.asarray(rng.normal(size=(M, K)), dtype)
    w = jnp.asarray(rng.normal(size=(G, K, N)), dtype)
    ids = np.sort(rng.integers(0, G, size=M))
    gd = jax.jit(moe_gemm.grouped_dot)
    full = np.asarray(gd(xs, w, jnp.asarray(np.bincount(ids, minlength=G), jnp.int32)))
    for step in (2, 3, 7, 50):
        sel = np.arange(0, M, step)
        part = np.asarray(gd(xs[sel], w, jnp.asarray(np.bincount(ids[sel], minlength=G), jnp.int32)))
        np.testing.assert_array_equal(part, full[sel])


def test_large_products_fall_back_to_ragged_dot(monkeypatch):
    """Above the gathered weights' byte cap the CPU path is not taken (same result either way)."""
    monkeypatch.setattr(moe_gemm, "_CPU_MAX_GATHER_BYTES", 0)
    seen = []
    real = jax.lax.ragged_dot
    monkeypatch.setattr(jax.lax, "ragged_dot", lambda *a, **k: seen.append(1) or real(*a, **k))
    xs = jnp.ones((8, 16), jnp.float32)
    w = jnp.ones((2, 16, 4), jnp.float32)
    out = moe_gemm.grouped_dot(xs, w, jnp.asarray([5, 3], jnp.int32))
    assert seen and np.asarray(out).tolist() == [[16.0] * 4] * 8
