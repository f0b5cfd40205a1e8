"""Triton (jax-triton) sparse sink attention, same contract as ``sparse_attention.sparse_sink_attention_reference``.

STATUS (2026-11-30): v1 (``fused_dv128``: one program per (query row, 128 output channels)) passed
tests/gpu/test_sparse_attention.py on one H200 and was timed SLOWER than the jitted XLA reference at every decode
shape (0.39-0.73x, dsflash/kernels/NOTES.md). v2 adds the variants below; they are checked against the reference
in Triton's interpreter (``scripts/triton_interpret_sparse_attention.py``) and are timed per variant by
``python -m dsflash.bench kernels --ops attn``. v3 ("flash", below; 2026-12-01) beat XLA on the H200 from 128 query
rows (1.66-1.68x); the crossover in kernels/dispatch.py (``GATES["sparse_attention"]``) keeps smaller row counts on
XLA, where no variant won.

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
* "flash" (v3, 2026-12-01; passes tests/gpu on the H200, the model's kernel from 128 rows): grid (rows, NS); one pass with an online softmax: q [H, D] loaded
  once, each block of BK entries gathered ONCE ([BK, D], empty slots not read) for both S = q kv^T and
  O += bf16(P) kv, P rounded against the running max (so NOT bit-comparable with the reference: error band
  ``flash_bound`` below, derived there), fp32 l, sink at the end. NS = 1: final output from the kernel
  (``_flash_kernel``); NS > 1: fp32 partials (m, l, O) merged exactly by ``flash_combine``. NS per row count from
  ``flash_plan``. Head split (``AttnConfig.HS``, for few rows): grid (rows, NS, HS), each program H / HS of the
  heads (same math per head, same output / partial layout). Design, sm_90 compile numbers and predictions:
  dsflash/kernels/NOTES.md.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.rope import check_rope, rope_o, rope_q
from dsflash.kernels.rope_triton import _rope_tail, rope_tail_inplace


# ----------------------------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class AttnConfig:
    kind: str = "fused"   # "fused" | "split"
    BK: int = 64          # selected entries per loop step (MMA N of QK, K of P.V)
    DC: int = 64          # D chunk of the QK product
    DV: int = 512         # output channels per program (pass 2)
    CH: int = 0           # "split": entries per chunk (multiple of BK); 0 = pick from the row count (auto)
    NS: int = 0           # "flash" (v3): splits of the K entries per query row; 0 = pick from the row count (auto)
    HS: int = 1           # "flash": head groups per query row (grid (rows, NS, HS), H / HS heads = the MMA's M each;
                          # capped so that H / HS >= 16)
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
    # v3 (2026-12-01, timed on the H200 in run 11): one program per (query row, split), flash-style online softmax, all
    # H heads = the MMA's M, one gather of [BK, D] per block serves QK and P.V (K = V). Configs: see NOTES.md.
    "flash_bk32": AttnConfig(kind="flash", BK=32, NS=0, warps=8, stages=5),      # kv 2 blocks ahead (3 buffers)
    "flash_bk32_s7": AttnConfig(kind="flash", BK=32, NS=0, warps=8, stages=7),   # kv 3 blocks ahead (4 buffers)
    "flash_bk32_s3": AttnConfig(kind="flash", BK=32, NS=0, warps=8, stages=3),   # kv 1 block ahead
    "flash_bk64": AttnConfig(kind="flash", BK=64, NS=0, warps=8, stages=3),      # kv 1 block ahead (smem bound)
    "flash_bk64_s2": AttnConfig(kind="flash", BK=64, NS=0, warps=8, stages=2),   # + synchronous idx load
    "flash_bk32_ns1": AttnConfig(kind="flash", BK=32, NS=1, warps=8, stages=5),
    "flash_bk64_ns1": AttnConfig(kind="flash", BK=64, NS=1, warps=8, stages=3),
    "flash_bk32_ns2": AttnConfig(kind="flash", BK=32, NS=2, warps=8, stages=5),
    # prefill candidate (session 23): 16 warps = 4 warpgroups over the same [64, 512] accumulator, for the gathers'
    # latency; sm_90 compile 128 registers, 12 B of spills. Timed on an H100: 3.0x SLOWER than flash_bk64 at 4096 /
    # 16384 prefill rows (results/attn_prefill_20261207_h100_s23.json), kept as that measurement's name
    "flash_bk32_w16": AttnConfig(kind="flash", BK=32, NS=0, warps=16, stages=5),
    # v3 head split (2026-12-01, for 1-32 rows; not yet timed): grid (rows, NS, 4), 16 heads per program (M = 16:
    # mma.sync, not wgmma), so 4x the programs of flash_bk* at the same NS; each program gathers the same kv blocks
    # (the other 3 head groups' reads of them hit L2). NOTES.md "v3 head split".
    "flash_bk64_hs4": AttnConfig(kind="flash", BK=64, NS=0, HS=4, warps=4, stages=2),
    "flash_bk32_hs4": AttnConfig(kind="flash", BK=32, NS=0, HS=4, warps=4, stages=3),
}
# Shape -> variant used by ``sparse_sink_attention_triton(config=None)``: the first entry whose max_rows >= B*S.
# From the v3 H200 run (2026-12-01, NOTES.md "v3"): flash BK64 with 2 stages was fastest at 1 and 32 rows (0.054 /
# 0.074 ms, still slower than XLA there, so dispatch.GATES["sparse_attention"] starts at 128); at 128 and 192 rows the
# BK64 flash variants were within 3 % of each other (0.105-0.108 / 0.153-0.156 ms), flash_bk64 taken. Prefill rows
# (session 23, one H100, scripts/gpu_attn_prefill_probe.py, results/attn_prefill_20261207_h100_s23.json): flash_bk64_s2
# 1.480 -> 1.358 ms at 4096 rows and 5.674 -> 5.147 at 16384 against flash_bk64, the same output bits (same BK); Nsight
# Compute has flash_bk64 stalled on barriers first (1.83 a issue) at 17 % of the L2's throughput.
PICK_TABLE = (
    (32, "flash_bk64_s2"),
    (256, "flash_bk64"),
    (None, "flash_bk64_s2"),
)
SMS = 132                 # H200 SMs; "split" auto aims at >= 2 waves of programs
# RoPE in the one-split flash kernel (``_flash_kernel``'s RD; session 21): interpreter- and sm_90-checked, and on an
# H200 (session 22) its GPU test passed (191 of 8.4M elements differ from RoPE around it, rel 1.4e-5), but it is no
# win there (4096-token step 35.02 -> 35.45 ms, 16384 125.35 -> 124.17), so off: q / o rotate in XLA around it.
# ``sparse_sink_attention_triton(rope_in_kernel=True)`` and gpu_step_profile's variant "moeil_ropek" run it.
ROPE_IN_KERNEL = False
# RoPE around the kernels by ``rope_triton.rope_tail_inplace`` (session 23): q's and o's 64-channel tails rotated in
# their own buffers instead of XLA's concatenation that re-writes all of q and o (eight 0.61-ms fusions of the 16K
# prefill step on an H200). On since session 23 (one H100): tests/gpu/test_rope_triton.py 6 passed (0 bits differ from
# unfused fp32 arithmetic); ``gpu_step_profile --variants moeil_ropex,moeil_ropei``: 4096 tokens 37.62 -> 36.71 ms,
# 16384 127.09 -> 123.93, decode 32 x 6 8.55 -> 8.41 (results/step_profile_20261207_h100_s23_ropei.json).
ROPE_INPLACE = True
# The Gluon flash kernel (kernels/sparse_attention_gluon.py, session 25: S split over the warpgroups so QK is computed
# once; ids loaded one block ahead) for one-split launches from this many query rows (bf16, 64 heads, reference P
# rounding, the picked config); None = off. On since session 26 (one H100, gpu_attn_prefill_probe.py --no-paged,
# flash_bk64_s2 -> gluon_ov0): 2,048 rows 0.764 -> 0.778 ms (slower), 4,096 1.395 -> 1.322, 16,384 5.218 -> 4.414;
# the step (moeil -> moeil_gluon, Gluon from 257 rows) 4K prefill 37.24 -> 36.84 ms, 16K 123.61 -> 121.71
# (results/*_20261207_h100_s26_*). Below 4,096 rows it was not measured faster, so the Triton kernel keeps them.
GLUON_FROM_ROWS = 4096


def _gluon_available() -> bool:
    """Triton builds without Gluon (older than 3.5) keep the Triton kernel for every row count."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


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


# v3 ("flash") split planner. Cost model, in units of one 64-entry block (64 KB gathered, ~3 us at one SM's share
# of HBM bandwidth; its 8.4 MFLOP of QK + P.V take ~1.6 us at one SM's share of the measured 690 TFLOP/s and should
# hide under the load): a program costs its blocks + 1 (q, 64 KB, loaded once) + 1 more when it writes fp32
# partials (128 KB) instead of the final output; programs run one per SM (smem and registers, NOTES.md) in
# ceil(programs / SMS) waves (programs = rows * NS * HS; a head group loads 1 / HS of q and writes 1 / HS of the
# partials, its kv blocks are the same); splitting adds an XLA combine of ~2 blocks + the partials' read
# (rows * NS * 128 KB at the whole GPU's bandwidth, 0.017 blocks each).
FLASH_Q_COST, FLASH_PARTIAL_COST, FLASH_COMBINE_COST, FLASH_PARTIAL_READ = 1.0, 1.0, 2.0, 0.017


def flash_plan(cfg: AttnConfig, rows: int, K: int, hs: int = 0):
    """(NS splits per query row, BPS blocks of BK entries per split) of a "flash" config: cfg.NS if set (capped
    at the block count), else the split with the least modelled time (above), ties to fewer splits. ``hs``: head
    groups per row as launched (``flash_heads``; 0 = cfg.HS)."""
    hs = hs or cfg.HS
    nb = max(1, -(-K // cfg.BK))
    if cfg.NS:
        bps = -(-nb // min(cfg.NS, nb))
        return -(-nb // bps), bps
    best = None
    for bps in range(nb, 0, -1):
        ns = -(-nb // bps)
        if best is not None and ns == best[1]:
            continue
        waves = -(-rows * ns * hs // SMS)
        cost = waves * (bps * cfg.BK / 64 + (FLASH_Q_COST + (FLASH_PARTIAL_COST if ns > 1 else 0.0)) / hs)
        if ns > 1:
            cost += FLASH_COMBINE_COST + FLASH_PARTIAL_READ * rows * ns
        if best is None or cost < best[0] - 1e-9:
            best = (cost, ns, bps)
    return best[1], best[2]


def flash_combine(op, mp, lp, sink, out_shape, out_dtype):
    """Exact fp32 merge of the v3 split partials: M = max_s m_s, w_s = exp(m_s - M),
    o = sum_s w_s acc_s / (sum_s w_s l_s + exp(sink - M)). A row with no valid entry: M = -1e30, acc = l = 0 -> 0."""
    M = jnp.max(mp, axis=1)                                                     # [R, H]
    w = jnp.exp(mp - M[:, None, :])                                             # [R, NS, H]
    den = jnp.sum(w * lp, axis=1) + jnp.exp(sink.astype(jnp.float32)[None, :] - M)
    o = jnp.sum(w[..., None] * op, axis=1) / den[..., None]                     # one fp32 reduction fusion
    return o.reshape(out_shape).astype(out_dtype)


# v3 error band. v3 rounds each probability to bf16 relative to the RUNNING max m_j of its split (then rescales by
# exp(m_j - m) in fp32), the reference relative to the global max m. Either way the rounded term is
# p_e (1 + d_e) with |d_e| <= 2^-8 (RNE to 8 significant bits), so per output element (h, c):
#   |o_v3 - o_ref|  <= 2 * 2^-8 * A + slack,   |o_v3 - o_fp32| <= 2^-8 * A + slack,
#   A[h, c] = sum_e p_e |kv_e[c]| / den   (p_e = exp(s_e - m), den incl. the sink; fp32),
# slack = FLASH_SLACK * A + 1e-5 * |o| + 1e-30 (fp32 exp / rescale products / MMA vs XLA summation order, orders of
# magnitude below 2^-8). Where entries after the split's max is reached round exactly as the reference does (same m),
# the typical error is far below the bound: RMS of one rounding ~2^-9.3, so the whole-tensor relative error is
# expected around 1e-3 (<= 5e-3 asserted) for the bench's random inputs.
P_ROUND = 2.0 ** -8
FLASH_SLACK = 1e-4


def flash_weights_abs(q, kv, idx, sink, scale):
    """A [B, S, H, D] fp32 of the v3 error band above (pure JAX, fp32 HIGHEST)."""
    q = q.astype(jnp.float32)
    kv = kv.astype(jnp.float32)
    valid = idx >= 0
    rows = jax.vmap(lambda kvb, ib: kvb[ib])(kv, jnp.where(valid, idx, 0))               # [B, S, K, D]
    hp = jax.lax.Precision.HIGHEST
    lg = jnp.einsum("bshd,bskd->bshk", q, rows, precision=hp) * jnp.float32(scale)
    lg = jnp.where(valid[:, :, None, :], lg, -jnp.inf)
    m = jnp.maximum(jnp.max(lg, axis=-1, keepdims=True), jnp.float32(-1e30))
    p = jnp.exp(lg - m)
    den = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink.astype(jnp.float32)[None, None, :, None] - m)
    return jnp.einsum("bshk,bskd->bshd", p, jnp.abs(rows), precision=hp) / den


def flash_bound(A, ref, roundings):
    """Per-element tolerance: ``roundings`` = 2 vs the bf16-P reference, 1 vs the fp32 reference, 0 when the kernel
    keeps P in fp32 (precision="fp32")."""
    return (roundings * P_ROUND + FLASH_SLACK) * A + 1e-5 * abs(ref) + 1e-30


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


# ----------------------------------------------------------------------------------------------- v3: "flash"
@triton.jit
def _flash_body(q_ptr, kv_ptr, idx_ptr, qt_ptr, row, sp, offs_h, S: tl.constexpr, N: tl.constexpr,
                H: tl.constexpr, D: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr, BK: tl.constexpr,
                BPS: tl.constexpr, HG: tl.constexpr, P_BF16: tl.constexpr, IEEE: tl.constexpr, RD: tl.constexpr):
    """Online softmax of query row ``row``, heads ``offs_h`` (HG of the H), over its split ``sp`` (blocks
    [sp * BPS, sp * BPS + BPS) of BK entries): (m [HG] running max, >= -1e30; l [HG] fp32 sum of exp(s - m);
    acc [HG, D] fp32 sum of bf16(exp(s - m_j)) * kv rescaled to m). q [HG, D] is loaded once (RD > 0: its last RD
    channels from ``qt_ptr``'s rows, where the caller put them rotated; one load either way); each block gathers
    kv[idx] [BK, D] once for both products."""
    offs_d = tl.arange(0, D)
    q_off = row * (H * D) + offs_h[:, None] * D + offs_d[None, :]
    if RD > 0:
        q = tl.load(tl.where(offs_d[None, :] >= D - RD, qt_ptr + q_off, q_ptr + q_off))
    else:
        q = tl.load(q_ptr + q_off)
    if IEEE:
        q = q.to(tl.float32)
    kv_base = kv_ptr + (row // S) * (N * D)
    i_base = idx_ptr + row * K
    m = tl.full((HG,), -1e30, tl.float32)         # = the reference's clamp: a row with no valid entry keeps -1e30
    l = tl.zeros((HG,), tl.float32)
    acc = tl.zeros((HG, D), tl.float32)
    # static trip count (a tensor loop bound breaks Triton 3.6's interpreter): blocks past K in the last split of a
    # ragged split are all masked (nothing loaded, p = 0); they cost MMA time only, in a program no longer than
    # the others of its wave
    for j in tl.range(0, BPS):
        offs = (sp * BPS + j) * BK + tl.arange(0, BK)
        ids = tl.load(i_base + offs, mask=offs < K, other=-1)
        valid = ids >= 0
        safe = tl.minimum(tl.where(valid, ids, 0), N - 1).to(tl.int64)
        # empty slots are not read (zero-filled); their logit is forced to -inf below anyway
        kv = tl.load(kv_base + safe[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        s = tl.where(valid[None, :], s * SCALE, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)                 # 1 while the max does not grow; exp(-1e30 - m) = 0 never NaN
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if P_BF16:
            if IEEE:
                acc = tl.dot(_rne_bf16(p).to(tl.float32), kv.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(_rne_bf16(p), kv.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(p, kv.to(tl.float32), acc, input_precision="ieee")
        m = m_new
    return m, l, acc


@triton.jit
def _flash_heads(HG: tl.constexpr, H: tl.constexpr):
    """The heads of this program: all H (HG == H), else head group program_id(2) of HG heads."""
    if HG == H:
        offs = tl.arange(0, H)
    else:
        offs = tl.program_id(2) * HG + tl.arange(0, HG)
    return offs


@triton.jit
def _flash_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, cos_ptr, sin_ptr, o_ptr,
                  S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                  SCALE: tl.constexpr, BK: tl.constexpr, BPS: tl.constexpr, HG: tl.constexpr, P_BF16: tl.constexpr,
                  IEEE: tl.constexpr, RD: tl.constexpr = 0, ROUND_O: tl.constexpr = 1):
    """NS = 1: grid (rows,) (or (rows, 1, H / HG)), the whole row (its HG heads) in one program,
    o = acc / (l + exp(sink - m)) stored directly. RD > 0 (RoPE, ``rope.rotate_tail``; o has q's dtype): q's tails
    rotated into o's tails first (scratch the final store overwrites), and o's tails rotated back in place after
    the store, each through ``_rope_tail`` with barriers (a CTA's global writes are visible to its threads after
    one)."""
    row = tl.program_id(0).to(tl.int64)
    offs_h = _flash_heads(HG, H)
    if RD > 0:
        rows = row * (H * D) + offs_h[:, None] * D
        tail = (D - RD) + tl.arange(0, RD)[None, :]
        qt = _rope_tail(q_ptr + rows, cos_ptr + row * (RD // 2), sin_ptr + row * (RD // 2), D, RD, False, 1 - IEEE)
        tl.store(o_ptr + rows + tail, qt.to(o_ptr.dtype.element_ty))
        tl.debug_barrier()
    m, l, acc = _flash_body(q_ptr, kv_ptr, idx_ptr, o_ptr, row, 0, offs_h, S, N, H, D, K, SCALE, BK, BPS, HG, P_BF16,
                            IEEE, RD)
    den = l + tl.exp(tl.load(sink_ptr + offs_h) - m)      # inf for a row with no valid entry: 0 / inf = 0
    o = acc / den[:, None]
    # the row's offsets computed here, not before the loop: kept live across it they cost a register (spills, sm_90)
    tl.store(o_ptr + row * (H * D) + offs_h[:, None] * D + tl.arange(0, D)[None, :], o.to(o_ptr.dtype.element_ty))
    if RD > 0:
        tl.debug_barrier()
        rows = row * (H * D) + offs_h[:, None] * D
        tail = (D - RD) + tl.arange(0, RD)[None, :]
        ot = _rope_tail(o_ptr + rows, cos_ptr + row * (RD // 2), sin_ptr + row * (RD // 2), D, RD, True, ROUND_O)
        tl.debug_barrier()                                 # every pair partner read before any tail is rewritten
        tl.store(o_ptr + rows + tail, ot.to(o_ptr.dtype.element_ty))


@triton.jit
def _flash_split_kernel(q_ptr, kv_ptr, idx_ptr, op_ptr, mp_ptr, lp_ptr,
                        S: tl.constexpr, N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                        SCALE: tl.constexpr, BK: tl.constexpr, BPS: tl.constexpr, NS: tl.constexpr,
                        HG: tl.constexpr, P_BF16: tl.constexpr, IEEE: tl.constexpr):
    """NS > 1 (flash-decoding): grid (rows, NS) (or (rows, NS, H / HG)); partials (m, l, acc) fp32 in the same
    [rows, NS, H(, D)] layout for any head split, merged by ``flash_combine`` (RoPE, if any, is the caller's, in
    XLA)."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    offs_h = _flash_heads(HG, H)
    m, l, acc = _flash_body(q_ptr, kv_ptr, idx_ptr, q_ptr, row, sp, offs_h, S, N, H, D, K, SCALE, BK, BPS, HG, P_BF16,
                            IEEE, 0)
    base = row * NS + sp
    tl.store(op_ptr + base * (H * D) + offs_h[:, None] * D + tl.arange(0, D)[None, :], acc)
    tl.store(mp_ptr + base * H + offs_h, m)
    tl.store(lp_ptr + base * H + offs_h, l)


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


def flash_heads(cfg: AttnConfig, H: int) -> int:
    """Head groups per query row as launched: cfg.HS capped so that each group keeps >= 16 heads (the MMA's M)."""
    return max(1, min(cfg.HS, H // 16))


def flash_launch(cfg: AttnConfig, R, H, D, K, ka, p_bf16):
    """(NS, grid, kernel constexprs) of a "flash" launch: ``_flash_kernel`` when NS == 1, else
    ``_flash_split_kernel`` + ``flash_combine`` (shared by the wrapper and the interpreter script). A head split
    adds the grid's third axis; the outputs / partials keep their layout."""
    if D & (D - 1):
        raise ValueError(f"the flash kernel needs a power-of-two D, got {D}")
    hs = flash_heads(cfg, H)
    ns, bps = flash_plan(cfg, R, K, hs)
    kw = {k: v for k, v in ka.items() if k != "DC"}
    kw.update(BPS=bps, HG=H // hs, P_BF16=p_bf16)
    if ns > 1:
        kw["NS"] = ns
    return ns, ((R, ns, hs) if hs > 1 else (R, ns) if ns > 1 else (R,)), kw


def split_combine(mpart, accp, denp, sink, out_shape, out_dtype):
    """XLA combine of the split kernel's partials: o = sum_c accp / (sum_c denp + exp(sink - m))."""
    m = jnp.max(mpart, axis=1)                                                 # [R, H], >= -1e30
    den = jnp.sum(denp, axis=1) + jnp.exp(sink.astype(jnp.float32)[None, :] - m)
    o = jnp.sum(accp, axis=1) / den[..., None]
    return o.reshape(out_shape).astype(out_dtype)


def sparse_sink_attention_triton(q, kv, idx, sink, scale, *, out_dtype=None, precision="reference",
                                 config=None, block_k=None, block_dv=None, rope=None, rope_in_kernel=None):
    """Always runs the kernel (no XLA fallback): tests, the bench and ``sparse_attention.sparse_sink_attention``
    (which decides through ``dispatch.use_triton``) call this. ``config``: an AttnConfig, a NAMED_CONFIGS key, or None
    (``pick_config(B*S)``); ``block_k`` / ``block_dv`` override BK / DV. ``rope`` (cos, sin [B, S, rd/2]): as
    ``sparse_attention.sparse_sink_attention``'s; with ``rope_in_kernel`` (default ``ROPE_IN_KERNEL``) the one-split
    "flash" kernel applies it to q's and o's tails itself (``_flash_kernel``) when o has q's dtype; everything else
    rotates in XLA around the kernels."""
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only

    check_rope(rope, q)
    H = q.shape[2]
    Hp = max(16, 1 << (H - 1).bit_length())
    if Hp != H:     # small models (tiny / demo: 4 heads): zero query heads up to the MMA's smallest M, sliced off after
        pad = ((0, 0), (0, 0), (0, Hp - H), (0, 0))
        out = sparse_sink_attention_triton(jnp.pad(q, pad), kv, idx, jnp.pad(sink, (0, Hp - H)), scale,
                                           out_dtype=out_dtype, precision=precision, config=config,
                                           block_k=block_k, block_dv=block_dv, rope=rope, rope_in_kernel=rope_in_kernel)
        return out[:, :, :H]
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
    ns, grid, kw = flash_launch(cfg, R, H, D, K, ka, p_bf16) if cfg.kind == "flash" else (0, None, None)
    in_kernel = ROPE_IN_KERNEL if rope_in_kernel is None else rope_in_kernel
    if rope is not None and not (in_kernel and ns == 1 and jnp.dtype(out_dtype) == q.dtype):
        # RoPE around the kernel: every launch but the one-split flash kernel asked to do it itself
        if ROPE_INPLACE:
            o = sparse_sink_attention_triton(rope_tail_inplace(q, rope), kv, idx, sink, scale, out_dtype=out_dtype,
                                             precision=precision, config=cfg)
            return rope_tail_inplace(o, rope, inverse=True)
        return rope_o(sparse_sink_attention_triton(rope_q(q, rope), kv, idx, sink, scale, out_dtype=out_dtype,
                                                   precision=precision, config=cfg), rope)
    idx = idx.astype(jnp.int32)
    sink = sink.astype(jnp.float32)
    bf16 = q.dtype == kv.dtype == jnp.dtype(out_dtype) == jnp.bfloat16
    if (GLUON_FROM_ROWS is not None and R >= GLUON_FROM_ROWS and cfg == pick_config(R) and cfg.kind == "flash"
            and ns == 1 and rope is None and H == 64 and D == 512 and p_bf16 and bf16 and _gluon_available()):
        from dsflash.kernels.sparse_attention_gluon import flash_prefill_gluon
        return flash_prefill_gluon(q, kv, idx, sink, scale)
    if cfg.kind == "flash":
        if ns == 1:
            if rope is None:
                cs = (jnp.zeros((1,), jnp.float32),) * 2      # unread (RD = 0)
                kw.update(RD=0, ROUND_O=1)    # named, though the launcher fills in defaults too
            else:                                          # in the kernel (its docstring): o is q's scratch
                cs = tuple(t.astype(jnp.float32).reshape(R, -1) for t in rope)
                kw.update(RD=2 * cs[0].shape[1], ROUND_O=int(jnp.dtype(out_dtype) != jnp.float32))
            return jt.triton_call(
                q, kv, idx, sink, *cs, kernel=_flash_kernel, out_shape=jax.ShapeDtypeStruct((B, S, H, D), out_dtype),
                grid=grid, num_warps=cfg.warps, num_stages=cfg.stages, **kw)
        op, mp, lp = jt.triton_call(
            q, kv, idx, kernel=_flash_split_kernel,
            out_shape=(jax.ShapeDtypeStruct((R, ns, H, D), jnp.float32), jax.ShapeDtypeStruct((R, ns, H), jnp.float32),
                       jax.ShapeDtypeStruct((R, ns, H), jnp.float32)),
            grid=grid, num_warps=cfg.warps, num_stages=cfg.stages, **kw)
        return flash_combine(op, mp, lp, sink, (B, S, H, D), out_dtype)
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
