"""Shape checks and the blocking plan of the fused mHC kernel: pure Python, shared by the reference
(``mhc_fused``, which re-exports every name) and the Triton file (``mhc_fused_triton``), so that the Triton file
never imports the module that dispatches to it."""
from __future__ import annotations


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
# Below EPI_ROWS_BELOW tokens kernel B runs one program a token (BTE 1) and sums all DS partials in one step (SB up to
# EPI_ROW_TILE_CAP / NCP): session 28's 1 x 6 step spent 26 us a launch in B's single program -- 8 launches, 0.21 of
# mHC's 0.32 ms -- walking DS 160 partials in 20 dependent steps of SB 8 for 6 tokens. One step of independent loads
# per token instead: the same sums in another fixed fp32 order. Measured (H100, session 29, NOTES.md): mHC 0.337 ->
# 0.168 ms in the 1 x 6 step, kernel-busy -0.17 / -0.12 / -0.09 ms at 1 / 8 / 32 x 6. 0 switches it off.
EPI_ROWS_BELOW = 512
EPI_ROW_TILE_CAP = 8192      # [SB, 1, NCP] at BTE 1: 64 elements a thread at 4 warps
PARTIAL_X_FRAC = 1 / 16      # partial bytes at most this fraction of X's bytes ...
PARTIAL_FLOOR = 8 << 20      # ... or of this many bytes (small T: everything stays in L2)
BD_CHOICES = (128, 64, 32)
# From NARROW_FROM tokens kernel A runs [16, 64] tiles on 4 warps (more programs a SM than the rule's [64, 32] or
# [32, 64] on 8, one of which filled a SM: 160-194 registers) with X1 / h rounded by the hardware convert (``hw_round``,
# the same bits). One H100, `bench kernels --ops mhc`, d 5120, outputs summed, ms a call, rule -> narrow tile:
# session 20: 4096 tokens 0.612 -> 0.475, 16384 2.026 -> 1.635; session 21: 1024 0.228 -> 0.181, 2048 0.372 ->
# 0.294-0.316 (the same tile without hw_round, bit-identical, 0.294). Every output within 1.7e-6 of the rule plan's (max
# over X1, h and the coefficients: the logit MMA's M and so its fp32 summation order change; hw_round alone was
# bit-identical). sm_90 compile: 128 registers, 4 blocks a SM. Session 24 (one H200, `gpu_queue.sh mhc_prefill`,
# kernels_20261207_h200_s24_mhc_nar.json): 512 tokens 0.146 -> 0.115 ms, 256 0.107 -> 0.103, 192 0.104 -> 0.098; the
# outputs' largest difference from the rule plan's 0 at 512 and 256, 2^-9 at 192 (error against the reference 1e-5
# for both plans). So from 512; below it the 4-6 % was not taken.
NARROW_BT, NARROW_BD = 16, 64
NARROW_FROM = 512
# Kernel B's warps (plan key "warps_b"; kernel_plan leaves it out). 4 until measured otherwise: at decode sizes one
# B program runs the 20 Sinkhorn rounds of a [BTE, n, n] tile, whose reductions cross warps at 4 (NOTES.md,
# "Runs 49-50": mHC is latency-bound at 1 x 6); 1 keeps them inside a warp.
EPI_WARPS = 4


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
    padded to a power of two >= 16), BTE / SB (kernel B: tokens a program -- 1 below EPI_ROWS_BELOW tokens --,
    partials summed per step), programs (kernel A's grid size), num_warps (kernel A).
    Rules: BT 16 / 32 / 64 for T <= 128 / <= 2048 / larger (MMA rows; fn is re-read once per token block). Then
    among BD in BD_CHOICES with BT*BD <= TILE_CAP and DS dividing d / BD, with partial bytes within
    max(PARTIAL_X_FRAC * X bytes, PARTIAL_FLOOR): the fewest splits reaching TARGET_PROGRAMS with BD >= 64 (or the
    widest BD allowed, if narrower; largest BD first), else the fewest reaching MIN_PROGRAMS (largest BD first), else
    the most programs. From NARROW_FROM tokens the splits stay as the rule chose them and the tile becomes
    NARROW_BT x NARROW_BD with ``hw_round`` 1 (measured; see NARROW_BT)."""
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
    BTE = 1 if T < EPI_ROWS_BELOW else 16 if T <= 2048 else 32
    sb = min(_next_pow2(DS), max(1, (EPI_ROW_TILE_CAP if BTE == 1 else EPI_TILE_CAP) // (BTE * NCP)))
    hw = {}
    if T >= NARROW_FROM and d % (DS * NARROW_BD) == 0:   # the measured prefill tile (NARROW_BT's comment), same DS
        BT, BD, hw = NARROW_BT, NARROW_BD, {"hw_round": 1}
        tb = _cdiv(T, BT)
    return dict(BT=BT, BD=BD, DS=DS, NCP=NCP, BTE=BTE, SB=sb, programs=tb * DS, num_warps=num_warps(BT, BD), **hw)


def num_warps(BT, BD):
    """Kernel A's warps: 8 tile elements a thread (an sm_90 compile of the kernel spilled at 16), 4 to 8 warps."""
    return max(4, min(8, BT * BD // 256))


def check_plan(p, n, d):
    """Raise ValueError unless plan ``p`` (kernel_plan's keys, e.g. with overrides) fits the kernels."""
    pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731
    if not all(pow2(p[k]) for k in ("BT", "BD", "NCP", "BTE", "SB")) or p["BT"] < 16:
        raise ValueError(f"BT, BD, NCP, BTE, SB must be powers of two (BT >= 16: kernel A's MMA rows), got {p}")
    if p["NCP"] < 2 * n + n * n or p["BD"] < 16 or p["DS"] < 1 or d % (p["DS"] * p["BD"]):
        raise ValueError(f"plan {p} does not fit n={n}, d={d}: need NCP >= 2n+n^2, BD >= 16, "
                         f"d % (DS*BD) == 0")
    if p.get("hw_round", 0) not in (0, 1):
        raise ValueError(f"hw_round (X1 / h rounded by the hardware convert) must be 0 or 1, got {p['hw_round']}")
    if p.get("warps_b", EPI_WARPS) not in (1, 2, 4, 8):
        raise ValueError(f"warps_b (kernel B's warps) must be 1, 2, 4 or 8, got {p['warps_b']}")
