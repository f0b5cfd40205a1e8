"""Fused mHC (SPEC_V41 §7): one pass over a token's streams does what the delayed wiring needs at a sublayer
boundary. The model's mHC math lives here so ``dsflash.model.mhc`` and the kernel share one definition.

``mhc_fused(X, a, fn, base, scale, expand=None, *, eps, rms_eps, iters, out_dtype, backend)``
  X       [T, n, d]   residual streams (activation dtype)
  a       [T, n]      fp32 pre-mix for the collapse (delayed wiring: the previous boundary's ``pre``)
  fn      [2n + n*n, n*d] fp32, base [2n + n*n] fp32, scale [3] fp32: the coefficient generator
  expand  None, or (y [T, d], post [T, n], comb [T, n, n]): first X <- hc_post(y, X, post, comb) in out_dtype
  -> (X [T, n, d] (the expanded streams, or the input), h = hc_pre(X, a) [T, d] out_dtype,
      (pre [T, n], post [T, n], comb [T, n, n]) = H(X) in fp32)
Leading dims other than T are flattened by the caller (``dsflash.model.mhc``).

Numerics: H(X): v = X (fp32), r = rsqrt(mean(v^2) + rms_eps), m = (v . fn^T) * r with fp32 products (HIGHEST),
pre = sigmoid(m*s0 + b) + eps, post = 2 sigmoid(m*s1 + b), comb = softmax_b(M) + eps, columns normalised, then
``iters - 1`` row / column normalisations (each x / (sum + eps)). Collapse and expand accumulate in fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.kernels import dispatch


# fp32 products for the collapse / expand contractions. Without it JAX's DEFAULT precision runs an fp32 einsum in
# TF32 on recent GPUs (comb rounded to 10 mantissa bits, ~2^-11 relative): on the H200 (2026-11-30) the expand
# then differed from fp32 math in one bf16 ulp on ~6 % of elements (rel 8.6e-4; reproduced on CPU by rounding comb
# to TF32: 6.1 %, 8.5e-4). No effect on CPU (fp32 there already).
_F32 = jax.lax.Precision.HIGHEST


def sinkhorn_coefficients(X, fn, base, scale, *, eps, rms_eps, iters):
    """H(X) for streams X [..., n, d] -> (pre [..., n], post [..., n], comb [..., n, n]) in fp32."""
    n = X.shape[-2]
    v = X.astype(jnp.float32).reshape(*X.shape[:-2], -1)
    r = jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + rms_eps)
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
    comb = jax.lax.fori_loop(0, iters - 1, sinkhorn, comb)
    return pre, post, comb


def collapse(X, a, out_dtype):
    """hc_pre: sum_c a[c] X[c] (fp32 accumulate)."""
    return jnp.einsum("...c,...cd->...d", a, X.astype(jnp.float32), precision=_F32).astype(out_dtype)


def expand(y, X, post, comb, out_dtype):
    """hc_post: out[k] = post[k] y + sum_j comb[j, k] X[j]."""
    out = post[..., :, None] * y.astype(jnp.float32)[..., None, :] + jnp.einsum(
        "...jk,...jd->...kd", comb, X.astype(jnp.float32), precision=_F32)
    return out.astype(out_dtype)


def check_shapes(X, a, fn, base, scale, expand):
    if X.ndim != 3:
        raise ValueError(f"X must be [T, n, d], got {X.shape}")
    T, n, d = X.shape
    nc = 2 * n + n * n
    if a.shape != (T, n):
        raise ValueError(f"a must be [T={T}, n={n}], got {a.shape}")
    if fn.shape != (nc, n * d) or base.shape != (nc,) or scale.shape != (3,):
        raise ValueError(f"fn/base/scale must be [{nc}, {n * d}] / [{nc}] / [3], got {fn.shape} / {base.shape} / "
                         f"{scale.shape}")
    if expand is not None:
        y, post, comb = expand
        if y.shape != (T, d) or post.shape != (T, n) or comb.shape != (T, n, n):
            raise ValueError(f"expand must be (y [T={T}, d={d}], post [T, n={n}], comb [T, n, n]), got "
                             f"{y.shape}, {post.shape}, {comb.shape}")


def mhc_fused_reference(X, a, fn, base, scale, expand_args=None, *, eps, rms_eps, iters, out_dtype):
    check_shapes(X, a, fn, base, scale, expand_args)
    if expand_args is not None:
        X = expand(*expand_args[:1], X, *expand_args[1:], out_dtype)
    return X, collapse(X, a, out_dtype), sinkhorn_coefficients(X, fn, base, scale, eps=eps, rms_eps=rms_eps,
                                                               iters=iters)


# ------------------------------------------------------------------------------------------ kernel plan
# The Triton kernel (``mhc_fused_triton``, its docstring has the byte / flop reasoning) runs as two launches:
# A over (token blocks of BT) x (DS contiguous d ranges of d / DS, walked in BD-wide chunks) writing partial logits
# and partial sums of squares, then B over token blocks of BTE summing the DS partials (groups of SB) and running
# the epilogue. ``kernel_plan`` picks the blocking from the shape alone (pure Python, tested on CPU).
SMS = 132                    # streaming multiprocessors of the H200 the constants were chosen for
MIN_PROGRAMS = SMS           # kernel A programs wanted at least: one per SM (small T is latency-bound)
TARGET_PROGRAMS = 2 * SMS    # preferred: two per SM
TILE_CAP = 2048              # elements of kernel A's per-stream [BT, BD] tile: <= 8 a thread (warps = BT*BD / 256)
EPI_TILE_CAP = 4096          # elements of kernel B's [SB, BTE, NCP] partials tile (32 a thread at 4 warps)
PARTIAL_X_FRAC = 1 / 16      # partial bytes at most this fraction of X's bytes ...
PARTIAL_FLOOR = 8 << 20      # ... or of this many bytes (small T: everything stays in L2)
BD_CHOICES = (128, 64, 32)


def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(v):
    return 1 << max(0, int(v) - 1).bit_length()


def partial_bytes(T, DS, NCP):
    """Bytes of kernel A's partials (logits [DS, T, NCP] + sums of squares [DS, T], fp32), written once, read once."""
    return DS * T * (NCP + 1) * 4


def kernel_plan(T, n, d):
    """Blocking of the Triton kernel for T tokens, n streams of width d: dict with
    BT (tokens a kernel-A program), BD (d chunk), DS (d splits; d / DS is a multiple of BD), NCP (logit columns,
    padded to a power of two >= 16), BTE / SB (kernel B: tokens a program, partials summed per step), programs
    (kernel A's grid size), num_warps (kernel A).
    Rules: BT 16 / 32 / 64 for T <= 128 / <= 2048 / larger (MMA rows; fn is re-read once per token block). Then
    among BD in BD_CHOICES with BT*BD <= TILE_CAP and DS dividing d / BD, with partial bytes within
    max(PARTIAL_X_FRAC * X bytes, PARTIAL_FLOOR): the fewest splits reaching TARGET_PROGRAMS with BD >= 64 (or the
    widest BD allowed, if narrower; largest BD first), else the fewest reaching MIN_PROGRAMS (largest BD first), else
    the most programs."""
    if T < 1 or n < 1 or n & (n - 1) or d % BD_CHOICES[-1]:
        raise ValueError(f"the Triton mHC kernel needs T >= 1, a power-of-two stream count and d % "
                         f"{BD_CHOICES[-1]} == 0, got T={T}, n={n}, d={d}")
    NCP = max(16, _next_pow2(2 * n + n * n))
    BT = 16 if T <= 128 else 32 if T <= 2048 else 64
    tb = _cdiv(T, BT)
    cap = max(PARTIAL_X_FRAC * T * n * d * 2, PARTIAL_FLOOR)
    cands = []                                   # (BD, DS): BD descending, DS ascending
    for BD in BD_CHOICES:
        if d % BD or (BT * BD > TILE_CAP and BD != BD_CHOICES[-1]):
            continue
        chunks = d // BD
        cands += [(BD, DS) for DS in range(1, chunks + 1)
                  if chunks % DS == 0 and (DS == 1 or partial_bytes(T, DS, NCP) <= cap)]
    wide = min(64, max(c[0] for c in cands))        # one-chunk BD-32 splits only where nothing wider fits
    pick = (next((c for c in cands if c[0] >= wide and tb * c[1] >= TARGET_PROGRAMS), None)
            or next((c for c in cands if tb * c[1] >= MIN_PROGRAMS), None)
            or max(cands, key=lambda c: (c[1], c[0])))      # the most programs (splits), then the widest BD
    BD, DS = pick
    BTE = 16 if T <= 2048 else 32
    return dict(BT=BT, BD=BD, DS=DS, NCP=NCP, BTE=BTE, SB=min(_next_pow2(DS), max(1, EPI_TILE_CAP // (BTE * NCP))),
                programs=tb * DS, num_warps=num_warps(BT, BD))


def num_warps(BT, BD):
    """Kernel A's warps: 8 tile elements a thread (an sm_90 compile of the kernel spilled at 16), 4 to 8 warps."""
    return max(4, min(8, BT * BD // 256))


def check_plan(p, n, d):
    """Raise ValueError unless plan ``p`` (kernel_plan's keys, e.g. with overrides) fits the kernels."""
    pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731
    if not all(pow2(p[k]) for k in ("BT", "BD", "NCP", "BTE", "SB")) or min(p["BT"], p["BTE"]) < 16:
        raise ValueError(f"BT, BD, NCP, BTE, SB must be powers of two (BT, BTE >= 16), got {p}")
    if p["NCP"] < 2 * n + n * n or p["BD"] < 16 or p["DS"] < 1 or d % (p["DS"] * p["BD"]):
        raise ValueError(f"plan {p} does not fit n={n}, d={d}: need NCP >= 2n+n^2, BD >= 16, "
                         f"d % (DS*BD) == 0")


def mhc_fused(X, a, fn, base, scale, expand_args=None, *, eps, rms_eps, iters, out_dtype, backend="auto",
              force=False):
    """The reference or the Triton kernel, as ``dispatch.use_triton("mhc", ...)`` decides at T tokens (the kernel
    on a GPU at every size today; ``force``: at any size whatever the table says, for tests and the bench)."""
    kw = dict(eps=eps, rms_eps=rms_eps, iters=iters, out_dtype=out_dtype)
    if not dispatch.use_triton("mhc", backend, X.shape[0], force=force):
        return mhc_fused_reference(X, a, fn, base, scale, expand_args, **kw)
    from dsflash.kernels import mhc_fused_triton  # lazy: needs a CUDA GPU and jax-triton
    return mhc_fused_triton.mhc_fused_triton(X, a, fn, base, scale, expand_args, **kw)
