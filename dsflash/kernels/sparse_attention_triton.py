"""Triton (jax-triton) sparse sink attention, same contract as ``sparse_attention.sparse_sink_attention_reference``.

STATUS (2026-11-30): v1 (``fused_dv128``: one program per (query row, 128 output channels)) passed
tests/gpu/test_sparse_attention.py on one H200 and was timed SLOWER than the jitted XLA reference at every decode
shape (0.39-0.73x, dsflash/kernels/NOTES.md). v2 adds the variants below; they are checked against the reference
in Triton's interpreter (``scripts/triton_interpret_sparse_attention.py``) and are timed per variant by
``python -m dsflash.bench kernels --ops attn``. ``sparse_attention.prefers_xla`` keeps the model on XLA until a GPU
measurement says a variant wins at a shape.

Numerics (exact two-pass, so P is rounded exactly as the reference rounds it): per query row and head,
m = max(max_e s_e, -1e30) over ALL K selected entries first, then p = exp(s - m) (fp32), den = sum p (fp32),
P rounded to bf16 (integer RNE, the same bits as the hardware cast) for the P.V MMA with fp32 accumulation,
o = acc / (den + exp(sink - m)). Entries with idx < 0 contribute nothing: their gather index is clamped to row 0
(always readable) and their logit is forced to -inf before any max/exp; ids >= N are clamped to N - 1 like XLA's
gather. A row with no valid entry gives 0. H heads (64 in V4.1) share the gathered latent row (MQA), so each KV
row gathered serves all heads: logits [H, BK] = q[H, D] . kv[idx, D]^T is one MMA with M = H.

Kinds (``AttnConfig.kind``):
* "fused": grid (rows, D / DV). Pass 1 (max) and pass 2 (P.V for DV channels) in one program; the QK product is
  computed 2 * D / DV times per row (DV = 512: twice; v1's DV = 128: 8 times). Best when rows * D / DV fills
  the GPU (large B*S).
* "split" (flash-decoding with an exact global max): the K entries are cut into NS chunks of CH entries.
  Kernel 1, grid (rows, NS): per-chunk per-head maxima of the scores -> mpart [rows, NS, H] fp32.
  Kernel 2, grid (rows, NS, D / DV): m = max over the NS chunk maxima (read in-kernel; the max is exact, so it
  equals the reference's m bit for bit), scores recomputed for the chunk, p = exp(s - m), partial
  den [rows, NS, H] and partial P.V [rows, NS, H, D] fp32. Combine in XLA: sum over chunks,
  + exp(sink - m), divide. More programs for few rows (B = 1: 1 row -> NS * D / DV programs) at the cost of
  NS * H * D * 4 bytes of partials per row (written once, read once).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class AttnConfig:
    kind: str = "fused"   # "fused" | "split"
    BK: int = 64          # selected entries per loop step (MMA N of QK, K of P.V)
    DC: int = 64          # D chunk of the QK product
    DV: int = 512         # output channels per program (pass 2)
    CH: int = 0           # "split": entries per chunk (multiple of BK); 0 = pick from the row count (auto)
    warps: int = 8
    stages: int = 2


NAMED_CONFIGS = {
    "fused_dv128": AttnConfig(BK=32, DV=128, warps=4),              # v1 (timed 2026-11-30, table in NOTES.md)
    "fused_dv256": AttnConfig(BK=64, DV=256, warps=8, stages=1),    # stages=2 asked 262 KB of smem (> 227 KB)
    "fused_dv256_bk32": AttnConfig(BK=32, DV=256, warps=8),
    "fused_dv512": AttnConfig(BK=64, DV=512, warps=8, stages=1),    # stages=2: 328 KB smem, failed to launch
    "fused_dv512_bk32": AttnConfig(BK=32, DV=512, warps=8),
    "split_ch128_dv128": AttnConfig(kind="split", BK=64, DV=128, CH=128, warps=4),
    "split_ch64_dv128": AttnConfig(kind="split", BK=64, DV=128, CH=64, warps=4),
    "split_ch128_dv512": AttnConfig(kind="split", BK=64, DV=512, CH=128, warps=8, stages=1),
    "split_auto_dv256": AttnConfig(kind="split", BK=64, DV=256, CH=0, warps=8, stages=1),
}
# Shape -> variant used by ``sparse_sink_attention_triton(config=None)``: the first entry whose max_rows >= B*S.
# From the first v2 H200 run (2026-11-30, commit 270df7c, NOTES.md): the fastest variant that ran at each measured
# row count (1: split CH64 0.062 ms; 32: split CH128 0.107; 128 and 192: fused DV512 BK32 0.190 / 0.299). All still
# slower than XLA there, hence sparse_attention.TRITON_ROWS stays empty. Edit after the next GPU run.
PICK_TABLE = (
    (1, "split_ch64_dv128"),
    (32, "split_ch128_dv128"),
    (None, "fused_dv512_bk32"),
)
SMS = 132                 # H200 SMs; "split" auto aims at >= 2 waves of programs


def pick_config(rows: int) -> AttnConfig:
    for max_rows, name in PICK_TABLE:
        if max_rows is None or rows <= max_rows:
            return NAMED_CONFIGS[name]
    raise AssertionError("PICK_TABLE must end with a catch-all")


def split_chunk(cfg: AttnConfig, rows: int, D: int, K: int) -> int:
    """Entries per chunk of a "split" config: CH, or (auto) the largest multiple of BK giving rows * NS * D/DV
    >= 2 * SMS programs (at least one BK block per chunk)."""
    if cfg.CH:
        if cfg.CH % cfg.BK:
            raise ValueError(f"CH={cfg.CH} must be a multiple of BK={cfg.BK}")
        return cfg.CH
    per_row = max(1, -(-2 * SMS // max(1, rows * (D // cfg.DV))))          # chunks wanted per row
    ch = -(-K // per_row)
    return max(cfg.BK, -(-ch // cfg.BK) * cfg.BK)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _rne_bf16(p):
    # integer RNE to bf16 (exact same result as the hardware cast; Triton's interpreter truncates); p >= 0, finite
    u = p.to(tl.uint32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _block(i_base, k0, k_hi, N: tl.constexpr, BK: tl.constexpr):
    """Ids of one block of BK entries [k0, k0 + BK) cut at k_hi: (valid mask, safe int64 row ids)."""
    offs = k0 + tl.arange(0, BK)
    ids = tl.load(i_base + offs, mask=offs < k_hi, other=-1)
    valid = ids >= 0
    safe = tl.minimum(tl.where(valid, ids, 0), N - 1).to(tl.int64)
    return valid, safe


@triton.jit
def _scores(q_base, kv_base, valid, safe, H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
            DC: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr):
    """s [H, BK] fp32 = (q . kv[safe]^T) * scale, -inf where not valid (garbage never reaches max/exp)."""
    offs_h = tl.arange(0, H)
    offs_c = tl.arange(0, DC)
    s = tl.zeros((H, BK), tl.float32)
    for d0 in tl.static_range(0, D, DC):
        qc = tl.load(q_base + offs_h[:, None] * D + d0 + offs_c[None, :])
        kc = tl.load(kv_base + safe[:, None] * D + d0 + offs_c[None, :])
        s += _mm(qc, tl.trans(kc), IEEE)
    return tl.where(valid[None, :], s * SCALE, float("-inf"))


@triton.jit
def _max_pass(q_base, kv_base, i_base, k_lo, k_hi, NB: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
              D: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr):
    # NB = blocks of BK entries from k_lo (a static trip count; entries >= k_hi are masked)
    m = tl.full((H,), -1e30, tl.float32)
    for j in tl.range(0, NB):
        k0 = k_lo + j * BK
        valid, safe = _block(i_base, k0, k_hi, N, BK)
        s = _scores(q_base, kv_base, valid, safe, H, D, BK, DC, SCALE, IEEE)
        m = tl.maximum(m, tl.max(s, axis=1))
    return m


@triton.jit
def _pv_pass(q_base, kv_base, i_base, k_lo, k_hi, m, offs_v, NB: tl.constexpr, N: tl.constexpr,
             H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr, DV: tl.constexpr, SCALE: tl.constexpr,
             P_BF16: tl.constexpr, IEEE: tl.constexpr):
    acc = tl.zeros((H, DV), tl.float32)
    den = tl.zeros((H,), tl.float32)
    for j in tl.range(0, NB):
        k0 = k_lo + j * BK
        valid, safe = _block(i_base, k0, k_hi, N, BK)
        s = _scores(q_base, kv_base, valid, safe, H, D, BK, DC, SCALE, IEEE)
        p = tl.exp(s - m[:, None])
        den += tl.sum(p, axis=1)
        v = tl.load(kv_base + safe[:, None] * D + offs_v[None, :])
        if P_BF16:
            acc += _mm(_rne_bf16(p), v.to(tl.bfloat16), IEEE)
        else:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc, den


@triton.jit
def _fused_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr,
                  S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                  SCALE: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr, DV: tl.constexpr,
                  P_BF16: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dv = tl.program_id(1)
    q_base = q_ptr + row * (H * D)
    kv_base = kv_ptr + (row // S) * (N * D)
    i_base = idx_ptr + row * K
    m = _max_pass(q_base, kv_base, i_base, 0, K, (K + BK - 1) // BK, N, H, D, BK, DC, SCALE, IEEE)
    offs_v = dv * DV + tl.arange(0, DV)
    acc, den = _pv_pass(q_base, kv_base, i_base, 0, K, m, offs_v, (K + BK - 1) // BK, N, H, D, BK, DC, DV, SCALE,
                        P_BF16, IEEE)
    offs_h = tl.arange(0, H)
    den += tl.exp(tl.load(sink_ptr + offs_h) - m)
    o = acc / den[:, None]
    tl.store(o_ptr + row * (H * D) + offs_h[:, None] * D + offs_v[None, :], o.to(o_ptr.dtype.element_ty))


@triton.jit
def _chunk_max_kernel(q_ptr, kv_ptr, idx_ptr, mpart_ptr,
                      S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                      SCALE: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr, CH: tl.constexpr,
                      NS: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k_lo = c * CH
    k_hi = tl.minimum(k_lo + CH, K)
    m = _max_pass(q_ptr + row * (H * D), kv_ptr + (row // S) * (N * D), idx_ptr + row * K, k_lo, k_hi,
                  CH // BK, N, H, D, BK, DC, SCALE, IEEE)
    tl.store(mpart_ptr + (row * NS + c) * H + tl.arange(0, H), m)


@triton.jit
def _chunk_pv_kernel(q_ptr, kv_ptr, idx_ptr, mpart_ptr, accp_ptr, denp_ptr,
                     S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                     SCALE: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr, DV: tl.constexpr,
                     CH: tl.constexpr, NS: tl.constexpr, P_BF16: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    dv = tl.program_id(2)
    offs_h = tl.arange(0, H)
    m = tl.full((H,), -1e30, tl.float32)
    for j in tl.static_range(NS):                      # the row's global max: max of the chunk maxima (exact)
        m = tl.maximum(m, tl.load(mpart_ptr + (row * NS + j) * H + offs_h))
    k_lo = c * CH
    k_hi = tl.minimum(k_lo + CH, K)
    offs_v = dv * DV + tl.arange(0, DV)
    acc, den = _pv_pass(q_ptr + row * (H * D), kv_ptr + (row // S) * (N * D), idx_ptr + row * K, k_lo, k_hi,
                        m, offs_v, CH // BK, N, H, D, BK, DC, DV, SCALE, P_BF16, IEEE)
    base = row * NS + c
    tl.store(accp_ptr + base * (H * D) + offs_h[:, None] * D + offs_v[None, :], acc)
    tl.store(denp_ptr + base * H + offs_h, den, mask=(offs_h < H) & (dv == 0))


# ----------------------------------------------------------------------------------------------- wrappers
def check_shapes(q, idx, D, dv):
    H = q.shape[2]
    if H & (H - 1) or H < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two head count >= 16, got {H}")
    if D % dv or D % 32:
        raise ValueError(f"D={D} must be a multiple of DV={dv} and of 32")


def launch_args(cfg: AttnConfig, B, S, H, D, N, K, scale, precision, q_dtype):
    """Constexprs shared by the kernels (also used by the interpreter script)."""
    dc = cfg.DC if D % cfg.DC == 0 else 32
    return dict(S=S, N=N, H=H, D=D, K=K, SCALE=float(scale), BK=cfg.BK, DC=dc,
                IEEE=int(q_dtype == jnp.float32))


def split_combine(mpart, accp, denp, sink, out_shape, out_dtype):
    """XLA combine of the split kernel's partials: o = sum_c accp / (sum_c denp + exp(sink - m))."""
    m = jnp.max(mpart, axis=1)                                                 # [R, H], >= -1e30
    den = jnp.sum(denp, axis=1) + jnp.exp(sink.astype(jnp.float32)[None, :] - m)
    o = jnp.sum(accp, axis=1) / den[..., None]
    return o.reshape(out_shape).astype(out_dtype)


def sparse_sink_attention_triton(q, kv, idx, sink, scale, *, out_dtype=None, precision="reference",
                                 config=None, block_k=None, block_dv=None):
    """Always runs the kernel (no XLA fallback): tests, the bench and ``sparse_attention.sparse_sink_attention``
    (which decides with ``prefers_xla``) call this. ``config``: an AttnConfig, a NAMED_CONFIGS key, or None
    (``pick_config(B*S)``); ``block_k`` / ``block_dv`` override BK / DV."""
    import jax_triton as jt  # lazy: GPU only

    B, S, H, D = q.shape
    N = kv.shape[1]
    K = idx.shape[2]
    R = B * S
    out_dtype = q.dtype if out_dtype is None else out_dtype
    cfg = NAMED_CONFIGS[config] if isinstance(config, str) else (config or pick_config(R))
    if block_k:
        cfg = dataclasses.replace(cfg, BK=block_k)
    if block_dv:
        cfg = dataclasses.replace(cfg, DV=block_dv)
    dv = min(cfg.DV, D)
    check_shapes(q, idx, D, dv)
    ka = launch_args(cfg, B, S, H, D, N, K, scale, precision, q.dtype)
    p_bf16 = int(precision != "fp32")
    idx = idx.astype(jnp.int32)
    sink = sink.astype(jnp.float32)
    if cfg.kind == "fused":
        return jt.triton_call(
            q, kv, idx, sink, kernel=_fused_kernel,
            out_shape=jax.ShapeDtypeStruct((B, S, H, D), out_dtype),
            grid=(R, D // dv), num_warps=cfg.warps, num_stages=cfg.stages, DV=dv, P_BF16=p_bf16, **ka)
    if cfg.kind != "split":
        raise ValueError(f"unknown kind {cfg.kind!r}")
    ch = split_chunk(cfg, R, D, K)
    ns = -(-K // ch)
    mpart = jt.triton_call(
        q, kv, idx, kernel=_chunk_max_kernel,
        out_shape=jax.ShapeDtypeStruct((R, ns, H), jnp.float32),
        grid=(R, ns), num_warps=min(cfg.warps, 4), num_stages=cfg.stages, CH=ch, NS=ns, **ka)
    accp, denp = jt.triton_call(
        q, kv, idx, mpart, kernel=_chunk_pv_kernel,
        out_shape=(jax.ShapeDtypeStruct((R, ns, H, D), jnp.float32), jax.ShapeDtypeStruct((R, ns, H), jnp.float32)),
        grid=(R, ns, D // dv), num_warps=cfg.warps, num_stages=cfg.stages, DV=dv, CH=ch, NS=ns, P_BF16=p_bf16,
        **ka)
    return split_combine(mpart, accp, denp, sink, (B, S, H, D), out_dtype)
