"""mHC: manifold-constrained hyper-connections with Sinkhorn, single-pass (delayed) wiring. SPEC §7.

The math is ``dsflash.kernels.mhc_fused`` (shared with the fused kernel). ``pre_mix`` / ``post_mix`` are the
fused sublayer-boundary ops with a backend switch; ``coefficients`` / ``collapse`` / ``expand`` are the pieces."""
from __future__ import annotations

from dsflash.config import ModelConfig
from dsflash.kernels import mhc_fused as mf
from dsflash.model.layers import act_dtype


def coefficients(X, fn, base, scale, cfg: ModelConfig):
    """H(X) for streams X [..., n, d] -> (pre [..., n], post [..., n], comb [..., n, n]) in fp32."""
    return mf.sinkhorn_coefficients(X, fn, base, scale, eps=cfg.hc_eps, rms_eps=cfg.rms_norm_eps,
                                    iters=cfg.hc_sinkhorn_iters)


def collapse(X, a, precision):
    """hc_pre: sum_c a[c] X[c] (fp32 accumulate)."""
    return mf.collapse(X, a, act_dtype(precision))


def expand(y, X, post, comb, precision):
    """hc_post: out[k] = post[k] y + sum_j comb[j, k] X[j]."""
    return mf.expand(y, X, post, comb, act_dtype(precision))


def _fused(X, a, fn, base, scale, cfg, precision, backend, ex):
    lead = X.shape[:-2]
    flat = lambda t: t.reshape(-1, *t.shape[len(lead):])  # noqa: E731
    ex = None if ex is None else tuple(flat(t) for t in ex)
    Xo, h, (pre, post, comb) = mf.mhc_fused(
        flat(X), flat(a), fn, base, scale, ex, eps=cfg.hc_eps, rms_eps=cfg.rms_norm_eps,
        iters=cfg.hc_sinkhorn_iters, out_dtype=act_dtype(precision), backend=backend)
    unflat = lambda t: t.reshape(*lead, *t.shape[1:])  # noqa: E731
    return unflat(Xo), unflat(h), (unflat(pre), unflat(post), unflat(comb))


def pre_mix(X, a, fn, base, scale, cfg: ModelConfig, precision, backend="auto"):
    """coefficients(X) and collapse(X, a) in one pass: (h [..., d], (pre, post, comb))."""
    _, h, coef = _fused(X, a, fn, base, scale, cfg, precision, backend, None)
    return h, coef


def post_mix(y, X, post, comb, a, fn, base, scale, cfg: ModelConfig, precision, backend="auto"):
    """X1 = expand(y, X, post, comb), then coefficients(X1) and collapse(X1, a) in the same pass:
    (X1, h [..., d], (pre, post, comb) of X1)."""
    return _fused(X, a, fn, base, scale, cfg, precision, backend, (y, post, comb))
