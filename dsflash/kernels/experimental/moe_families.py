"""The MoE grouped-GEMM kernel families that no default config uses (kept runnable for the bench, the GPU tests and
the compile tools; the benchmark JSON that judged each config is named in README.md here): kind "fp8mma" (FP8 MMA
per 32-wide K block), kind "ds" (``tl.dot_scaled``), kind "sk" with mma "fp8" / "bf16" (split-K), "gemv" (CUDA-core
rows, BM 1) and "swap_ps" (scales applied after an fp16 MMA of the raw codes). ``moe_gemm_triton`` imports this
module only when a config of one of these families is launched, so the default path never loads it; it imports
only the default kernel module and the shared helpers (never the front end, so there is no import cycle)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash import quant
from dsflash.kernels.moe_gemm_kernels import (_decode_slab_bf16, _down_reduce, _e2m1_planes_asm, _e2m1_planes_tl,
                                              _e2m1_to_e4m3_asm, _e2m1_to_e4m3_tl, _expert_w, _fp8_dequant_bf16,
                                              _fp8_quant_store, _fp8_roundtrip_store_bf16, _load_w_slab, _slab_k,
                                              _store_h, _store_o, _sw_down_out, _sw_up_out, _swiglu_h, _tile,
                                              _up_epilogue)
from dsflash.kernels.triton_common import _dot_bf16, _e8m0_to_f32, _round_bf16


@triton.jit
def _fp8_to_bf16(w, DECODE: tl.constexpr):
    if DECODE == 1:
        return w.to(tl.bfloat16)
    return w.to(tl.float32).to(tl.bfloat16)   # Triton's interpreter mis-converts fp8 -> bf16 directly


@triton.jit
def _load_w_block(w_base, s_base, offs_n, kb, KPACK: tl.constexpr, KSC: tl.constexpr, DECODE: tl.constexpr):
    """One 32-wide K block of an expert's [N, K] MXFP4 matrix: (float8 [BN, 32] worth value*2^-6, scale [BN])."""
    p = tl.load(w_base + offs_n[:, None] * KPACK + kb * 16 + tl.arange(0, 16)[None, :])
    s = tl.load(s_base + offs_n * KSC + kb)
    if DECODE == 1:
        w = _e2m1_to_e4m3_asm(p)
    else:
        w = _e2m1_to_e4m3_tl(p)
    return w, _e8m0_to_f32(s) * 64.0


@triton.jit
def _up_block(xq_ptr, xs_ptr, tok, w1b, s1b, w3b, s3b, offs_n, kb, D: tl.constexpr, KPACK: tl.constexpr,
              KSC: tl.constexpr, ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    """Gate and up products [BM, BN] of the 32-wide K block kb, scales applied: ACT_FP8, FP8 MMA of the gathered x
    codes and the E4M3-mapped nibbles times act_scale * weight_scale * 2^6; else bf16 MMA of bf16 x."""
    xa = tl.load(xq_ptr + tok[:, None] * D + kb * 32 + tl.arange(0, 32)[None, :])
    wg, sg = _load_w_block(w1b, s1b, offs_n, kb, KPACK, KSC, DECODE)
    wu, su = _load_w_block(w3b, s3b, offs_n, kb, KPACK, KSC, DECODE)
    if ACT_FP8:
        sx = tl.load(xs_ptr + tok * KSC + kb)
        dg = tl.dot(xa, tl.trans(wg)) * (sx[:, None] * sg[None, :])
        du = tl.dot(xa, tl.trans(wu)) * (sx[:, None] * su[None, :])
    else:
        dg = _dot_bf16(xa, tl.trans(_fp8_to_bf16(wg, DECODE)), DECODE) * sg[None, :]
        du = _dot_bf16(xa, tl.trans(_fp8_to_bf16(wu, DECODE)), DECODE) * su[None, :]
    return dg, du


@triton.jit
def _down_block(h_ptr, hs_ptr, rows_c, w2b, s2b, offs_n, kb, I: tl.constexpr, KPACK: tl.constexpr,
                KSC: tl.constexpr, ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    """h (sorted rows rows_c; FP8 codes + f32 scales, or bf16) times W2 over the 32-wide K block kb -> [BM, BN],
    scales applied, as ``_up_block``."""
    ha = tl.load(h_ptr + rows_c[:, None] * I + kb * 32 + tl.arange(0, 32)[None, :])
    w, sw = _load_w_block(w2b, s2b, offs_n, kb, KPACK, KSC, DECODE)
    if ACT_FP8:
        sh = tl.load(hs_ptr + rows_c * KSC + kb)
        d = tl.dot(ha, tl.trans(w)) * (sh[:, None] * sw[None, :])
    else:
        d = _dot_bf16(ha, tl.trans(_fp8_to_bf16(w, DECODE)), DECODE) * sw[None, :]
    return d


@triton.jit
def _moe_up_kernel(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                   w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                   hq_ptr, hs_ptr,
                   D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, KSUB: tl.constexpr,
                   ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for kk in tl.range(0, KSC, KSUB):
        for j in tl.static_range(KSUB):
            dg, du = _up_block(xq_ptr, xs_ptr, tok, w1b, s1b, w3b, s3b, offs_n, kk + j, D, KPACK, KSC, ACT_FP8,
                               DECODE)
            acc_g += dg
            acc_u += du
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    HOUT: tl.constexpr = 0 if ACT_FP8 else 2        # FP8 codes + f32 scales / plain bf16
    _store_h(_swiglu_h(acc_g, acc_u, rw, LIMIT), hq_ptr, hs_ptr, rows, rmask, offs_n, nb * BN, I, BM, BN, HOUT)


@triton.jit
def _moe_down_kernel(hq_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                     w2_ptr, s2_ptr,
                     o_ptr,
                     D: tl.constexpr, I: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, KSUB: tl.constexpr,
                     ACT_FP8: tl.constexpr, DECODE: tl.constexpr):
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BM, BN), tl.float32)
    for kk in tl.range(0, KSC, KSUB):
        for j in tl.static_range(KSUB):
            acc += _down_block(hq_ptr, hs_ptr, rows_c, w2b, s2b, offs_n, kk + j, I, KPACK, KSC, ACT_FP8, DECODE)
    _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D)


@triton.jit
def _moe_up_kernel_ds(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      hq_ptr, hs_ptr,
                      D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT_FP8: tl.constexpr):
    """Gate/up via ``tl.dot_scaled``: x as E4M3 with UE8M0 scales per 32 (or bf16), W as packed E2M1 with its
    UE8M0 scales; on Hopper Triton upcasts both to bf16 with the scales applied (exact) and runs bf16 MMA with
    fp32 accumulation over a BK-wide chunk -- the reference's math, no per-32 accumulator rescaling."""
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    w1b = w1b + offs_n[:, None] * KPACK
    w3b = w3b + offs_n[:, None] * KPACK
    s1b = s1b + offs_n[:, None] * KSC
    s3b = s3b + offs_n[:, None] * KSC
    offs_k = tl.arange(0, BK)
    offs_kp = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 32)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, D, BK):
        xa = tl.load(xq_ptr + tok[:, None] * D + k0 + offs_k[None, :])
        wg = tl.load(w1b + k0 // 2 + offs_kp[None, :])
        wu = tl.load(w3b + k0 // 2 + offs_kp[None, :])
        sg = tl.load(s1b + k0 // 32 + offs_ks[None, :])
        su = tl.load(s3b + k0 // 32 + offs_ks[None, :])
        if ACT_FP8 == 1:
            sx = tl.load(xs_ptr + tok[:, None] * KSC + k0 // 32 + offs_ks[None, :])
            acc_g = tl.dot_scaled(xa, sx, "e4m3", tl.trans(wg), sg, "e2m1", acc_g)
            acc_u = tl.dot_scaled(xa, sx, "e4m3", tl.trans(wu), su, "e2m1", acc_u)
        elif ACT_FP8 == 2:
            sx = tl.load(xs_ptr + tok[:, None] * KSC + k0 // 32 + offs_ks[None, :])    # f32 pow2 scales
            xb = _fp8_dequant_bf16(xa, sx, BM, BK)
            acc_g = tl.dot_scaled(xb, None, "bf16", tl.trans(wg), sg, "e2m1", acc_g)
            acc_u = tl.dot_scaled(xb, None, "bf16", tl.trans(wu), su, "e2m1", acc_u)
        else:
            acc_g = tl.dot_scaled(xa, None, "bf16", tl.trans(wg), sg, "e2m1", acc_g)
            acc_u = tl.dot_scaled(xa, None, "bf16", tl.trans(wu), su, "e2m1", acc_u)
    rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    hb = _swiglu_h(acc_g, acc_u, rw, LIMIT)
    if ACT_FP8 == 1:
        _fp8_quant_store(hb, hq_ptr, hs_ptr, rows, rmask, offs_n, nb * BN, I, BM, BN, 1)
    elif ACT_FP8 == 2:
        _fp8_roundtrip_store_bf16(hb, hq_ptr, rows, rmask, offs_n, I, BM, BN)
    else:
        tl.store(hq_ptr + rows[:, None] * I + offs_n[None, :], hb.to(tl.bfloat16), mask=rmask[:, None])


@triton.jit
def _moe_down_kernel_ds(hq_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT_FP8: tl.constexpr):
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    w2b = w2b + offs_n[:, None] * KPACK
    s2b = s2b + offs_n[:, None] * KSC
    offs_k = tl.arange(0, BK)
    offs_kp = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 32)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, I, BK):
        ha = tl.load(hq_ptr + rows_c[:, None] * I + k0 + offs_k[None, :])
        w = tl.load(w2b + k0 // 2 + offs_kp[None, :])
        sw = tl.load(s2b + k0 // 32 + offs_ks[None, :])
        if ACT_FP8 == 1:
            sh = tl.load(hs_ptr + rows_c[:, None] * KSC + k0 // 32 + offs_ks[None, :])
            acc = tl.dot_scaled(ha, sh, "e4m3", tl.trans(w), sw, "e2m1", acc)
        else:
            acc = tl.dot_scaled(ha, None, "bf16", tl.trans(w), sw, "e2m1", acc)
    _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D)


# ---------------------------------------------------------------- split-K decode kernels (kind "sk")
@triton.jit
def _moe_up_kernel_sk(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      h_ptr, hs_ptr,
                      S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KSUB: tl.constexpr,
                      KS: tl.constexpr, MMA: tl.constexpr, ACT_FP8: tl.constexpr, HOUT: tl.constexpr,
                      DECODE: tl.constexpr):
    """Gate/up over K chunk ``program_id(2)`` of KS (D / KS wide). KS == 1: the full epilogue here (h out as in
    ``_store_h``). KS > 1: fp32 partials [KS, S, 2, I] (g then u) for ``_moe_up_epilogue_sk``.
    MMA 1: per BK slab one bf16 MMA of the exact bf16 x (FP8 codes * scales, dequantised here) and the decoded,
    scaled weights; the next slab's raw bytes are loaded before this one is used (register double buffer).
    MMA 0: the fp8mma per-32 loop (``_moe_up_kernel``) restricted to the chunk."""
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    if MMA == 1:
        pg, sg = _load_w_slab(w1b, s1b, offs_n, kbeg, KPACK, KSC, BK)
        pu, su = _load_w_slab(w3b, s3b, offs_n, kbeg, KPACK, KSC, BK)
        for i in tl.range(0, KCH // BK):                     # constant bounds (also for Triton's interpreter)
            k0, kn = _slab_k(kbeg, i, KCH, BK)
            npg, nsg = _load_w_slab(w1b, s1b, offs_n, kn, KPACK, KSC, BK)
            npu, nsu = _load_w_slab(w3b, s3b, offs_n, kn, KPACK, KSC, BK)
            xa = tl.load(xq_ptr + tok[:, None] * D + k0 + tl.arange(0, BK)[None, :])
            if ACT_FP8:
                sx = tl.load(xs_ptr + tok[:, None] * KSC + k0 // 32 + tl.arange(0, BK // 32)[None, :])
                xb = _fp8_dequant_bf16(xa, sx, BM, BK)
            else:
                xb = xa
            acc_g += _dot_bf16(xb, tl.trans(_decode_slab_bf16(pg, sg, BN, BK, DECODE)), DECODE)
            acc_u += _dot_bf16(xb, tl.trans(_decode_slab_bf16(pu, su, BN, BK, DECODE)), DECODE)
            pg = npg
            sg = nsg
            pu = npu
            su = nsu
    else:
        for kk in tl.range(0, KCH // 32, KSUB):
            for j in tl.static_range(KSUB):
                dg, du = _up_block(xq_ptr, xs_ptr, tok, w1b, s1b, w3b, s3b, offs_n, kbeg // 32 + kk + j, D, KPACK,
                                   KSC, 1, DECODE)
                acc_g += dg
                acc_u += du
    if KS == 1:
        rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
        _store_h(_swiglu_h(acc_g, acc_u, rw, LIMIT), h_ptr, hs_ptr, rows, rmask, offs_n, nb * BN, I, BM, BN,
                 HOUT)
    else:
        base = h_ptr + (ks * S + rows[:, None]).to(tl.int64) * (2 * I) + offs_n[None, :]
        tl.store(base, acc_g, mask=rmask[:, None])
        tl.store(base + I, acc_u, mask=rmask[:, None])


@triton.jit
def _moe_down_kernel_sk(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KSUB: tl.constexpr,
                        KS: tl.constexpr, MMA: tl.constexpr, DECODE: tl.constexpr):
    """h (sorted rows; MMA 1: bf16 [S, I], MMA 0: FP8 codes + f32 scales) times MXFP4 W2 over K chunk
    ``program_id(2)`` of KS. KS == 1: bf16-rounded rows at their unsorted slot of o [S, D]; KS > 1: fp32
    partials [KS, S, D] (unsorted slots) for ``_moe_down_reduce_sk``."""
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    ks = tl.program_id(2)
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BM, BN), tl.float32)
    if MMA == 1:
        pw, sw = _load_w_slab(w2b, s2b, offs_n, kbeg, KPACK, KSC, BK)
        for i in tl.range(0, KCH // BK):
            k0, kn = _slab_k(kbeg, i, KCH, BK)
            npw, nsw = _load_w_slab(w2b, s2b, offs_n, kn, KPACK, KSC, BK)
            ha = tl.load(h_ptr + rows_c[:, None] * I + k0 + tl.arange(0, BK)[None, :])
            acc += _dot_bf16(ha, tl.trans(_decode_slab_bf16(pw, sw, BN, BK, DECODE)), DECODE)
            pw = npw
            sw = nsw
    else:
        for kk in tl.range(0, KCH // 32, KSUB):
            for j in tl.static_range(KSUB):
                acc += _down_block(h_ptr, hs_ptr, rows_c, w2b, s2b, offs_n, kbeg // 32 + kk + j, I, KPACK, KSC, 1,
                                   DECODE)
    if KS == 1:
        _store_o(acc, o_ptr, slot_ptr, rows, rmask, offs_n, D)
    else:
        slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        tl.store(o_ptr + (ks * S + slot[:, None]) * D + offs_n[None, :], acc, mask=rmask[:, None])


@triton.jit
def _gemv_slab(p, s, xf, BN: tl.constexpr, BK: tl.constexpr, DECODE: tl.constexpr):
    """One BK slab of a one-row product on the CUDA cores: [BN] = sum_k W[n, k] x[k]. Per 32-block the fp32 sum of
    x times the E4M3-mapped nibbles (value * 2^-6; products exact), then times scale * 2^6 (exact powers of two)."""
    if DECODE == 1:
        w = _e2m1_to_e4m3_asm(p)
    else:
        w = _e2m1_to_e4m3_tl(p)
    w3 = tl.reshape(w.to(tl.float32), (BN, BK // 32, 32))
    blk = tl.sum(w3 * tl.reshape(xf, (1, BK // 32, 32)), axis=2)           # [BN, BK/32]
    return tl.sum(blk * (_e8m0_to_f32(s) * 64.0), axis=1)


@triton.jit
def _moe_up_kernel_gemv(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                        h_ptr, hs_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, ACT_FP8: tl.constexpr,
                        HOUT: tl.constexpr, DECODE: tl.constexpr):
    """Gate/up for one-row tiles (BM = 1: every routed slot is its own tile) without tensor cores: no padding rows,
    no layout conversion for an MMA operand. Same K split, slab prefetch, partials and epilogue as
    ``_moe_up_kernel_sk`` (HOUT 1 or 2)."""
    e, r, _, _, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, 1, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + r).to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BN,), tl.float32)
    acc_u = tl.zeros((BN,), tl.float32)
    pg, sg = _load_w_slab(w1b, s1b, offs_n, kbeg, KPACK, KSC, BK)
    pu, su = _load_w_slab(w3b, s3b, offs_n, kbeg, KPACK, KSC, BK)
    for i in tl.range(0, KCH // BK):
        k0, kn = _slab_k(kbeg, i, KCH, BK)
        npg, nsg = _load_w_slab(w1b, s1b, offs_n, kn, KPACK, KSC, BK)
        npu, nsu = _load_w_slab(w3b, s3b, offs_n, kn, KPACK, KSC, BK)
        xa = tl.load(xq_ptr + tok * D + k0 + tl.arange(0, BK)).to(tl.float32)
        if ACT_FP8:
            sx = tl.load(xs_ptr + tok * KSC + k0 // 32 + tl.arange(0, BK // 32))
            xa = tl.reshape(tl.reshape(xa, (BK // 32, 32)) * sx[:, None], (BK,))   # exact round-tripped x
        acc_g += _gemv_slab(pg, sg, xa, BN, BK, DECODE)
        acc_u += _gemv_slab(pu, su, xa, BN, BK, DECODE)
        pg = npg
        sg = nsg
        pu = npu
        su = nsu
    rows = r + tl.arange(0, 1)
    rmask = rows < S
    if KS == 1:
        rw = tl.load(rw_ptr + rows)
        _store_h(_swiglu_h(acc_g[None, :], acc_u[None, :], rw, LIMIT), h_ptr, hs_ptr, rows, rmask, offs_n, nb * BN,
                 I, 1, BN, HOUT)
    else:
        base = h_ptr + (ks * S + r).to(tl.int64) * (2 * I) + offs_n
        tl.store(base, acc_g)
        tl.store(base + I, acc_u)


@triton.jit
def _moe_down_kernel_gemv(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                          w2_ptr, s2_ptr,
                          o_ptr,
                          S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, DECODE: tl.constexpr):
    """Down projection of one-row tiles (h as bf16 [S, I], sorted rows) on the CUDA cores; KS == 1: bf16-rounded
    row at its slot of o [S, D]; KS > 1: fp32 partials [KS, S, D] for ``_moe_down_reduce_sk``."""
    e, r0, _, _, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, 1, BN)
    if e < 0:
        return
    r = r0.to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BN,), tl.float32)
    pw, sw = _load_w_slab(w2b, s2b, offs_n, kbeg, KPACK, KSC, BK)
    for i in tl.range(0, KCH // BK):
        k0, kn = _slab_k(kbeg, i, KCH, BK)
        npw, nsw = _load_w_slab(w2b, s2b, offs_n, kn, KPACK, KSC, BK)
        ha = tl.load(h_ptr + r * I + k0 + tl.arange(0, BK)).to(tl.float32)
        acc += _gemv_slab(pw, sw, ha, BN, BK, DECODE)
        pw = npw
        sw = nsw
    slot = tl.load(slot_ptr + r).to(tl.int64)
    if KS == 1:
        tl.store(o_ptr + slot * D + offs_n, _round_bf16(acc).to(tl.bfloat16))
    else:
        tl.store(o_ptr + (ks * S + slot) * D + offs_n, acc)


# --------------------------- swapped operands, scales applied after the MMA (kind "sk", mma "swap_ps", 2026-12-01)
# The weight path of "swap_eo" spends ~3.5 of its ~6.8 SASS instructions per weight element on float work: E4M3 ->
# f16 unpack, f16 -> f32, the fp32 scale multiply and the bf16 pack. Here nothing is scaled before the MMA: per
# 32-wide K group (one UE8M0 scale per weight row, one pow2 scale per activation row) the MMA multiplies the raw
# codes -- weight nibbles as E4M3 bytes unpacked to fp16 (value * 2^-6, exact) and the activation's E4M3 codes as
# fp16 (exact) -- into a fresh fp32 partial, and the partial is scaled once per accumulator element:
# acc^T[n, m] += part[n, m] * (2^(s_w[n] - 121) * s_x[m]) (powers of two: the multiply is exact, one rounding in the
# add, as when the MMA accumulates). Per weight element that leaves the nibble -> E4M3 bit ops and half an unpack;
# per accumulator element an FMUL and an FFMA per group (BM = 16, BN = 64, 128 threads: 0.5 + 0.5 per element).
# Needs FP8 activations (precision "reference"); h travels as FP8 codes + f32 pow2 scales (HOUT 0).
@triton.jit
def _dot_f16(a, b, DECODE: tl.constexpr):
    if DECODE == 1:
        return tl.dot(a, b)
    # Triton's interpreter: fp16 products are exact in fp32, so an IEEE fp32 dot of the same values is the same math
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _fp8_to_f16(v, DECODE: tl.constexpr):
    if DECODE == 1:
        return v.to(tl.float16)
    return v.to(tl.float32).to(tl.float16)     # exact either way (E4M3 values are fp16 values)


@triton.jit
def _ps_perm(t, R: tl.constexpr, PERM: tl.constexpr):
    """PERM: [R, 16] bytes of one K group (byte b = 4c + 2h + q) -> column order h*8 + c*2 + q. The MMA sums over K,
    so any order shared by both operands gives the same products; this one puts the 4 bytes a thread holds in the
    wgmma's 16-bit register fragment (columns 2c, 2c+1, 2c+8, 2c+9 of a 16-wide K step) next to each other in memory:
    one 32-bit word per row and thread instead of 2-byte pieces reassembled byte by byte (sm_90 up loop 746 -> 670 at
    BM 16). With BM 8 Triton lowers the dot to mma.sync, whose operand layout it builds differently: there the
    natural order is the cheap one (PERM 0: 458 SASS per iteration vs 595 permuted)."""
    if PERM:
        return tl.reshape(tl.permute(tl.reshape(t, (R, 4, 2, 2)), (0, 2, 1, 3)), (R, 16))
    return t


@triton.jit
def _ps_weight_planes(w_base, offs_n, kg, KPACK: tl.constexpr, BN: tl.constexpr, DECODE: tl.constexpr,
                      PERM: tl.constexpr):
    """One 32-wide K group of an expert's packed rows: (low-nibble, high-nibble) fp16 planes [BN, 16] worth
    E2M1 * 2^-6 (exact), columns in ``_ps_perm`` order."""
    p = _ps_perm(tl.load(w_base + offs_n[:, None] * KPACK + kg // 2 + tl.arange(0, 16)[None, :]), BN, PERM)
    if DECODE == 1:
        lo, hi = _e2m1_planes_asm(p)
    else:
        lo, hi = _e2m1_planes_tl(p)
    return (_fp8_to_f16(lo.to(tl.float8e4nv, bitcast=True), DECODE),
            _fp8_to_f16(hi.to(tl.float8e4nv, bitcast=True), DECODE))


@triton.jit
def _ps_group(acc, w_base, swf, offs_n, kg, x0, x1, sxf, KPACK: tl.constexpr, BN: tl.constexpr,
              DECODE: tl.constexpr, PERM: tl.constexpr):
    """acc^T [BN, BM] += (W_group [BN, 32] . x_group^T) * outer(weight scale swf [BN], activation scale sxf [BM])."""
    wl, wh = _ps_weight_planes(w_base, offs_n, kg, KPACK, BN, DECODE, PERM)
    part = _dot_f16(wl, tl.trans(x0), DECODE)
    part += _dot_f16(wh, tl.trans(x1), DECODE)
    return acc + part * (swf[:, None] * sxf[None, :])


@triton.jit
def _ps_wscales(s_base, offs_n, k0, KSC: tl.constexpr, G: tl.constexpr):
    """UE8M0 scale bytes of rows offs_n for the slab at k0: G contiguous bytes a row (G = BK / 32 in 1, 2, 4), read
    as one little-endian 8/16/32-bit word per row (aligned: BK divides K, so KSC = K / 32, k0 / 32 and the expert
    offset N * KSC are multiples of G); ``_ps_wscale`` picks a group. Loaded in the accumulator's row layout, so no
    shuffles (a [BN, G] tile needed warp shuffles to pick a column: 403 -> 376 SASS per iteration of the down kernel
    at BN 64, BK 128)."""
    tl.static_assert(G == 1 or G == 2 or G == 4, "swap_ps: BK must be 32, 64 or 128")
    ptr = s_base + offs_n * KSC + k0 // 32
    if G == 4:
        w = tl.load(ptr.to(tl.pointer_type(tl.uint32), bitcast=True)).to(tl.int32, bitcast=True)
    elif G == 2:
        w = tl.load(ptr.to(tl.pointer_type(tl.uint16), bitcast=True)).to(tl.int32)
    else:
        w = tl.load(ptr).to(tl.int32)
    return w


@triton.jit
def _ps_wscale(words, g: tl.constexpr):
    """Group g's scale byte s from ``_ps_wscales`` -> 2^(s - 127) * 2^6 as fp32 (the 2^6 undoes the E4M3 mapping's
    2^-6)."""
    s = (words >> (8 * g)) & 0xFF
    return ((s + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ps_act(q_ptr, rows_q, kg, NCOLS: tl.constexpr, BM: tl.constexpr, DECODE: tl.constexpr, PERM: tl.constexpr):
    """Activation codes of rows rows_q (FP8 [., NCOLS]) at K group kg as the two fp16 [BM, 16] operands matching
    ``_ps_weight_planes`` (even / odd K elements of the bytes in ``_ps_perm`` order)."""
    xa = _fp8_to_f16(tl.load(q_ptr + rows_q[:, None] * NCOLS + kg + tl.arange(0, 32)[None, :]), DECODE)
    if PERM:
        xa = tl.reshape(tl.permute(tl.reshape(xa, (BM, 4, 2, 2, 2)), (0, 2, 1, 3, 4)), (BM, 16, 2))
    else:
        xa = tl.reshape(xa, (BM, 16, 2))
    return tl.split(xa)


@triton.jit
def _moe_up_kernel_ps(xq_ptr, xs_ptr, tok_ptr, rw_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                      w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                      h_ptr, hs_ptr,
                      S: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LIMIT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                      ACT_FP8: tl.constexpr, HOUT: tl.constexpr, DECODE: tl.constexpr, PERM: tl.constexpr = 1):
    """``_moe_up_kernel_sw`` with the scales applied after the MMA, one 32-wide K group at a time (block comment
    above); BK / 32 groups per loop iteration (unrolled), the slab's scales loaded once per iteration (G contiguous
    bytes a row) and picked per group in registers. KS > 1: fp32 partials as the sw kernel; KS == 1: the epilogue
    here (HOUT 0: FP8 codes + f32 scales)."""
    e, _, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    ks = tl.program_id(2)
    KPACK: tl.constexpr = D // 2
    KSC: tl.constexpr = D // 32
    KCH: tl.constexpr = D // KS
    kbeg = ks * KCH
    w1b, s1b = _expert_w(w1_ptr, s1_ptr, e, I, D)
    w3b, s3b = _expert_w(w3_ptr, s3_ptr, e, I, D)
    acc_g = tl.zeros((BN, BM), tl.float32)
    acc_u = tl.zeros((BN, BM), tl.float32)
    G: tl.constexpr = BK // 32
    for i in tl.range(0, KCH // BK):
        k0 = kbeg + i * BK
        sg = _ps_wscales(s1b, offs_n, k0, KSC, G)
        su = _ps_wscales(s3b, offs_n, k0, KSC, G)
        for g in tl.static_range(G):
            kg = k0 + g * 32
            x0, x1 = _ps_act(xq_ptr, tok, kg, D, BM, DECODE, PERM)
            sxg = tl.load(xs_ptr + tok * KSC + kg // 32)
            acc_g = _ps_group(acc_g, w1b, _ps_wscale(sg, g), offs_n, kg, x0, x1, sxg, KPACK, BN, DECODE, PERM)
            acc_u = _ps_group(acc_u, w3b, _ps_wscale(su, g), offs_n, kg, x0, x1, sxg, KPACK, BN, DECODE, PERM)
    _sw_up_out(acc_g, acc_u, rw_ptr, h_ptr, hs_ptr, rows, rmask, offs_n, nb, ks, S, I, LIMIT, BM, BN, KS, HOUT)


@triton.jit
def _moe_down_kernel_ps(h_ptr, hs_ptr, slot_ptr, tile_e_ptr, tile_s_ptr, tile_end_ptr,
                        w2_ptr, s2_ptr,
                        o_ptr,
                        S: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                        DECODE: tl.constexpr, PERM: tl.constexpr = 1):
    """``_moe_down_kernel_sw`` with the scales applied after the MMA (as the up kernel); h as FP8 codes [S, I] + f32
    pow2 scales [S, I/32] in sorted rows."""
    e, r0, rows, rmask, nb, offs_n = _tile(tile_e_ptr, tile_s_ptr, tile_end_ptr, BM, BN)
    if e < 0:
        return
    rows_c = tl.where(rmask, rows, r0).to(tl.int64)     # clamp: padded rows re-read a valid row
    ks = tl.program_id(2)
    KPACK: tl.constexpr = I // 2
    KSC: tl.constexpr = I // 32
    KCH: tl.constexpr = I // KS
    kbeg = ks * KCH
    w2b, s2b = _expert_w(w2_ptr, s2_ptr, e, D, I)
    acc = tl.zeros((BN, BM), tl.float32)
    G: tl.constexpr = BK // 32
    for i in tl.range(0, KCH // BK):
        k0 = kbeg + i * BK
        sw = _ps_wscales(s2b, offs_n, k0, KSC, G)
        for g in tl.static_range(G):
            kg = k0 + g * 32
            h0, h1 = _ps_act(h_ptr, rows_c, kg, I, BM, DECODE, PERM)
            acc = _ps_group(acc, w2b, _ps_wscale(sw, g), offs_n, kg, h0, h1,
                            tl.load(hs_ptr + rows_c * KSC + kg // 32), KPACK, BN, DECODE, PERM)
    _sw_down_out(acc, o_ptr, slot_ptr, rows, rmask, offs_n, ks, S, D, KS)


# ------------------------------------------------------------------------------------------ JAX side
def launch_unsplit(jt, p, w1, s1, w3, s3, w2, s2, *, S, TM, d, I, limit, act_fp8, cfg):
    """Kinds "ds" and "fp8mma": one up and one down launch, no K split (moved from ``moe_gemm_triton._launch``)."""
    hdt = jnp.float8_e4m3fn if act_fp8 else jnp.bfloat16
    if cfg.kind == "ds":
        mode = (2 if cfg.act == "bf16rt" else 1) if act_fp8 else 0
        if mode == 2:
            # bf16 carriers of the FP8 round trips: x codes are dequantised to bf16 in-kernel (the reference's own
            # xa, bit for bit; not in JAX, where XLA may elide the f32->f8->f32 pair) and h leaves the gate/up
            # kernel already round-tripped as bf16, so both GEMMs take bf16 lhs.
            xq, xs = p["xq"], p["xs"]
            hdt = jnp.bfloat16
        else:
            xq = p["xq"]
            xs = quant.f32_pow2_to_e8m0(p["xs"]) if act_fp8 else p["xs"]
        hq, hs = jt.triton_call(
            xq, xs, p["tok"], p["rw"], p["tile_e"], p["tile_s"], p["tile_end"], w1, s1, w3, s3,
            kernel=_moe_up_kernel_ds,
            out_shape=(jax.ShapeDtypeStruct((S, I), hdt), jax.ShapeDtypeStruct((S, I // 32), jnp.uint8)),
            grid=(TM, I // cfg.BN_UP), num_warps=cfg.warps_up, num_stages=cfg.stages,
            D=d, I=I, LIMIT=float(limit), BM=cfg.BM, BN=cfg.BN_UP, BK=cfg.BK, ACT_FP8=mode)
        o = jt.triton_call(
            hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2,
            kernel=_moe_down_kernel_ds,
            out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
            grid=(TM, d // cfg.BN_DOWN), num_warps=cfg.warps_down, num_stages=cfg.stages,
            D=d, I=I, BM=cfg.BM, BN=cfg.BN_DOWN, BK=cfg.BK, ACT_FP8=mode)
        return o, hq, hs
    hq, hs = jt.triton_call(
        p["xq"], p["xs"], p["tok"], p["rw"], p["tile_e"], p["tile_s"], p["tile_end"], w1, s1, w3, s3,
        kernel=_moe_up_kernel,
        out_shape=(jax.ShapeDtypeStruct((S, I), hdt), jax.ShapeDtypeStruct((S, I // 32), jnp.float32)),
        grid=(TM, I // cfg.BN_UP), num_warps=cfg.warps_up, num_stages=cfg.stages,
        D=d, I=I, LIMIT=float(limit), BM=cfg.BM, BN=cfg.BN_UP, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8),
        DECODE=int(cfg.decode == "asm"))
    o = jt.triton_call(
        hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2,
        kernel=_moe_down_kernel,
        out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
        grid=(TM, d // cfg.BN_DOWN), num_warps=cfg.warps_down, num_stages=cfg.stages,
        D=d, I=I, BM=cfg.BM, BN=cfg.BN_DOWN, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8), DECODE=int(cfg.decode == "asm"))
    return o, hq, hs


def sk_kernels(cfg, mma, *, d, I, dec):
    """(up kernel, down kernel, their common constexprs) of kind "sk" with mma "fp8" (0), "bf16" (1) or "swap_ps" (6),
    for ``moe_gemm_triton._launch_sk`` (moved from there)."""
    if mma == 6:
        return _moe_up_kernel_ps, _moe_down_kernel_ps, dict(D=d, I=I, BM=cfg.BM, BK=cfg.BK, DECODE=dec,
                                                            PERM=int(cfg.BM >= 16))   # wgmma / mma.sync
    return _moe_up_kernel_sk, _moe_down_kernel_sk, dict(D=d, I=I, BM=cfg.BM, BK=cfg.BK, KSUB=cfg.KSUB, MMA=mma,
                                                        DECODE=dec)


def launch_gemv(jt, p, up_args, w2, s2, h_shapes, *, S, TM, d, I, limit, act_fp8, cfg, ks_up, ks_down, hout, dec):
    """mma="gemv" (BM = 1): the CUDA-core one-row kernels, same split / epilogue / reduction kernels."""
    kw = dict(S=S, D=d, I=I, BK=cfg.BK, DECODE=dec)
    if ks_up == 1:
        hq, hs = jt.triton_call(
            *up_args, kernel=_moe_up_kernel_gemv, out_shape=h_shapes,
            grid=(TM, I // cfg.BN_UP, 1), num_warps=cfg.warps_up, num_stages=cfg.stages,
            LIMIT=float(limit), BN=cfg.BN_UP, KS=1, ACT_FP8=int(act_fp8), HOUT=hout, **kw)
    else:
        part, _ = jt.triton_call(
            *up_args, kernel=_moe_up_kernel_gemv,
            out_shape=(jax.ShapeDtypeStruct((ks_up, S, 2 * I), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)),
            grid=(TM, I // cfg.BN_UP, ks_up), num_warps=cfg.warps_up, num_stages=cfg.stages,
            LIMIT=float(limit), BN=cfg.BN_UP, KS=ks_up, ACT_FP8=int(act_fp8), HOUT=hout, **kw)
        hq, hs = _up_epilogue(jt, part, p, h_shapes, S=S, I=I, limit=limit, ks_up=ks_up, hout=hout)
    down_args = (hq, hs, p["order"], p["tile_e"], p["tile_s"], p["tile_end"], w2, s2)
    if ks_down == 1:
        o = jt.triton_call(
            *down_args, kernel=_moe_down_kernel_gemv, out_shape=jax.ShapeDtypeStruct((S, d), jnp.bfloat16),
            grid=(TM, d // cfg.BN_DOWN, 1), num_warps=cfg.warps_down, num_stages=cfg.stages,
            BN=cfg.BN_DOWN, KS=1, **kw)
    else:
        part = jt.triton_call(
            *down_args, kernel=_moe_down_kernel_gemv, out_shape=jax.ShapeDtypeStruct((ks_down, S, d), jnp.float32),
            grid=(TM, d // cfg.BN_DOWN, ks_down), num_warps=cfg.warps_down, num_stages=cfg.stages,
            BN=cfg.BN_DOWN, KS=ks_down, **kw)
        o = _down_reduce(jt, part, S=S, d=d, ks_down=ks_down)
    return o, hq, hs
