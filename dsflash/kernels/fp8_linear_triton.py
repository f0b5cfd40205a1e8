"""Triton (jax-triton) dense FP8 linear: y [M, N] = x [M, K] . dequant(W [N, K] E4M3, UE8M0 32x32 scales)^T.

Same contract as ``fp8_linear.fp8_linear_reference`` ("reference" and "bf16" precisions). Checked in Triton's
interpreter (scripts/triton_interpret_fp8_linear.py), compiled for sm_90 on a CPU host
(scripts/sm90_compile_fp8_linear.py), and on an H200 (2026-12-02: tests/gpu/test_fp8_linear.py, loop timings, the
whole step); ``layers.linear_fp8`` runs it where ``dispatch.GATES["fp8_linear"]`` says.

How it works
------------
* Grid (row tiles, N / BN, KS); the row-tile axis varies fastest, so the programs that share a weight slice run
  together (their re-reads hit L2). Each program owns BN output features and one K chunk of K / KS.
* Weights: BK contiguous E4M3 bytes per row (16-byte vector loads), one UE8M0 byte per (row, 32-wide K group);
  E4M3 -> fp32 (exact) times 2^(s - 127) (exact: a power of two, normal range) -> bf16 (exact: 4 significant bits)
  in registers. The weight is read once from HBM per row tile, 1 byte per element + 1/1024 of scales.
* Activations ("reference"): ``ACT_RT`` 1: the bf16 x tile is FP8-round-tripped per 32 in registers exactly as
  ``quant.fp8_roundtrip`` (amax, pow2 scale by bit arithmetic, exact 1/s, NaN-propagating clamp, E4M3 RNE in fp32
  arithmetic) -- fewer bytes than a separate XLA round trip (which reads x, writes a bf16 copy that the kernel reads
  again) and one launch less, at the price of redoing the round trip of the x tile in each of the N / BN programs.
  ``act_rt="auto"`` (default) does it in-kernel for row tiles of <= 16 rows and in XLA above (``act_rt_in_kernel``
  says why); "decode_krt" / "decode_xrt" force one or the other for the GPU A/B.
* MMA: bf16 x bf16 -> fp32 accumulation (every product exact; only the fp32 summation order differs from XLA's).
  ``swap`` (decode): acc^T [BN, BM] = W [BN, BK] . x^T [BK, BM], the weights as the left operand (Hopper wgmma reads
  it from registers, the BN weight rows fill its M = 64, the few token rows are its N >= 16; BM < 16 would give
  mma.sync). Not swapped (prefill, BM 128): acc [BM, BN] = x . W^T.
* KS > 1: fp32 partials [KS, M, N], summed in the fixed order ks = 0, 1, ... by ``_fp8_linear_reduce``, then rounded
  to bf16 once. KS is chosen by ``plan`` so that row tiles x N / BN x KS >= ``target_programs`` (132 SMs).
  ``reduce="last"`` (experimental, session 27): the same sum in the same order by each tile's last program to
  arrive (``_fp8_linear_lastred_kernel``, arrival counters zeroed by jax-triton). Measured slower (session 28, H100):
  jax-triton zeroes the counters with a launch of its own, so the launch count does not fall.
* ``DECODE`` 0 is the interpreter mode (Triton's interpreter mis-converts fp8 -> bf16 and its bf16 dot is wrong):
  an fp32 "ieee" dot of the same exact values (the same math). 1 on a GPU.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.triton_common import _dot_bf16, _e8m0_to_f32, _round_bf16, _round_e4m3
from dsflash import quant


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _fp8_rt(xf, BM: tl.constexpr, BK: tl.constexpr):
    """fp32 [BM, BK] holding bf16 values -> their FP8 E4M3 per-32 round trip (quant.fp8_roundtrip) as fp32, exact."""
    x3 = tl.reshape(xf, (BM, BK // 32, 32))
    amax = tl.max(tl.abs(x3), axis=2)
    y = tl.maximum(amax, 1e-4) * (1.0 / 448.0)
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)            # ceil(log2 y) + 127
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)               # exact 1/s
    # NaN-propagating clamp (jnp.clip's behaviour: a NaN input stays NaN through the round trip, as in the reference)
    q = tl.clamp(x3 * inv[:, :, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.reshape(_round_e4m3(q) * s[:, :, None], (BM, BK))


@triton.jit
def _to_bf16(v, DECODE: tl.constexpr):
    """fp32 -> bf16, round to nearest even: the hardware conversion on a GPU (NaN stays NaN); in Triton's interpreter
    (whose cast truncates) the integer rounding of ``triton_common._round_bf16`` (finite values only)."""
    if DECODE == 1:
        return v.to(tl.bfloat16)
    return _round_bf16(v).to(tl.bfloat16)


@triton.jit
def _x_tile(x_ptr, rows_c, k0, XS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ACT_RT: tl.constexpr):
    """x rows [BM, BK] at K offset k0 as bf16 (ACT_RT: after the FP8 round trip; exact either way); XS is the row
    stride. rows_c are clamped to valid rows (the padded rows' results are never stored)."""
    xt = tl.load(x_ptr + rows_c[:, None] * XS + k0 + tl.arange(0, BK)[None, :])
    if ACT_RT:
        xt = _fp8_rt(xt.to(tl.float32), BM, BK).to(tl.bfloat16)
    return xt


@triton.jit
def _w_tile(w_ptr, s_ptr, offs_n, k0, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows offs_n [BN] x K [k0, k0 + BK) -> bf16 [BN, BK] = E4M3 value * 2^(s - 127), exact. Bytes: BK
    contiguous per row; scale byte of (n, k) at [n // 32, k // 32]."""
    KSC: tl.constexpr = K // 32
    p = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k0 + tl.arange(0, BK)[None, :])
    s = tl.load(s_ptr + (offs_n // 32)[:, None] * KSC + k0 // 32 + tl.arange(0, BK // 32)[None, :])
    w3 = tl.reshape(p.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BN, BK // 32, 32))
    w3 = w3 * _e8m0_to_f32(s)[:, :, None]
    return tl.reshape(w3, (BN, BK)).to(tl.bfloat16)


# E4M3 bytes -> bf16 by bit placement (``Fp8LinearConfig.planes``, session 28): a byte's sign to bf16 bit 15 and its
# seven exponent / mantissa bits to bits 10-4 is the bf16 pattern of value * 2^-120 -- subnormals included, since the
# E4M3 exponent lands in the low bits of bf16's -- and one bf16x2 multiply by 2^(s - 7) makes value * 2^(s - 127),
# exact (the product has the E4M3 value's <= 4 significant bits). Per 32-bit word (bytes b0..b3 = K elements 4j..4j+3)
# two bf16x2 outputs: E = (b0, b2), the even K elements; O = (b1, b3), the odd ones. 2^(s - 7) is a bf16 for s <=
# 134 (``PLANES_MAX_SCALE``); a K chunk with a larger scale takes ``_w_tile`` instead. E4M3's NaN codes (0x7F / 0xFF)
# decode as 480 * 2^(s - 127), not NaN: a checkpoint with NaN weights is not a model.
PLANES_MAX_SCALE = 134
_PLANES_MAX = tl.constexpr(PLANES_MAX_SCALE)       # the kernel's copy (a jit function reads constexpr globals only)
_PLANES_ASM = tl.constexpr("""
{
.reg .b32 t, u;
shl.b32 t, $2, 8;
shl.b32 u, $2, 4;
and.b32 t, t, 0x80008000;
and.b32 u, u, 0x07F007F0;
or.b32 t, t, u;
mul.rn.bf16x2 $0, t, $3;
shr.b32 u, $2, 4;
and.b32 t, $2, 0x80008000;
and.b32 u, u, 0x07F007F0;
or.b32 t, t, u;
mul.rn.bf16x2 $1, t, $3;
}
""")


@triton.jit
def _bits_times(bits, fs):
    """bf16 bit pattern (uint32, low 16 bits) times fs (fp32 power of two) -> bf16; the interpreter's stand-in for
    mul.rn.bf16x2 (exact products, so the cast's rounding never acts)."""
    return ((bits << 16).to(tl.float32, bitcast=True) * fs).to(tl.bfloat16)


@triton.jit
def _w_planes(w_ptr, s_ptr, offs_n, k0, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DECODE: tl.constexpr):
    """``_w_tile``'s values as (even, odd) K planes, bf16 [BN, BK / 2] each: plane column i = K element k0 + 2 i (+ 1).
    Halfword i of a row holds elements 2 i (low byte) and 2 i + 1."""
    KSC: tl.constexpr = K // 32
    h = tl.load(w_ptr.to(tl.pointer_type(tl.uint16)) + offs_n[:, None].to(tl.int64) * (K // 2) + k0 // 2
                + tl.arange(0, BK // 2)[None, :])
    s = tl.load(s_ptr + (offs_n // 32)[:, None] * KSC + k0 // 32 + tl.arange(0, BK // 32)[None, :])
    f = (s.to(tl.uint16) + 120) << 7                      # bf16 bits of 2^(s - 7)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
    if DECODE == 1:
        we, wo = tl.inline_asm_elementwise(asm=_PLANES_ASM, constraints="=r,=r,r,r", args=[h, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        v = h.to(tl.uint32)
        fs = (f.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        we = _bits_times(((v << 8) & 0x8000) | ((v << 4) & 0x07F0), fs)
        wo = _bits_times((v & 0x8000) | ((v >> 4) & 0x07F0), fs)
    return we, wo


@triton.jit
def _chunk_max_scale(s_ptr, offs_n, kbeg, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KCH: tl.constexpr):
    """The largest UE8M0 scale byte of rows offs_n over K [kbeg, kbeg + KCH): decides the chunk's decode path."""
    KSC: tl.constexpr = K // 32
    m = tl.zeros((), tl.int32)
    for i in tl.range(0, KCH // BK):
        sc = tl.load(s_ptr + (offs_n // 32)[:, None] * KSC + (kbeg + i * BK) // 32 + tl.arange(0, BK // 32)[None, :])
        m = tl.maximum(m, tl.max(tl.max(sc.to(tl.int32), axis=1), axis=0))
    return m


@triton.jit
def _fp8_tile(x_ptr, w_ptr, s_ptr, pm, nb, ks,
              M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
              SWAP: tl.constexpr, ACT_RT: tl.constexpr, DECODE: tl.constexpr, G: tl.constexpr,
              EO: tl.constexpr = 0):
    """fp32 [BM, BN] of one (row tile pm, N block nb, K chunk ks). G > 1: block-diagonal (V4.1's grouped wo_a): x is
    [M, G K], output features [g N / G, (g + 1) N / G) read only x's g-th K slice (BN divides N / G, so a program
    sees one group). EO (swap only): the weights decoded by ``_w_planes`` into even / odd K planes, two dots a step
    (the same products; the fp32 sums in another order), where the chunk's scales allow it."""
    XS: tl.constexpr = K * G                    # x's row stride
    if G > 1:
        NG: tl.constexpr = N // G
        x_ptr = x_ptr + ((nb * BN) // NG) * K
    rows = pm * BM + tl.arange(0, BM)
    rows_c = tl.minimum(rows, M - 1).to(tl.int64)
    offs_n = nb * BN + tl.arange(0, BN)
    KCH: tl.constexpr = K // KS
    kbeg = ks * KCH
    if SWAP:
        acc_t = tl.zeros((BN, BM), tl.float32)
        planes = False
        if EO:
            planes = _chunk_max_scale(s_ptr, offs_n, kbeg, K, BN, BK, KCH) <= _PLANES_MAX
        if planes:
            for i in tl.range(0, KCH // BK):
                k0 = kbeg + i * BK
                we, wo = _w_planes(w_ptr, s_ptr, offs_n, k0, K, BN, BK, DECODE)
                xe, xo = tl.split(tl.reshape(_x_tile(x_ptr, rows_c, k0, XS, BM, BK, ACT_RT), (BM, BK // 2, 2)))
                acc_t += _dot_bf16(we, tl.trans(xe), DECODE)
                acc_t += _dot_bf16(wo, tl.trans(xo), DECODE)
        else:
            for i in tl.range(0, KCH // BK):
                k0 = kbeg + i * BK
                w = _w_tile(w_ptr, s_ptr, offs_n, k0, K, BN, BK)
                xt = _x_tile(x_ptr, rows_c, k0, XS, BM, BK, ACT_RT)
                acc_t += _dot_bf16(w, tl.trans(xt), DECODE)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
        for i in tl.range(0, KCH // BK):
            k0 = kbeg + i * BK
            xt = _x_tile(x_ptr, rows_c, k0, XS, BM, BK, ACT_RT)
            w = _w_tile(w_ptr, s_ptr, offs_n, k0, K, BN, BK)
            acc += _dot_bf16(xt, tl.trans(w), DECODE)
    return acc


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, o_ptr,
                       M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                       SWAP: tl.constexpr, ACT_RT: tl.constexpr, OUT_F32: tl.constexpr, DECODE: tl.constexpr,
                       G: tl.constexpr, EO: tl.constexpr = 0):
    """One (row tile, N block, K chunk) (``_fp8_tile``). KS == 1: o [M, N] (bf16, or fp32 with OUT_F32); KS > 1:
    fp32 partials o [KS, M, N] for ``_fp8_linear_reduce``."""
    pm = tl.program_id(0)
    nb = tl.program_id(1)
    ks = tl.program_id(2)
    rows = pm * BM + tl.arange(0, BM)
    rmask = rows < M
    offs_n = nb * BN + tl.arange(0, BN)
    acc = _fp8_tile(x_ptr, w_ptr, s_ptr, pm, nb, ks, M, N, K, BM, BN, BK, KS, SWAP, ACT_RT, DECODE, G, EO)
    offs = rows[:, None].to(tl.int64) * N + offs_n[None, :]
    if KS == 1:
        if OUT_F32:
            tl.store(o_ptr + offs, acc, mask=rmask[:, None])
        else:
            tl.store(o_ptr + offs, _to_bf16(acc, DECODE), mask=rmask[:, None])
    else:
        tl.store(o_ptr + ks * (M * N) + offs, acc, mask=rmask[:, None])


@triton.jit
def _fp8_linear_lastred_kernel(x_ptr, w_ptr, s_ptr, o_ptr, part_ptr, cnt_ptr,
                               M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                               SWAP: tl.constexpr, ACT_RT: tl.constexpr, OUT_F32: tl.constexpr,
                               DECODE: tl.constexpr, G: tl.constexpr, EO: tl.constexpr = 0):
    """Split K (KS > 1) without the second launch: each program writes its fp32 partial to part [KS, M, N] and
    counts itself in cnt[tile] (zeroed before the launch); the tile's last program to arrive sums the KS partials
    in the fixed order ks = 0, 1, ... and writes o [M, N] (bf16, or fp32 with OUT_F32) -- the same sums, in the same
    order, as ``_fp8_linear_reduce``, so the output is bit-identical to the two-launch path whichever program
    arrives last. Ordering (CUTLASS's semaphore pattern): a CTA barrier after the partial's stores, then one
    acq_rel atomic at GPU scope (Triton issues a scalar atomic from one thread and broadcasts its result); the last
    program reads the partials from L2 (``.cg``)."""
    pm = tl.program_id(0)
    nb = tl.program_id(1)
    ks = tl.program_id(2)
    acc = _fp8_tile(x_ptr, w_ptr, s_ptr, pm, nb, ks, M, N, K, BM, BN, BK, KS, SWAP, ACT_RT, DECODE, G, EO)
    rows = pm * BM + tl.arange(0, BM)
    rmask = rows < M
    offs = rows[:, None].to(tl.int64) * N + nb * BN + tl.arange(0, BN)[None, :]
    tl.store(part_ptr + ks * (M * N) + offs, acc, mask=rmask[:, None])
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pm * tl.num_programs(1) + nb, 1, sem="acq_rel", scope="gpu")
    if arrived == KS - 1:
        tot = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, KS, num_stages=1):     # a loop, not unrolled: one partial tile live at a time
            tot += tl.load(part_ptr + k * (M * N) + offs, mask=rmask[:, None], other=0.0, cache_modifier=".cg")
        if OUT_F32:
            tl.store(o_ptr + offs, tot, mask=rmask[:, None])
        else:
            tl.store(o_ptr + offs, _to_bf16(tot, DECODE), mask=rmask[:, None])


@triton.jit
def _fp8_linear_reduce(part_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                       KS: tl.constexpr, OUT_F32: tl.constexpr, DECODE: tl.constexpr):
    """o = sum over ks = 0..KS-1 (in that order) of the fp32 partials [KS, M, N], rounded to bf16 once (here, not in
    XLA, which could elide an f32 -> bf16 -> f32 pair), or fp32 with OUT_F32."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < M
    offs = rows[:, None].to(tl.int64) * N + tl.program_id(1) * BN + tl.arange(0, BN)[None, :]
    acc = tl.zeros((BR, BN), tl.float32)
    for ks in tl.static_range(KS):
        acc += tl.load(part_ptr + ks * (M * N) + offs, mask=rmask[:, None], other=0.0)
    if OUT_F32:
        tl.store(o_ptr + offs, acc, mask=rmask[:, None])
    else:
        tl.store(o_ptr + offs, _to_bf16(acc, DECODE), mask=rmask[:, None])


# ------------------------------------------------------------------------------------------ configs and plan
@dataclasses.dataclass(frozen=True)
class Fp8LinearConfig:
    """BM: rows per tile (swap: the MMA's N; 0 = adaptive, next power of two of M in [16, BM_MAX]); BN: output
    features per program (<= N, a divisor of N is used); BK: K per step; KS: K split (0 = auto from
    target_programs); swap: weights as the MMA's left operand; act_rt: where the "reference" FP8 round trip of x
    runs ("auto" | "kernel" | "xla": ``act_rt_in_kernel``); reduce: how KS > 1 partials are summed ("launch": a
    second kernel, ``_fp8_linear_reduce``; "last": the tile's last program, ``_fp8_linear_lastred_kernel``); planes:
    weights decoded by bit placement into even / odd K planes (``_w_planes``; swap only, experimental)."""
    BM: int = 0
    BM_MAX: int = 64
    BN: int = 64
    BK: int = 128
    KS: int = 0
    swap: bool = True
    act_rt: str = "auto"
    warps: int = 4
    stages: int = 3
    target_programs: int = 264          # 2 per SM of an H200 (132 SMs)
    max_ks: int = 32
    reduce: str = "launch"
    planes: bool = False

    def __post_init__(self):
        if self.reduce not in ("launch", "last"):
            raise ValueError(f"Fp8LinearConfig.reduce must be 'launch' or 'last', not {self.reduce!r}")
        if self.planes and not self.swap:
            raise ValueError("Fp8LinearConfig.planes needs swap=True (the planes are the MMA's register operand)")


NAMED_CONFIGS = {
    "decode": Fp8LinearConfig(),
    "decode_bn128": Fp8LinearConfig(BN=128),
    "decode_xrt": Fp8LinearConfig(act_rt="xla"),
    "decode_krt": Fp8LinearConfig(act_rt="kernel"),
    "prefill": Fp8LinearConfig(BM=128, BN=128, BK=64, KS=1, swap=False, warps=8, stages=3),
}
DECODE_MAX_ROWS = 384
# The config of the decode band (M <= DECODE_MAX_ROWS). "decode_bn128" since H200 run 29 (2026-12-02, kernel busy
# time per call in a trace, a weight per call; benchmarks/results/fp8_sweep_20261202_h200_run29.json): against
# "decode" (BN 64) wq_b 25.6 -> 23.6 us at 6 rows and 71.7 -> 61.9 at 192, wo_b 29.6 -> 23.3 and 91.8 -> 71.5, the
# shared expert's 2-5 % faster; wq_a / wkv within +-2 us either way. None of the 64-384-row candidates tried there
# (BM 128 / 256 swapped tiles, unswapped BM 64 / 128) beat it.
DECODE_CONFIG = "decode_bn128"


def pick_config(rows: int) -> Fp8LinearConfig:
    return named_config(DECODE_CONFIG) if rows <= DECODE_MAX_ROWS else NAMED_CONFIGS["prefill"]


def _pow2_divisor(n, cap):
    """The largest power of two <= cap (and >= 32) that divides n (n a multiple of 32; Triton's aranges need powers
    of two)."""
    b = 32
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def plan(cfg: Fp8LinearConfig, M: int, N: int, K: int, groups: int = 1) -> dict:
    """Block sizes, K split and grid of one call (pure Python; tests/test_kernels_fp8_linear.py). ``groups``: N output
    features in that many diagonal blocks of N / groups (each over its own K slice of x)."""
    if N % groups or (N // groups) % 32 or K % 32:
        raise ValueError(f"N={N} / groups={groups} and K={K} must be multiples of 32 (the scale blocks)")
    BM = cfg.BM or min(cfg.BM_MAX, max(16, 1 << max(0, M - 1).bit_length()))
    BN = _pow2_divisor(N // groups, min(cfg.BN, N // groups))
    BK = _pow2_divisor(K, min(cfg.BK, K))
    steps = K // BK
    tiles = -(-M // BM) * (N // BN)
    if cfg.KS:
        KS = cfg.KS
    else:
        divs = [d for d in range(1, min(steps, cfg.max_ks) + 1) if steps % d == 0]
        KS = next((d for d in divs if tiles * d >= cfg.target_programs), divs[-1])
    if steps % KS:
        raise ValueError(f"KS={KS} must divide K / BK = {steps}")
    return dict(BM=BM, BN=BN, BK=BK, KS=KS, grid=(-(-M // BM), N // BN, KS), programs=tiles * KS)


def act_rt_in_kernel(cfg: Fp8LinearConfig, BM: int) -> bool:
    """Where the "reference" activation round trip runs. "auto": in the kernel for row tiles of <= 16 rows, in XLA
    above. Why (sm_90 compiles, NOTES.md "FP8 dense linears"): in-kernel, every one of the N / BN programs of a row
    tile redoes the round trip of its [BM, BK] x tile, BM / BN of the weight work at ~3x its instructions per element:
    the decode loop is 8.8 thread instructions per weight element at BM 16 against 5.7 with x pre-rounded, but 20.0
    against ~5.7 at BM 64, while the XLA pass costs one small fusion (M K bf16 read + written, a launch) -- cheaper
    than the redundant work from BM 32 up, dearer than it at BM 16 (a launch is ~2 us, the extra ~0.6 us at wq_a)."""
    if cfg.act_rt == "auto":
        return BM <= 16
    return cfg.act_rt == "kernel"


def named_config(name: str) -> Fp8LinearConfig:
    """A default config by name, or a candidate of ``kernels/experimental/fp8_configs.py`` (imported only then)."""
    if name in NAMED_CONFIGS:
        return NAMED_CONFIGS[name]
    from dsflash.kernels.experimental.fp8_configs import CANDIDATES
    if name not in CANDIDATES:
        raise ValueError(f"unknown FP8 linear config {name!r}; known: {sorted(NAMED_CONFIGS) + sorted(CANDIDATES)}")
    return Fp8LinearConfig(**CANDIDATES[name])


# ------------------------------------------------------------------------------------------ launcher
def _launch(jt, x2, w8, s8, *, cfg, act_rt_kernel, out_f32, decode=1, groups=1):
    M, K = x2.shape[0], x2.shape[1] // groups
    N = w8.shape[0]
    pl = plan(cfg, M, N, K, groups)
    KS = pl["KS"]
    consts = dict(M=M, N=N, K=K, BM=pl["BM"], BN=pl["BN"], BK=pl["BK"], KS=KS, SWAP=int(cfg.swap),
                  ACT_RT=int(act_rt_kernel), OUT_F32=int(out_f32), DECODE=decode, G=groups, EO=int(cfg.planes))
    if KS > 1 and cfg.reduce == "last":
        tiles = pl["grid"][0] * pl["grid"][1]
        o, _, _ = jt.triton_call(
            x2, w8, s8, kernel=_fp8_linear_lastred_kernel,
            out_shape=(jax.ShapeDtypeStruct((M, N), jnp.float32 if out_f32 else jnp.bfloat16),
                       jax.ShapeDtypeStruct((KS, M, N), jnp.float32),      # the partials (every read one written)
                       jax.ShapeDtypeStruct((tiles,), jnp.int32)),         # arrival counters, zeroed
            zeroed_outputs=(2,), grid=pl["grid"], num_warps=cfg.warps, num_stages=cfg.stages, **consts)
        return o
    odt = jnp.float32 if (out_f32 or KS > 1) else jnp.bfloat16
    oshape = (KS, M, N) if KS > 1 else (M, N)
    o = jt.triton_call(
        x2, w8, s8, kernel=_fp8_linear_kernel, out_shape=jax.ShapeDtypeStruct(oshape, odt),
        grid=pl["grid"], num_warps=cfg.warps, num_stages=cfg.stages, **consts)
    if KS == 1:
        return o
    BR = min(16, 1 << max(0, M - 1).bit_length())
    BNR = _pow2_divisor(N, min(256, N))
    return jt.triton_call(
        o, kernel=_fp8_linear_reduce,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32 if out_f32 else jnp.bfloat16),
        grid=(-(-M // BR), N // BNR), num_warps=4, num_stages=1, M=M, N=N, BR=BR, BN=BNR, KS=KS,
        OUT_F32=int(out_f32), DECODE=decode)


def _as_u8(a):
    return a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8)


def fp8_linear_triton(x, w, scale, *, precision="reference", act_quant=True, config=None, out_f32=False,
                      decode=1, groups=1):
    """Always runs the kernel (the front-end ``fp8_linear.fp8_linear`` decides whether to). ``config``: an
    ``Fp8LinearConfig`` or a NAMED_CONFIGS name (default ``pick_config(M)``); ``out_f32``: return the fp32 result
    before the bf16 rounding (tests); ``decode`` 0 only for Triton's interpreter. ``groups`` G > 1: x [..., G K] and
    w [G No, K] applied block-diagonally (group g's No outputs from x's g-th K slice) -> [..., G No]."""
    if precision not in ("reference", "bf16"):
        raise NotImplementedError(f"the FP8 linear kernel implements 'reference' and 'bf16', not {precision!r}")
    if scale is None:
        raise ValueError("the kernel needs the UE8M0 block scales (float master weights: use the reference)")
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only

    *lead, KT = x.shape
    N = w.shape[0]
    K = KT // groups
    if KT % groups or w.shape != (N, K) or scale.shape != (N // 32, K // 32) or N % groups:
        raise ValueError(f"w {w.shape} / scale {scale.shape} do not match x [..., {KT}] in {groups} group(s) (want "
                         f"[N, {K}] with N divisible by {groups}, [N/32, {K // 32}])")
    M = math.prod(lead)
    cfg = named_config(config) if isinstance(config, str) else (config or pick_config(M))
    x2 = x.reshape(M, KT).astype(jnp.bfloat16)
    rt = precision == "reference" and act_quant
    in_kernel = rt and act_rt_in_kernel(cfg, plan(cfg, M, N, K, groups)["BM"])
    if rt and not in_kernel:
        x2 = quant.fp8_roundtrip(x2, 32)
    y = _launch(jt, x2, _as_u8(w), _as_u8(scale), cfg=cfg, act_rt_kernel=in_kernel, out_f32=out_f32, decode=decode,
                groups=groups)
    return y if len(lead) == 1 else y.reshape(*lead, N)
