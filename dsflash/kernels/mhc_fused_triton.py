"""Triton (jax-triton) fused mHC; same contract as ``mhc_fused.mhc_fused_reference``.

STATUS: split-d redesign (an XLA fn pack + two launches). On one H200 (2026-11-30, commit 4ae4c64) it passes
tests/gpu/test_mhc.py (X1 / h within the one-ulp band, 0 elements off at V4.1 shapes; coefficients rel err
<= 5.5e-6; split vs unsplit X1 / h bit-identical) and beats the jitted XLA reference at every measured size:
0.099 / 0.079 / 0.085 / 0.104 / 0.586 / 1.851 ms at 1 / 16 / 64 / 256 / 4096 / 16384 tokens against 0.318 /
0.395 / 0.423 / 0.305 / 1.207 / 4.316 (2.1-5.0x; still 1-33 % of the roofline). The first design (one program
per 16 tokens walking all of d) was slower than XLA everywhere (0.97 vs 0.32 ms at 1 token); its sm_90 compile
spills (255 registers, 2.4 KB with expand). The model runs it through ``mhc.pre_mix`` / ``post_mix`` at every size
since 2026-12-01 (``GATES["mhc"]`` in kernels/dispatch.py; the end-to-end check that decided it is in the note
beside that table).

Design (blocking from ``mhc_fused.kernel_plan``):
* ``pack_fn`` (XLA, once a call): fn [NC, n*d] fp32 -> [parts, d/BD, n*BD, NCP], zero-padded to NCP columns, so
  each (chunk, stream) slice is a contiguous [BD, NCP] MMA operand tile (loads feed ``tl.dot`` directly, no masks).
* kernel A, grid (cdiv(T, BT), DS): BT tokens x one contiguous d range of d / DS, walked in BD-wide chunks, one
  stream's [BT, BD] tile at a time: (expand) x_c = post[c] y + sum_j comb[j, c] X_j in fp32, rounded to the output
  dtype and stored; h += a[c] x_c (stored per chunk); partial logits m += x_c . fn[chunk, c] (MMA, K split by
  stream); partial sum(x^2). Collapse and expand are exact per element, so splitting d leaves X1 and h bit-for-bit
  as they were (the interpreter script checks split vs unsplit); only the logits' fp32 summation order changes.
* kernel B, grid (cdiv(T, BTE),): sums the DS partials (SB splits a step, the steps in order: a fixed order),
  then rsqrt scaling, sigmoids, softmax and ``iters - 1`` Sinkhorn steps on [BTE, n, n] in registers. Below
  ``mhc_fused_plan.EPI_ROWS_BELOW`` tokens (512) one program a token (BTE 1) sums all DS partials
  in one step.
* logits: x is bf16-exact whenever the streams are bf16 (a bf16 X, or X1 rounded to bf16), so fn = hi + lo with
  both parts bf16 (RNE) and x . fn = 2 (``fn_terms``) bf16 MMAs with exact fp32 products: fn kept to ~16 bits, logit
  rel err ~2.6e-6 at V4.1 size on random data (band 1e-4; fn_terms=3 gives fp32 level). One bf16 MMA costs half
  a TF32 one, so 2 terms cost 1/3 of 3xTF32; non-bf16 streams keep 3xTF32.
* registers (sm_90 compile, ptxas -v): 2D per-stream tiles only -- 3D [BT, n, BD] tiles made the compiler recompute
  the expand once per consumer layout (store, collapse, MMA operand); an opaque register move in front of the MMA
  stops the operand layout from being pushed back through the expand; <= 8 tile elements a thread (spills at 16).
  Kernel A: 64 / 96 / 168 / 200 / 160 registers at the 1 / 64 / 128 / 256 / >= 2049-token plans, kernel B <= 167.

Bytes / flops (V4.1: n=4, d=5120, 24 logits padded to NCP=32, fn 24 x 20480 fp32 = 1.97 MB). Per token: X 40 KiB
read (bf16), X1 40 KiB written (expand), y and h 10 KiB each; logits 2*24*20480 ~ 1 MFLOP -> ~10 flop/byte, far
below the H200's ridge: memory-bound at large T (16384 tokens: ~1.6 GB, ~0.35 ms at 4.8 TB/s), latency-bound at
small T (fn's 2 MB is ~0.4 us of DRAM time; launches, serial chunk loops and the 20-step Sinkhorn dominate).
* Programs: cdiv(T, BT) * DS. The old kernel ran <= 16 programs at <= 256 tokens, each walking 80 chunks; the plan
  puts >= 132 (one per SM; 264 preferred) programs on the GPU where the shape allows, 1-2 chunks each at <= 256
  tokens (T=1: 160 programs of one 32-wide chunk).
* fn traffic: every token block reads all of the packed fn once (2 bf16 parts: 2.6 MB), cdiv(T, BT) times from L2
  whatever DS; per program packed-fn / X bytes = NCP*2*2 / (BT*2) = 64 / BT, hence BT = 64 at large T (1.0).
* Partials: DS * T * (NCP + 1) * 4 bytes written by A and read by B (132 B per token per split vs 40 KiB of X):
  < 3 % of X at >= 1024 tokens; at small T <= 1.4 MB, L2-resident.
* Kernel B's loop has ceil(DS / SB) steps (20 at T <= 16, V4.1: one program of 16 tokens, 26 us a launch in session
  28's 1 x 6 step; 1 below ``EPI_ROWS_BELOW``, one program a token: the default since session 29); its per-token work is tiny.
``iters`` is a compile-time loop bound (one compile per value), as before.
X1 / h are rounded to bf16 by ``triton_common._bf16_round``: the integer RNE, or with the plan's ``hw_round`` (from
512 tokens, ``mhc_fused_plan.NARROW_FROM``) the hardware convert with the same bits; off when interpreted.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.mhc_fused_plan import EPI_WARPS, check_plan, check_shapes, kernel_plan, num_warps
from dsflash.kernels.triton_common import _bf16_round

# DOT modes of kernel A's logit MMA
DOT_IEEE, DOT_TF32X3, DOT_BF16_SPLIT, DOT_SPLIT_EMULATED = 0, 1, 2, 3


@triton.jit
def _logit_mma(acc, x, fp_ptr, koff, PART: tl.constexpr, DOT: tl.constexpr, TERMS: tl.constexpr):
    """acc [BT, NCP] += x [BT, BD] (fp32 tile) . fn tile [BD, NCP] (``pack_fn``'s layout: TERMS parts PART apart).
    DOT_BF16_SPLIT: x is bf16-exact, the parts are bf16 (hi, lo[, lo2]); one bf16 MMA a part, fp32 accumulation,
    exact products. DOT_SPLIT_EMULATED: the same part values stored as fp32, IEEE dots (the interpreter cannot dot
    bf16 operands). DOT_IEEE / DOT_TF32X3: one fp32 part."""
    if DOT == 1 or DOT == 2:
        # an opaque identity (a register move; GPU paths only): Triton otherwise pushes the MMA operand layout back
        # through every elementwise op up to the loads, computing the expand a second time in that layout (sm_90
        # compile: 255 registers + spills at BT16 BD64; 3xTF32 with expand: 7.6 KB spilled)
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    if DOT == 2:
        xb = x.to(tl.bfloat16)
        for p in tl.static_range(TERMS):
            acc = tl.dot(xb, tl.load(fp_ptr + p * PART + koff), acc)
    elif DOT == 3:
        for p in tl.static_range(TERMS):
            acc = tl.dot(x, tl.load(fp_ptr + p * PART + koff), acc, input_precision="ieee")
    elif DOT == 1:
        acc = tl.dot(x, tl.load(fp_ptr + koff), acc, input_precision="tf32x3")
    else:
        acc = tl.dot(x, tl.load(fp_ptr + koff), acc, input_precision="ieee")
    return acc


@triton.jit
def _mhc_split_kernel(x_ptr, a_ptr, fp_ptr, y_ptr, post_ptr, comb_ptr,
                      xo_ptr, h_ptr, mp_ptr, ssp_ptr,
                      T: tl.constexpr, N: tl.constexpr, D: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr,
                      DCH: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, EXPAND: tl.constexpr,
                      ROUND: tl.constexpr, HW_ROUND: tl.constexpr, DOT: tl.constexpr, TERMS: tl.constexpr):
    """Kernel A: tokens [pid0*BT, +BT) x d range [pid1*DCH, +DCH): X1 / h stored, partial logits / sum(x^2).
    Everything is a 2D [BT, BD] tile of one stream (no 3D tiles, no reshapes: with them the compiler recomputed
    the expand once per consumer layout and spilled); the logit MMA's K is split by stream, stream c of a chunk
    being a contiguous [BD, NCP] tile of the packed fn."""
    t0 = tl.program_id(0).to(tl.int64) * BT                          # int64 bases, int32 tile offsets
    s = tl.program_id(1)
    lt = tl.arange(0, BT)
    tm = t0 + lt < T
    tm2 = tm[:, None]
    oe = tl.arange(0, BD)
    oj = tl.arange(0, NCP)
    d_lo = s * DCH
    xt = lt[:, None] * (N * D) + oe[None, :]                         # [BT, BD], stream 0
    ht = lt[:, None] * D + oe[None, :]
    koff = oe[:, None] * NCP + oj[None, :]                           # [BD, NCP], stream 0's part of a chunk
    xb = x_ptr + t0 * (N * D) + d_lo
    hb = h_ptr + t0 * D + d_lo
    fb = fp_ptr + (d_lo // BD) * (N * BD * NCP)
    tr = t0 + lt
    a_c = ()
    for c in tl.static_range(N):
        a_c = a_c + (tl.load(a_ptr + tr * N + c, mask=tm, other=0.0),)
    if EXPAND:
        yb = y_ptr + t0 * D + d_lo
        ob = xo_ptr + t0 * (N * D) + d_lo
        post_c = ()
        comb_jc = ()                                                   # index j * N + c
        for c in tl.static_range(N):
            post_c = post_c + (tl.load(post_ptr + tr * N + c, mask=tm, other=0.0),)
        for jc in tl.static_range(N * N):
            comb_jc = comb_jc + (tl.load(comb_ptr + tr * (N * N) + jc, mask=tm, other=0.0),)
    m = tl.zeros((BT, NCP), tl.float32)
    sq = tl.zeros((BT, BD), tl.float32)
    for i in range(0, DCH // BD):                                   # constexpr trip count
        d0 = i * BD
        xs = ()
        for j in tl.static_range(N):
            xs = xs + (tl.load(xb + d0 + j * D + xt, mask=tm2, other=0.0).to(tl.float32),)
        if EXPAND:
            y = tl.load(yb + d0 + ht, mask=tm2, other=0.0).to(tl.float32)
        h = tl.zeros((BT, BD), tl.float32)
        for c in tl.static_range(N):
            if EXPAND:
                mix = comb_jc[c][:, None] * xs[0]
                for j in tl.static_range(1, N):
                    mix += comb_jc[j * N + c][:, None] * xs[j]
                x = post_c[c][:, None] * y + mix                      # the reference's association
                if ROUND:
                    x = _bf16_round(x, HW_ROUND)
                tl.store(ob + d0 + c * D + xt, x.to(xo_ptr.dtype.element_ty), mask=tm2)
            else:
                x = xs[c]
            sq += x * x
            h += a_c[c][:, None] * x
            m = _logit_mma(m, x, fb + i * (N * BD * NCP) + c * (BD * NCP), koff, N * D * NCP, DOT, TERMS)
        if ROUND:
            h = _bf16_round(h, HW_ROUND)
        tl.store(hb + d0 + ht, h.to(h_ptr.dtype.element_ty), mask=tm2)
    row = s * T + tr                                                 # partials are [DS, T, NCP] and [DS, T]
    tl.store(mp_ptr + row[:, None] * NCP + oj[None, :], m, mask=tm2)
    tl.store(ssp_ptr + row, tl.sum(sq, axis=1), mask=tm)


@triton.jit
def _mhc_epilogue_kernel(mp_ptr, ssp_ptr, base_ptr, scale_ptr, pre_o, post_o, comb_o,
                         T: tl.constexpr, N: tl.constexpr, D: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr,
                         DS: tl.constexpr, SB: tl.constexpr, BT: tl.constexpr,
                         EPS: tl.constexpr, RMS_EPS: tl.constexpr, ITERS: tl.constexpr):
    """Kernel B: sum the DS partials of BT tokens (SB splits a step, steps in order), then the coefficients."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    on = tl.arange(0, N)
    oj = tl.arange(0, NCP)
    osb = tl.arange(0, SB)
    m = tl.zeros((BT, NCP), tl.float32)
    ss = tl.zeros((BT,), tl.float32)
    for k0 in range(0, DS, SB):
        sp = k0 + osb
        rows = sp[:, None] * T + t[None, :]                          # [SB, BT]
        rm = (sp < DS)[:, None] & tm[None, :]
        m += tl.sum(tl.load(mp_ptr + rows[:, :, None] * NCP + oj[None, None, :], mask=rm[:, :, None], other=0.0),
                    axis=0)
        ss += tl.sum(tl.load(ssp_ptr + rows, mask=rm, other=0.0), axis=0)
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


def pack_fn(fn, n, d, BD, NCP, dot, terms):
    """fn [NC, n*d] fp32 -> the kernel's layout [parts, d/BD, n*BD, NCP]: chunk i's [n*BD, NCP] tile contiguous
    (K index c*BD + e <-> fn column c*d + i*BD + e), rows NC..NCP-1 zero. DOT_BF16_SPLIT: ``terms`` bf16 parts
    hi = bf16(fn), lo = bf16(fn - hi)[, bf16(fn - hi - lo)] (XLA's convert: round to nearest even);
    DOT_SPLIT_EMULATED: the same values as fp32; otherwise one fp32 part. One small XLA op a call (2 MB in,
    2.6 MB a part out at V4.1); a model could cache it per parameter."""
    nc = fn.shape[0]
    f = jnp.pad(fn.astype(jnp.float32), ((0, NCP - nc), (0, 0)))
    f = f.reshape(NCP, n, d // BD, BD).transpose(2, 1, 3, 0).reshape(d // BD, n * BD, NCP)
    if dot not in (DOT_BF16_SPLIT, DOT_SPLIT_EMULATED):
        return f[None]
    parts, r = [], f
    for _ in range(terms):
        p = r.astype(jnp.bfloat16)
        parts.append(p)
        r = r - p.astype(jnp.float32)
    out = jnp.stack(parts)
    return out if dot == DOT_BF16_SPLIT else out.astype(jnp.float32)


def launch_config(T, n, d, *, expand, x_dtype, out_dtype, eps, rms_eps, iters, plan=None, interpret=False,
                  fn_terms=2):
    """(plan, (grid_a, constexprs_a), (grid_b, constexprs_b)) for both launches; shared by the jax-triton wrapper
    and the interpreter script so both run the same configuration. ``plan``: overrides of ``kernel_plan``'s keys."""
    p = dict(kernel_plan(T, n, d), **(plan or {}))
    check_plan(p, n, d)
    p["programs"] = triton.cdiv(T, p["BT"]) * p["DS"]
    if "num_warps" not in (plan or {}):
        p["num_warps"] = num_warps(p["BT"], p["BD"])
    if fn_terms not in (2, 3):
        raise ValueError(f"fn_terms must be 2 or 3, got {fn_terms}")
    bf16 = jnp.dtype(jnp.bfloat16)
    bf16_exact = jnp.dtype(out_dtype if expand else x_dtype) == bf16      # x as the logit MMA sees it
    if bf16_exact:
        dot = DOT_SPLIT_EMULATED if interpret else DOT_BF16_SPLIT
    else:
        dot = DOT_IEEE if interpret else DOT_TF32X3
    nc = 2 * n + n * n
    common = dict(T=T, N=n, D=d, NC=nc, NCP=p["NCP"])
    hw_round = p.get("hw_round", 0)
    if hw_round and interpret:
        if "hw_round" in (plan or {}):
            raise ValueError("plan hw_round=1 needs the GPU's cvt.rn.bf16.f32: Triton's interpreter truncates fp32 -> "
                             "bf16 casts, so it cannot run (or check) the hardware-rounding path")
        hw_round = 0        # kernel_plan's choice: the integer rounding gives the same bits, and runs interpreted
    a_kw = dict(common, DCH=d // p["DS"], BT=p["BT"], BD=p["BD"], EXPAND=int(bool(expand)),
                ROUND=int(jnp.dtype(out_dtype) == bf16), HW_ROUND=int(hw_round), DOT=dot,
                TERMS=fn_terms if bf16_exact else 1)
    b_kw = dict(common, DS=p["DS"], SB=p["SB"], BT=p["BTE"], EPS=float(eps), RMS_EPS=float(rms_eps),
                ITERS=int(iters))
    return p, ((triton.cdiv(T, p["BT"]), p["DS"]), a_kw), ((triton.cdiv(T, p["BTE"]),), b_kw)


def mhc_fused_triton(X, a, fn, base, scale, expand_args=None, *, eps, rms_eps, iters, out_dtype, plan=None,
                     fn_terms=2):
    """The two launches (and ``pack_fn``). ``plan``: optional overrides of ``mhc_fused.kernel_plan`` (e.g.
    ``{"BT": 32}`` for a sweep); ``fn_terms``: bf16 parts of fn in the bf16 logit path (2 or 3)."""
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only

    check_shapes(X, a, fn, base, scale, expand_args)
    T, n, d = X.shape
    p, (grid_a, a_kw), (grid_b, b_kw) = launch_config(
        T, n, d, expand=expand_args is not None, x_dtype=X.dtype, out_dtype=out_dtype, eps=eps, rms_eps=rms_eps,
        iters=iters, plan=plan, fn_terms=fn_terms)
    f32 = jnp.float32
    if expand_args is None:
        y, post, comb = jnp.zeros((1,), out_dtype), jnp.zeros((1,), f32), jnp.zeros((1,), f32)
    else:
        y, post, comb = expand_args
    xo_shape = (T, n, d) if expand_args is not None else (1,)   # unused without expand
    DS, NCP = p["DS"], p["NCP"]
    outs_a = (jax.ShapeDtypeStruct(xo_shape, out_dtype), jax.ShapeDtypeStruct((T, d), out_dtype),
              jax.ShapeDtypeStruct((DS, T, NCP), f32), jax.ShapeDtypeStruct((DS, T), f32))
    fpack = pack_fn(fn, n, d, p["BD"], NCP, a_kw["DOT"], a_kw["TERMS"])
    Xo, h, m_part, ss_part = jt.triton_call(
        X, a.astype(f32), fpack, y.astype(out_dtype), post.astype(f32), comb.astype(f32),
        kernel=_mhc_split_kernel, out_shape=outs_a, grid=grid_a, num_warps=p["num_warps"], num_stages=2, **a_kw)
    outs_b = (jax.ShapeDtypeStruct((T, n), f32), jax.ShapeDtypeStruct((T, n), f32),
              jax.ShapeDtypeStruct((T, n, n), f32))
    pre, post_o, comb_o = jt.triton_call(
        m_part, ss_part, base.astype(f32), scale.astype(f32),
        kernel=_mhc_epilogue_kernel, out_shape=outs_b, grid=grid_b, num_warps=p.get("warps_b", EPI_WARPS),
        num_stages=2, **b_kw)
    # One barrier over both launches' outputs: the sublayer that reads h (kernel A's) then also waits for B. Without
    # it XLA runs B only where pre / post / comb are first needed, after the whole sublayer (a step trace at 1 x 6 on
    # an H100: B 35 us there, the whole op 10-15 us when B follows A; NOTES.md, session 13) -- by then, we infer,
    # the sublayer's weight reads have evicted A's partials from L2 and B's one program reads them from HBM.
    Xo, h, pre, post_o, comb_o = jax.lax.optimization_barrier((Xo, h, pre, post_o, comb_o))
    return (Xo if expand_args is not None else X), h, (pre, post_o, comb_o)
