"""Triton (jax-triton) sparse sink attention that reads the compressed entries straight from the paged NVFP4 pool.

STATUS (2026-12-06): interpreter-checked (scripts/triton_interpret_sparse_attention_paged.py) and its GPU test passed
on one H200 (tests/gpu/test_sparse_attention_paged.py, bits equal to the flash kernel); not timed, so
``dispatch.GATES["sparse_attention_paged"]`` gives it no range yet (``gpu_queue.sh paged`` measures it in the step).

Contract: ``sparse_attention.sparse_sink_attention_paged_reference`` (the model's attention sublayer as it was:
decode the picked pool entries to bf16, lay them after the window rows, attend over both). What the kernel saves is
that materialisation: per decode call the gather wrote every picked entry as bf16 (1 KB at D = 512) and the
concatenation copied window and picks into one buffer again, which the attention kernel then gathered a third time
(step-profile ops ``kv_gather`` + ``attention_other``: 0.44 ms of the 8.6 ms 32 x 6 step on the H200, run 49). Here
each picked entry is read once from the pool as 256 bytes of E2M1 nibbles + 32 E4M3 scale bytes and decoded in
registers: value = e2m1 x scale in fp32 (exact) -> bf16 (exact: <= 6 significant bits), the same values
``state.decode_main_kv`` gives.

It is the "flash" kernel of ``sparse_attention_triton`` (v3: online softmax, NS splits, head groups) with two
sources: blocks of the window part (ids into ``win`` [B, NW, D] bf16: ring rows + the call's own rows, small) come
first, then blocks of the pool part (row addresses into the pool). The window part is padded with empty slots to a
multiple of BK, so every block is one source; empty slots add exact zeros, so the output equals the flash kernel's on
the materialised buffer with the same padded ids bit for bit (the interpreter check), and the flash kernel's error
band against the reference holds unchanged.

The nibble and scale decoding is integer / fp32 arithmetic (no fp8 conversions), so Triton's interpreter runs the
same code as the GPU; ``IEEE`` (fp32 inputs, the interpreter's dots) as in v3.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels import sparse_attention_triton as sat
from dsflash.kernels.sparse_attention_triton import _rne_bf16


@triton.jit
def _e2m1_f32(c):
    """4-bit E2M1 codes (int32, bit 3 = sign) -> fp32 values, exact: mag 0, 1 -> 0, 0.5; mag >= 2 -> 2^(mag/2 - 1)
    x (1 + (mag & 1) / 2)."""
    mag = c & 7
    bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 0x3F000000, 0))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_f32(s):
    """E4M3 (fn) bytes (int32) -> fp32, exact: normal 2^(e-7) (1 + m/8), subnormal m 2^-9. (NaN bytes are never
    written: the quantiser clips.)"""
    e = (s >> 3) & 15
    m = s & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e > 0, normal, m.to(tl.float32) * (1.0 / 512.0))
    return tl.where((s & 0x80) != 0, -v, v)


@triton.jit
def _pool_rows(pq_ptr, ps_ptr, addr, valid, BK: tl.constexpr, D: tl.constexpr):
    """NVFP4 pool rows at ``addr`` [BK] (int64, valid ones) -> fp32 [BK, D] of the decoded values (0 where not
    valid: not read). Byte j holds elements 2j (low nibble) and 2j + 1; scale byte g covers elements 16g..16g+15."""
    DH: tl.constexpr = D // 2
    DG: tl.constexpr = D // 16
    b = tl.load(pq_ptr + addr[:, None] * DH + tl.arange(0, DH)[None, :], mask=valid[:, None], other=0).to(tl.int32)
    sc = tl.load(ps_ptr + addr[:, None] * DG + tl.arange(0, DG)[None, :], mask=valid[:, None], other=0).to(tl.int32)
    vals = tl.reshape(tl.join(_e2m1_f32(b & 15), _e2m1_f32(b >> 4)), (BK, D))
    scale = _e4m3_f32(sc)
    return tl.reshape(tl.reshape(vals, (BK, DG, 16)) * scale[:, :, None], (BK, D))


@triton.jit
def _paged_body(q_ptr, win_ptr, iw_ptr, pq_ptr, ps_ptr, ia_ptr, row, sp, offs_h,
                S: tl.constexpr, NW: tl.constexpr, H: tl.constexpr, D: tl.constexpr, KW: tl.constexpr,
                KP: tl.constexpr, SCALE: tl.constexpr, BK: tl.constexpr, BPS: tl.constexpr, HG: tl.constexpr,
                P_BF16: tl.constexpr, IEEE: tl.constexpr):
    """``sparse_attention_triton._flash_body`` over blocks [sp * BPS, sp * BPS + BPS): a block below KW / BK gathers
    window rows of ``win``, a block above decodes pool rows at the addresses ``ia`` (-1 = empty)."""
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + row * (H * D) + offs_h[:, None] * D + offs_d[None, :])
    if IEEE:
        q = q.to(tl.float32)
    w_base = win_ptr + (row // S) * (NW * D)
    m = tl.full((HG,), -1e30, tl.float32)
    l = tl.zeros((HG,), tl.float32)
    acc = tl.zeros((HG, D), tl.float32)
    for j in tl.range(0, BPS):
        blk = sp * BPS + j
        if blk * BK < KW:
            offs = blk * BK + tl.arange(0, BK)
            ids = tl.load(iw_ptr + row * KW + offs)                      # KW is a multiple of BK: no tail
            valid = ids >= 0
            safe = tl.minimum(tl.where(valid, ids, 0), NW - 1).to(tl.int64)
            kv = tl.load(w_base + safe[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
            if IEEE:
                kv = kv.to(tl.float32)
            else:
                kv = kv.to(tl.bfloat16)
        else:
            offs = blk * BK - KW + tl.arange(0, BK)
            addr = tl.load(ia_ptr + row * KP + offs, mask=offs < KP, other=-1)
            valid = addr >= 0
            kvf = _pool_rows(pq_ptr, ps_ptr, tl.where(valid, addr, 0).to(tl.int64), valid, BK, D)
            if IEEE:
                kv = kvf.to(tl.bfloat16).to(tl.float32)                   # exact either way: bf16-representable
            else:
                kv = kvf.to(tl.bfloat16)
        if IEEE:
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        s = tl.where(valid[None, :], s * SCALE, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if P_BF16:
            if IEEE:
                acc = tl.dot(_rne_bf16(p).to(tl.float32), kv, acc, input_precision="ieee")
            else:
                acc = tl.dot(_rne_bf16(p), kv, acc)
        else:
            acc = tl.dot(p, kv.to(tl.float32), acc, input_precision="ieee")
        m = m_new
    return m, l, acc


@triton.jit
def _paged_kernel(q_ptr, win_ptr, iw_ptr, pq_ptr, ps_ptr, ia_ptr, sink_ptr, o_ptr,
                  S: tl.constexpr, NW: tl.constexpr, H: tl.constexpr, D: tl.constexpr, KW: tl.constexpr,
                  KP: tl.constexpr, SCALE: tl.constexpr, BK: tl.constexpr, BPS: tl.constexpr, HG: tl.constexpr,
                  P_BF16: tl.constexpr, IEEE: tl.constexpr):
    """NS = 1: ``sparse_attention_triton._flash_kernel`` with two sources."""
    row = tl.program_id(0).to(tl.int64)
    offs_h = sat._flash_heads(HG, H)
    m, l, acc = _paged_body(q_ptr, win_ptr, iw_ptr, pq_ptr, ps_ptr, ia_ptr, row, 0, offs_h, S, NW, H, D, KW, KP,
                            SCALE, BK, BPS, HG, P_BF16, IEEE)
    den = l + tl.exp(tl.load(sink_ptr + offs_h) - m)
    o = acc / den[:, None]
    tl.store(o_ptr + row * (H * D) + offs_h[:, None] * D + tl.arange(0, D)[None, :], o.to(o_ptr.dtype.element_ty))


@triton.jit
def _paged_split_kernel(q_ptr, win_ptr, iw_ptr, pq_ptr, ps_ptr, ia_ptr, op_ptr, mp_ptr, lp_ptr,
                        S: tl.constexpr, NW: tl.constexpr, H: tl.constexpr, D: tl.constexpr, KW: tl.constexpr,
                        KP: tl.constexpr, SCALE: tl.constexpr, BK: tl.constexpr, BPS: tl.constexpr, NS: tl.constexpr,
                        HG: tl.constexpr, P_BF16: tl.constexpr, IEEE: tl.constexpr):
    """NS > 1: ``sparse_attention_triton._flash_split_kernel`` with two sources (partials for ``flash_combine``)."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    offs_h = sat._flash_heads(HG, H)
    m, l, acc = _paged_body(q_ptr, win_ptr, iw_ptr, pq_ptr, ps_ptr, ia_ptr, row, sp, offs_h, S, NW, H, D, KW, KP,
                            SCALE, BK, BPS, HG, P_BF16, IEEE)
    base = row * NS + sp
    tl.store(op_ptr + base * (H * D) + offs_h[:, None] * D + tl.arange(0, D)[None, :], acc)
    tl.store(mp_ptr + base * H + offs_h, m)
    tl.store(lp_ptr + base * H + offs_h, l)


# ----------------------------------------------------------------------------------------------- wrapper
def _bytes(a):
    """A one-byte array (uint8 nibbles, float8_e4m3fn scales) as uint8: the kernel decodes the bits itself."""
    return a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8)


def pad_window_ids(win_idx, bk: int):
    """Window ids [B, S, KW] padded with empty slots (-1) to a multiple of ``bk`` (every kernel block one source)."""
    kw = win_idx.shape[-1]
    pad = -kw % bk
    if not pad:
        return win_idx
    return jnp.pad(win_idx, ((0, 0), (0, 0), (0, pad)), constant_values=-1)


def launch_plan(cfg: sat.AttnConfig, R, H, D, KW, KP, scale, precision, q_dtype, S, NW):
    """(NS, grid, kernel constexprs) for padded window ids of KW (a multiple of cfg.BK) and KP pool ids."""
    ka = sat.launch_args(cfg, 1, S, H, D, NW, KW + KP, scale, precision, q_dtype)
    p_bf16 = int(precision != "fp32")
    ns, grid, kw = sat.flash_launch(cfg, R, H, D, KW + KP, ka, p_bf16)
    kw = {k: v for k, v in kw.items() if k not in ("N", "K")}
    kw.update(NW=NW, KW=KW, KP=KP)
    return ns, grid, kw


def sparse_sink_attention_paged_triton(q, win, win_idx, pool_q, pool_s, addr, valid, sink, scale, *,
                                       out_dtype=None, precision="reference", config=None):
    """q [B, S, H, D]; win [B, NW, D] (bf16 window rows); win_idx [B, S, KW] ids into win (-1 empty); pool_q
    [P, D/2] uint8 E2M1 nibbles and pool_s [P, D/16] E4M3 scales of the NVFP4 pool; addr / valid [B, S, KP]: the
    picked entries' pool rows and which are real. Always runs the kernel (a "flash" config; default the one
    ``pick_config`` gives the row count)."""
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only

    H = q.shape[2]
    Hp = max(16, 1 << (H - 1).bit_length())
    if Hp != H:     # small models: zero query heads up to the MMA's smallest M, sliced off after
        pad = ((0, 0), (0, 0), (0, Hp - H), (0, 0))
        out = sparse_sink_attention_paged_triton(jnp.pad(q, pad), win, win_idx, pool_q, pool_s, addr, valid,
                                                 jnp.pad(sink, (0, Hp - H)), scale, out_dtype=out_dtype,
                                                 precision=precision, config=config)
        return out[:, :, :H]
    B, S, H, D = q.shape
    R = B * S
    cfg = sat.NAMED_CONFIGS[config] if isinstance(config, str) else (config or sat.pick_config(R))
    if cfg.kind != "flash":
        cfg = sat.NAMED_CONFIGS["flash_bk32"]
    sat.check_shapes(q, win_idx, D, min(cfg.DV, D))
    out_dtype = q.dtype if out_dtype is None else out_dtype
    iw = pad_window_ids(win_idx.astype(jnp.int32), cfg.BK)
    ia = jnp.where(valid, addr, -1).astype(jnp.int32)
    KW, KP, NW = iw.shape[-1], ia.shape[-1], win.shape[1]
    ns, grid, kw = launch_plan(cfg, R, H, D, KW, KP, scale, precision, q.dtype, S, NW)
    win = win.astype(jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16)
    sink = sink.astype(jnp.float32)
    args = (q, win, iw, _bytes(pool_q), _bytes(pool_s), ia)
    if ns == 1:
        return jt.triton_call(*args, sink, kernel=_paged_kernel,
                              out_shape=jax.ShapeDtypeStruct((B, S, H, D), out_dtype),
                              grid=grid, num_warps=cfg.warps, num_stages=cfg.stages, **kw)
    op, mp, lp = jt.triton_call(
        *args, kernel=_paged_split_kernel,
        out_shape=(jax.ShapeDtypeStruct((R, ns, H, D), jnp.float32), jax.ShapeDtypeStruct((R, ns, H), jnp.float32),
                   jax.ShapeDtypeStruct((R, ns, H), jnp.float32)),
        grid=grid, num_warps=cfg.warps, num_stages=cfg.stages, **kw)
    return sat.flash_combine(op, mp, lp, sink, (B, S, H, D), out_dtype)
