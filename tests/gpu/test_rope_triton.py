"""The in-place RoPE tail kernel (``kernels/rope_triton.py``) on the GPU: the bits of ``rope.rotate_tail``'s arithmetic
without FMA contraction (numpy fp32, then RNE to bf16), the head channels untouched, a caller that still holds the
input gets it unchanged (XLA copies where the buffer is still live), and the sparse attention front-end gives the
same output with ``ROPE_INPLACE`` on as with the XLA concatenation (up to the concatenation's own contraction)."""
import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dsflash.kernels import rope as rp  # noqa: E402

pytestmark = pytest.mark.gpu


def _case(B, S, H, D, rd, seed):
    x = (jax.random.normal(jax.random.PRNGKey(seed), (B, S, H, D), jnp.float32) * 3).astype(jnp.bfloat16)
    pos = jax.random.randint(jax.random.PRNGKey(seed + 1), (B, S), 0, 200000, jnp.int32)
    omega = (10000.0 ** (-2.0 * np.arange(rd // 2) / rd)).astype(np.float32)
    return x, rp.rope_table(pos, omega)


def _numpy_rotate(x, c, s, inverse):
    """rotate_tail in numpy fp32: every product and difference rounded on its own (no FMA), RNE to bf16."""
    x = np.asarray(x.astype(jnp.float32))
    c, s = np.asarray(c)[:, :, None], np.asarray(s)[:, :, None]
    s = -s if inverse else s
    rd = 2 * c.shape[-1]
    t = x[..., -rd:].reshape(*x.shape[:-1], rd // 2, 2)
    x0, x1 = t[..., 0], t[..., 1]
    r = np.stack([np.float32(x0 * c) - np.float32(x1 * s), np.float32(x0 * s) + np.float32(x1 * c)], -1)
    out = x.copy()
    out[..., -rd:] = r.reshape(*x.shape[:-1], rd).astype(ml_dtypes.bfloat16).astype(np.float32)
    return out


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(1, 4096, 64, 512, 64), (2, 3, 16, 128, 32)], ids=lambda s: "x".join(map(str, s)))
def test_inplace_tail_bits(shape, inverse):
    from dsflash.kernels import rope_triton as rt
    x, (c, s) = _case(*shape, seed=3)
    got = np.asarray(jax.jit(lambda a, b, d: rt.rope_tail_inplace(a, (b, d), inverse=inverse))(x, c, s)
                     .astype(jnp.float32))
    want = _numpy_rotate(x, c, s, inverse)
    diff = int((got.view(np.uint32) != want.view(np.uint32)).sum())
    print(f"{shape} inverse={inverse}: {diff} of {got.size} elements differ")
    assert diff == 0


def test_a_live_input_is_not_overwritten():
    from dsflash.kernels import rope_triton as rt
    x, rope = _case(2, 8, 64, 512, 64, seed=5)
    rotated, kept = jax.jit(lambda a, b, d: (rt.rope_tail_inplace(a, (b, d)), a + 0))(x, *rope)
    np.testing.assert_array_equal(np.asarray(kept.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)))
    assert not np.array_equal(np.asarray(rotated.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)))


def test_attention_front_end_inplace_matches_the_concatenation(monkeypatch):
    from dsflash.kernels import sparse_attention_triton as sat
    B, S, H, D, N, K = 1, 256, 64, 512, 900, 640
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
    kv = jax.random.normal(ks[1], (B, N, D), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(ks[2], (B, S, K), -1, N, jnp.int32)
    sink = jax.random.normal(ks[3], (H,), jnp.float32)
    _, rope = _case(B, S, H, D, 64, seed=9)
    outs = {}
    for inplace in (False, True):
        monkeypatch.setattr(sat, "ROPE_INPLACE", inplace)
        outs[inplace] = np.asarray(jax.jit(lambda *a: sat.sparse_sink_attention_triton(
            *a, D ** -0.5, rope=rope, rope_in_kernel=False))(q, kv, idx, sink).astype(jnp.float32))
    diff = int((outs[True] != outs[False]).sum())
    print(f"in place vs concatenation: {diff} of {outs[True].size} elements differ")
    assert diff <= outs[True].size // 1000
    np.testing.assert_allclose(outs[True], outs[False], rtol=2e-2, atol=2e-2)
