"""mHC: manifold-constrained hyper-connections with Sinkhorn, single-pass (delayed) wiring. SPEC §7."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.config import ModelConfig
from dsflash.model.layers import act_dtype


def coefficients(X, fn, base, scale, cfg: ModelConfig):
    """H(X) for streams X [..., n, d] -> (pre [..., n], post [..., n], comb [..., n, n]) in fp32."""
    n = cfg.hc_mult
    eps = cfg.hc_eps
    v = X.astype(jnp.float32).reshape(*X.shape[:-2], -1)
    r = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    m = jnp.einsum("...k,mk->...m", v, fn, precision=jax.lax.Precision.HIGHEST) * r
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    M = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*m.shape[:-1], n, n)
    comb = jax.nn.softmax(M, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    # a loop, not an unrolled chain: 19 iterations x 2 sublayers x every block dominated compile time
    comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn, comb)
    return pre, post, comb


def collapse(X, a, precision):
    """hc_pre: sum_c a[c] X[c] (fp32 accumulate)."""
    return jnp.einsum("...c,...cd->...d", a, X.astype(jnp.float32)).astype(act_dtype(precision))


def expand(y, X, post, comb, precision):
    """hc_post: out[k] = post[k] y + sum_j comb[j, k] X[j]."""
    out = post[..., :, None] * y.astype(jnp.float32)[..., None, :] + jnp.einsum(
        "...jk,...jd->...kd", comb, X.astype(jnp.float32))
    return out.astype(act_dtype(precision))
