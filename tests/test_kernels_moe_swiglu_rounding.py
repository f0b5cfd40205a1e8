"""The routed experts' SwiGLU sees x W1^T and x W3^T rounded to the compute dtype (SPEC §12: an FP8/FP4 linear
accumulates in fp32 and outputs bf16; the official Expert runs ``self.w1(x).float()``), issue 18.

Element-level, against numpy, with inputs built so that every number is known exactly:
* x holds FP8-exact values (E4M3 codes x the block's pow2 scale), W1/W3 E2M1 values x pow2 scales, so every
  product has few bits and the fp32 sums are exact in any order (asserted); the sums themselves have up to ~17
  significant bits, so most are not bf16 values and their rounding matters.
* W1 has a bias column making every gate value 51..93: sigmoid(g) is exactly 1.0 in fp32 there, so SiLU(g) == g
  with no transcendental rounding, and the clamp limit is set out of the way (1000).
* W2 is the identity (d == I), so each expert's output row is h itself, after the roundings under test.
Expected: numpy (float64 sums, ml_dtypes bf16 / E4M3 roundings), the rounding points of SPEC §8 / §12.
"""
import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsflash.kernels import moe_gemm
from dsflash import quant

T, K, E, D = 24, 2, 4, 64          # I == D: W2 is the identity (tests/gpu/test_moe_gemm.py uses other sizes)
LIMIT = 1000.0
BF16 = ml_dtypes.bfloat16


def _bf16(v):
    return np.asarray(v, np.float32).astype(BF16).astype(np.float32)


def _e4m3_values(rng, n, lo_exp, hi_exp):
    """Random E4M3 values with exponents lo_exp..hi_exp (4 significant bits), random sign, ~1/8 zeros."""
    m = 1 + rng.integers(0, 8, n) / 8.0
    v = m * 2.0 ** rng.integers(lo_exp, hi_exp + 1, n) * rng.choice([-1.0, 1.0], n)
    return np.where(rng.random(n) < 0.125, 0.0, v)


def _mx(w):
    """A float weight [E, out, in] whose every 32-block is exactly E2M1 x its pow2 scale -> (packed, scales), checked
    to dequantise back to itself."""
    p, s = quant.quantize_mxfp4_weight(jnp.asarray(w, jnp.float32))
    back = np.asarray(quant.dequant_mxfp4_weight(p, s))
    np.testing.assert_array_equal(back, w)
    return p, s


def _problem(seed, T=T, E=E, D=D):
    """-> x [T, D] (float64 holding bf16 / FP8-exact values), idx [T, 2], weight [T, 2], W1, W3, W2 [E, D, D] float64;
    only the first 64 input columns are nonzero (the exactness bounds above do not depend on D)."""
    rng = np.random.default_rng(seed)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    # x: block 0 = [1.5, 0, ...] (the bias input), block 1 = E4M3 codes 32..448 (and 0) x 2^-9, one code pinned to
    # 448 so the block's FP8 scale is 2^-9 and the FP8 round trip is the identity
    x = np.zeros((T, D))
    x[:, 0] = 1.5
    x[:, 32:64] = _e4m3_values(rng, T * 32, 5, 8).reshape(T, 32) * 2.0 ** -9
    x[:, 32] = 448 * 2.0 ** -9
    # W1 rows: block 0 = [48, 0, ...] (bias 1.5 * 48 = 72), block 1 = E2M1 x 2^-3 with one +-6 pinning the scale;
    # W3 rows: block 0 zero, block 1 the same kind of values
    def block1():
        w = rng.choice(e2m1, (E, D, 32)) * rng.choice([-1.0, 1.0], (E, D, 32)) * 2.0 ** -3
        w[..., 7] = 6 * 2.0 ** -3 * rng.choice([-1.0, 1.0], (E, D))
        return w
    W1 = np.zeros((E, D, D))
    W1[..., 0] = 48.0
    W1[..., 32:64] = block1()
    W3 = np.zeros((E, D, D))
    W3[..., 32:64] = block1()
    W2 = np.broadcast_to(np.eye(D), (E, D, D)).copy()
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    weight = np.tile(np.array([1.0, 0.5], np.float32), (T, 1))                 # powers of two: exact products
    return x, idx, weight, W1, W3, W2


def _expected(x, idx, weight, W1, W3, precision):
    """numpy: per (token, slot) g = x W1^T, u = x W3^T (exact), the SPEC's roundings, h, summed over the slots."""
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            g = x[t] @ W1[e].T
            u = x[t] @ W3[e].T
            assert np.array_equal(g.astype(np.float32), g) and np.array_equal(u.astype(np.float32), u)
            assert np.all((g > 50) & (g < 100)) and np.all(np.abs(u) < LIMIT)
            g, u = g.astype(np.float32), u.astype(np.float32)
            if precision != "fp32":
                g, u = _bf16(g), _bf16(u)                  # the rounding under test
            h = g * u * weight[t, j]                       # silu(g) == g here; exact for bf16 g, u
            if precision != "fp32":
                h = _bf16(h)
            if precision == "reference":                   # FP8 E4M3 round trip per 32 (SPEC §12 formula)
                hb = h.reshape(-1, 32)
                a = np.maximum(np.abs(hb).max(-1, keepdims=True), np.float32(1e-4)) * np.float32(1 / 448)
                s = (2.0 ** np.ceil(np.log2(a.astype(np.float64)))).astype(np.float32)
                h = (np.clip(hb / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).reshape(-1)
            o = h if precision == "fp32" else _bf16(h)     # W2 = identity: o = h, rounded to the compute dtype
            out[t] = out[t] + o
    return out


@pytest.mark.parametrize("precision", ["bf16", "reference", "fp32"])
@pytest.mark.parametrize("jit", [True, False])
def test_routed_swiglu_sees_bf16_rounded_gate_and_up(precision, jit):
    x, idx, weight, W1, W3, W2 = _problem(0)
    dt = jnp.float32 if precision == "fp32" else jnp.bfloat16
    xj = jnp.asarray(x, dt)
    assert np.array_equal(np.asarray(xj, np.float64), x)
    if precision == "reference":
        assert np.array_equal(np.asarray(quant.fp8_roundtrip(xj, 32), np.float64), x)
    args = (xj, jnp.asarray(idx), jnp.asarray(weight), *_mx(W1), *_mx(W3), *_mx(W2))
    f = lambda *a: moe_gemm.routed_moe_reference(*a, limit=LIMIT, precision=precision)   # noqa: E731
    got = np.asarray((jax.jit(f) if jit else f)(*args))
    want = _expected(x, idx, weight, W1, W3, precision)
    if precision != "fp32":
        # the test can tell: without the rounding of g and u, h differs in most elements
        assert np.mean(want != _expected_unrounded(x, idx, weight, W1, W3, precision)) > (0.5 if precision == "bf16"
                                                                                            else 0.02)
    bad = got != want
    assert not bad.any(), (f"{bad.sum()} of {bad.size} elements differ", got[bad][:6], want[bad][:6])


def _expected_unrounded(x, idx, weight, W1, W3, precision):
    """The old (issue-18) rounding points: g, u straight from the fp32 accumulation into the SwiGLU."""
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            g = (x[t] @ W1[e].T).astype(np.float32)
            u = (x[t] @ W3[e].T).astype(np.float32)
            h = _bf16(g * u * weight[t, j])
            if precision == "reference":
                hb = h.reshape(-1, 32)
                a = np.maximum(np.abs(hb).max(-1, keepdims=True), np.float32(1e-4)) * np.float32(1 / 448)
                s = (2.0 ** np.ceil(np.log2(a.astype(np.float64)))).astype(np.float32)
                h = (np.clip(hb / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).reshape(-1)
            out[t] = out[t] + _bf16(h)
    return out
