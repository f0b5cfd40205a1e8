"""Triton (jax-triton) fused mHC; same contract as ``mhc_fused.mhc_fused_reference``.

STATUS: checked against the reference in Triton's interpreter (``scripts/triton_interpret_mhc.py``).
First H200 run (2026-11-30, commit 199278b): SLOWER than the jitted XLA reference at every size (0.97 vs 0.32 ms
at 1 token, 6.81 vs 4.23 ms at 16384), so the model does not use it (NOTES.md). The GPU test's post-side
mismatch (6 % of bf16 h elements one ulp off) was the reference's expand einsum running in TF32 (JAX's DEFAULT
precision on the GPU), not this kernel: the reference now pins fp32 (HIGHEST). Not re-run on a GPU since.

Design: one program per BT tokens, one pass over d in chunks of BD:
* (expand) x = post[k] y + sum_j comb[j, k] X[j] in fp32, rounded to the output dtype and stored;
* h = sum_c a[c] x[c] stored per chunk (collapse needs no statistics);
* the coefficient logits m [BT, 2n+n^2] accumulate as one MMA per chunk, x [BT, n*BD] . fn_chunk^T, with fn padded
  to 32 rows by masking (3xTF32 on the GPU ~ fp32, IEEE fp32 in the interpreter), and sum(x^2) beside it;
* epilogue in registers: rsqrt scaling, sigmoids, softmax and the Sinkhorn iterations on [BT, n, n].
So X is read once (plus y), X1 and h written once; fn (2 MB at V4.1) is re-read from L2 by every program, which
is why BT tokens share a program. ``iters`` is a runtime loop bound.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16 -> fp32, round to nearest even, NaN kept NaN (the GPU's canonical NaN 0x7FFFFFFF would
    otherwise carry into the sign bit and come out as -0.0; seen in the indexer kernel on the H200)."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (u | 0x00400000) & 0xFFFF0000, rounded).to(tl.float32, bitcast=True)


@triton.jit
def _mhc_kernel(x_ptr, a_ptr, fn_ptr, base_ptr, scale_ptr, y_ptr, post_ptr, comb_ptr,
                xo_ptr, h_ptr, pre_o, post_o, comb_o,
                T: tl.constexpr, N: tl.constexpr, D: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr,
                EPS: tl.constexpr, RMS_EPS: tl.constexpr, ITERS: tl.constexpr, BT: tl.constexpr,
                BD: tl.constexpr, EXPAND: tl.constexpr, ROUND: tl.constexpr, IEEE: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    on = tl.arange(0, N)
    oe = tl.arange(0, BD)
    oj = tl.arange(0, NCP)
    a = tl.load(a_ptr + t[:, None] * N + on[None, :], mask=tm[:, None], other=0.0)
    if EXPAND:
        post_in = tl.load(post_ptr + t[:, None] * N + on[None, :], mask=tm[:, None], other=0.0)
    m = tl.zeros((BT, NCP), tl.float32)
    ss = tl.zeros((BT,), tl.float32)
    x3 = t[:, None, None] * (N * D) + on[None, :, None] * D + oe[None, None, :]       # [BT, N, BD] offsets
    m3 = tm[:, None, None] & (on[None, :, None] < N)
    for d0 in range(0, D, BD):
        if EXPAND:
            y = tl.load(y_ptr + t[:, None] * D + d0 + oe[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
            mix = tl.zeros((BT, N, BD), tl.float32)
            for j in tl.static_range(N):
                xj = tl.load(x_ptr + t[:, None] * (N * D) + j * D + d0 + oe[None, :], mask=tm[:, None],
                             other=0.0).to(tl.float32)
                cj = tl.load(comb_ptr + t[:, None] * (N * N) + j * N + on[None, :], mask=tm[:, None], other=0.0)
                mix += cj[:, :, None] * xj[:, None, :]
            x = post_in[:, :, None] * y[:, None, :] + mix          # the reference's association
            if ROUND:
                x = _bf16_rne(x)
            tl.store(xo_ptr + x3 + d0, x.to(xo_ptr.dtype.element_ty), mask=m3)
        else:
            x = tl.load(x_ptr + x3 + d0, mask=m3, other=0.0).to(tl.float32)
        ss += tl.sum(tl.sum(x * x, axis=2), axis=1)
        h = tl.sum(a[:, :, None] * x, axis=1)
        if ROUND:
            h = _bf16_rne(h)
        tl.store(h_ptr + t[:, None] * D + d0 + oe[None, :], h.to(h_ptr.dtype.element_ty), mask=tm[:, None])
        f = tl.load(fn_ptr + oj[:, None, None] * (N * D) + on[None, :, None] * D + d0 + oe[None, None, :],
                    mask=(oj < NC)[:, None, None] & (on[None, :, None] < N), other=0.0)
        xf = tl.reshape(x, (BT, N * BD))
        ff = tl.trans(tl.reshape(f, (NCP, N * BD)))
        if IEEE:
            m += tl.dot(xf, ff, input_precision="ieee")
        else:
            m += tl.dot(xf, ff, input_precision="tf32x3")
    r = 1.0 / tl.sqrt(ss / (N * D) + RMS_EPS)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    scl = tl.where(oj < N, s0, tl.where(oj < 2 * N, s1, s2))
    z = (m * r[:, None]) * scl[None, :] + tl.load(base_ptr + oj, mask=oj < NC, other=0.0)[None, :]
    z3 = tl.reshape(z, (BT, NCP // N, N))                 # group g: 0 pre, 1 post, 2 + a comb row a
    g = tl.arange(0, NCP // N)[None, :, None]
    pre = 1.0 / (1.0 + tl.exp(-tl.sum(tl.where(g == 0, z3, 0.0), axis=1))) + EPS
    post = 2.0 / (1.0 + tl.exp(-tl.sum(tl.where(g == 1, z3, 0.0), axis=1)))
    sel = tl.arange(0, NCP // N)[None, None, :, None] == 2 + on[None, :, None, None]
    M = tl.sum(tl.where(sel, z3[:, None, :, :], 0.0), axis=2)             # [BT, N(a), N(b)]
    e = tl.exp(M - tl.max(M, axis=2)[:, :, None])
    c = e / tl.sum(e, axis=2)[:, :, None] + EPS
    c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + EPS)
        c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
    tn = t[:, None] * N + on[None, :]
    tl.store(pre_o + tn, pre, mask=tm[:, None])
    tl.store(post_o + tn, post, mask=tm[:, None])
    tl.store(comb_o + t[:, None, None] * (N * N) + on[None, :, None] * N + on[None, None, :], c,
             mask=tm[:, None, None] & (on[None, :, None] < N))


def launch_params(T, n, d):
    BD = 64 if d % 64 == 0 else 32
    return dict(BT=16, BD=BD, NCP=max(16, triton.next_power_of_2(2 * n + n * n)))


def check_kernel_shapes(n, d, BD):
    if n & (n - 1) or d % BD:
        raise ValueError(f"the Triton mHC kernel needs a power-of-two stream count and d % {BD} == 0, "
                         f"got n={n}, d={d}")


def mhc_fused_triton(X, a, fn, base, scale, expand_args=None, *, eps, rms_eps, iters, out_dtype, block_t=None):
    import jax_triton as jt  # lazy: GPU only
    from dsflash.kernels.mhc_fused import check_shapes

    check_shapes(X, a, fn, base, scale, expand_args)
    T, n, d = X.shape
    prm = launch_params(T, n, d)
    if block_t:
        prm["BT"] = block_t
    check_kernel_shapes(n, d, prm["BD"])
    f32 = jnp.float32
    if expand_args is None:
        y, post, comb = jnp.zeros((1,), out_dtype), jnp.zeros((1,), f32), jnp.zeros((1,), f32)
    else:
        y, post, comb = expand_args
    xo_shape = (T, n, d) if expand_args is not None else (1,)   # unused without expand
    outs = (jax.ShapeDtypeStruct(xo_shape, out_dtype), jax.ShapeDtypeStruct((T, d), out_dtype),
            jax.ShapeDtypeStruct((T, n), f32), jax.ShapeDtypeStruct((T, n), f32),
            jax.ShapeDtypeStruct((T, n, n), f32))
    Xo, h, pre, post_o, comb_o = jt.triton_call(
        X, a.astype(f32), fn.astype(f32), base.astype(f32), scale.astype(f32), y.astype(out_dtype),
        post.astype(f32), comb.astype(f32),
        kernel=_mhc_kernel, out_shape=outs, grid=(triton.cdiv(T, prm["BT"]),), num_warps=4, num_stages=2,
        T=T, N=n, D=d, NC=2 * n + n * n, EPS=float(eps), RMS_EPS=float(rms_eps), ITERS=int(iters),
        EXPAND=int(expand_args is not None), ROUND=int(jnp.dtype(out_dtype) == jnp.bfloat16),
        IEEE=0, **prm)
    return (Xo if expand_args is not None else X), h, (pre, post_o, comb_o)
