"""Fused mHC: the reference vs the model's pieces (coefficients / collapse / expand), dispatch, shape errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.config import preset
from dsflash.kernels import mhc_fused as mf
from dsflash.model import mhc

CFG = preset("tiny")


def _inputs(lead=(2, 3), seed=0):
    n, d = CFG.hc_mult, CFG.hidden_size
    nc = 2 * n + n * n
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    X = jax.random.normal(ks[0], (*lead, n, d)).astype(jnp.bfloat16)
    a = jax.nn.sigmoid(jax.random.normal(ks[1], (*lead, n)))
    fn = jax.random.normal(ks[2], (nc, n * d)) * (n * d) ** -0.5
    base = jax.random.normal(ks[3], (nc,))
    scale = jnp.array([1.0, 0.5, 2.0], jnp.float32)
    y = jax.random.normal(ks[4], (*lead, d)).astype(jnp.bfloat16)
    return X, a, fn, base, scale, y


def _eq(x, y):
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), x, y)


@pytest.mark.parametrize("backend", ["xla", "triton"])   # triton on CPU = the reference
def test_fused_equals_model_pieces(backend):
    X, a, fn, base, scale, y = _inputs()
    prec = "reference"
    h, coef = mhc.pre_mix(X, a, fn, base, scale, CFG, prec, backend)
    _eq((h, coef), (mhc.collapse(X, a, prec), mhc.coefficients(X, fn, base, scale, CFG)))
    _, post, comb = coef
    X1, h1, coef1 = mhc.post_mix(y, X, post, comb, a, fn, base, scale, CFG, prec, backend)
    want_X1 = mhc.expand(y, X, post, comb, prec)
    _eq((X1, h1, coef1), (want_X1, mhc.collapse(want_X1, a, prec), mhc.coefficients(want_X1, fn, base, scale, CFG)))


def test_comb_is_doubly_stochastic():
    X, a, fn, base, scale, _ = _inputs()
    _, _, comb = mhc.coefficients(X, fn, base, scale, CFG)
    np.testing.assert_allclose(np.asarray(comb.sum(-1)), 1.0, atol=1e-2)  # tiny config: few Sinkhorn iterations
    np.testing.assert_allclose(np.asarray(comb.sum(-2)), 1.0, atol=1e-2)  # tiny config: few Sinkhorn iterations


def test_bad_backend_and_shapes():
    X, a, fn, base, scale, y = _inputs(lead=(5,))
    kw = dict(eps=1e-6, rms_eps=1e-20, iters=3, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="backend"):
        mf.mhc_fused(X, a, fn, base, scale, **kw, backend="cuda")
    for args in [(X[0], a, fn, base, scale), (X, a[:, :1], fn, base, scale), (X, a, fn[:, 1:], base, scale),
                 (X, a, fn, base[1:], scale), (X, a, fn, base, scale, (y[:, 1:], a, jnp.zeros((5, 4, 4))))]:
        with pytest.raises(ValueError):
            mf.mhc_fused(*args, **kw)


def test_model_keeps_mhc_on_xla():
    """The fused kernel was slower than XLA at every size on the H200 (NOTES.md): forward.py must keep calling the
    XLA pieces, never the fused ops that take a backend."""
    import importlib
    import inspect

    src = inspect.getsource(importlib.import_module("dsflash.model.forward"))
    assert "mhc.coefficients(" in src and "mhc.expand(" in src
    for name in ("pre_mix", "post_mix", "mhc_fused"):
        assert name not in src, f"forward.py calls {name}: re-time the mHC kernel first (NOTES.md, Fused mHC)"


def test_collapse_and_expand_pin_fp32_products():
    """DEFAULT precision is TF32 on recent GPUs; the reference's contractions ask for HIGHEST (fp32)."""
    X, a, fn, base, scale, y = _inputs(lead=(3,))
    n = X.shape[-2]
    comb = jnp.ones((3, n, n)) / n
    for jaxpr in (jax.make_jaxpr(lambda *t: mf.collapse(*t, jnp.bfloat16))(X, a),
                  jax.make_jaxpr(lambda *t: mf.expand(*t, jnp.bfloat16))(y, X, a, comb)):
        dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        assert dots and all("HIGHEST" in str(e.params["precision"]) for e in dots), dots
