"""RoPE rotates only the last 2 * len(omega) channels, pairs (2i, 2i + 1), and keeps the rest of x as it is.

(An in-place form, ``x.at[..., -rd:].set(rot)``, was tried in session 20 to save the concatenation's full read and
write of q and o: jax 0.10.2's CPU compiler ran it in place with the rotation reading already-rotated partners, and
tests/test_model_decode.py::test_fp32_decode_equals_prefill caught it; kernels/NOTES.md, session 20.)"""
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.model.layers import apply_rope


def _rope_numpy(x, pos, omega, inverse):
    """Pairs (2i, 2i+1) of the tail rotated by pos * omega_i (conjugate if inverse), in float64."""
    rd = 2 * len(omega)
    out = np.array(x, np.float64)
    ang = np.asarray(pos, np.float64)[..., None] * np.asarray(omega, np.float64)
    c, s = np.cos(ang), np.sin(ang) * (-1.0 if inverse else 1.0)
    x0, x1 = out[..., -rd::2].copy(), out[..., -rd + 1::2].copy()
    out[..., -rd::2] = x0 * c - x1 * s
    out[..., -rd + 1::2] = x0 * s + x1 * c
    return out


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotates_the_tail_pairs_and_keeps_the_head(inverse):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 24)).astype(np.float32)
    pos = np.arange(5)[:, None] + 7
    omega = np.array([1.0, 0.1, 0.01], np.float32)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), omega, inverse=inverse))
    np.testing.assert_array_equal(got[..., :-6], x[..., :-6])
    np.testing.assert_allclose(got, _rope_numpy(x, pos, omega, inverse), rtol=1e-5, atol=1e-5)
