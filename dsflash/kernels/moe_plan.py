"""Pure-JAX planning for the Triton MoE grouped GEMM (no Triton import, runs on CPU): kernel configs, the
expert-sorted tile schedule and the activation preparation. Tested on CPU in tests/test_kernels_moe_plan.py."""
from __future__ import annotations

import dataclasses
from math import gcd

import jax.numpy as jnp

from dsflash import quant
from dsflash.kernels.moe_config import MoeConfig  # noqa: F401  (the config type, re-exported)


# Defaults (2026-11-30, H200 runs 7-9, whole op in ms; JSON benchmarks/results/kernels_20261130_h200_run{7,8,9}*):
# swapped operands with even/odd nibble planes and Triton's own load pipelining beat every earlier kernel.
# Decode sw_eo_np: 0.146 / 0.805 / 1.147 / 1.630 ms at 1 / 16 / 64 / 256 tokens (run 9), against sk_fp8 (the
# previous default) 0.172 / 1.014 / - / 2.226 (run 7); with bf16 activations 0.805 at 16 tokens. Prefill
# sw_eo_prefill_w8: 7.73-7.78 ms at 4096 tokens against ds_prefill_rt (the previous default) 10.77 in run 7.
SW_EO_NP = MoeConfig(kind="sk", mma="swap_eo", BM=16, BN_UP=64, BN_DOWN=64, BK=128, stages=4, prefetch=False)
SW_EO_PREFILL_W8 = MoeConfig(kind="sk", mma="swap_eo", BM=128, BN_UP=128, BN_DOWN=128, BK=128, warps_up=8,
                             warps_down=8, stages=3, KS_UP=1, KS_DOWN=1, prefetch=False)
# Decode at <= 384 slots (64 tokens x top-6) since 2026-12-01 (H200 run 12, JSON kernels_20261201_h200_run12_moe_ps):
# the same kernel with BM 8 token tiles (mma.sync instead of wgmma), 0.126 / 0.631 / 0.909 ms at 1 / 16 / 64 tokens
# against sw_eo_np's 0.150 / 0.797 / 1.129 in the same run; at 256 tokens (1536 slots) sw_eo_np stays faster
# (1.630 vs 2.014). Not timed with bf16 activations, so DECODE_BF16_CONFIG is unchanged.
SW_EO_NP_BM8 = MoeConfig(kind="sk", mma="swap_eo", BM=8, BN_UP=64, BN_DOWN=64, BK=128, stages=4, prefetch=False)
DECODE_SMALL_CONFIG, DECODE_SMALL_MAX_ROWS = SW_EO_NP_BM8, 384
DECODE_CONFIG = SW_EO_NP              # decode (rows <= 32 * experts), FP8 activations
DECODE_BF16_CONFIG = SW_EO_NP         # decode, bf16 activations
PREFILL_CONFIG = SW_EO_PREFILL_W8
# The defaults by name (what pick_config returns); the variants they were judged against live in
# kernels/experimental/moe_configs.py (README.md there names the benchmark JSON of each): ``named_config(name)``
# finds either.
NAMED_CONFIGS = {
    "sw_eo_np": SW_EO_NP,
    "sw_eo_np_bm8": SW_EO_NP_BM8,
    "sw_eo_prefill_w8": SW_EO_PREFILL_W8,
}


def named_configs() -> dict:
    """Every named config: the defaults, then the experimental variants."""
    from dsflash.kernels.experimental.moe_configs import CONFIGS
    return {**NAMED_CONFIGS, **CONFIGS}


def named_config(name: str) -> MoeConfig:
    """A config by name (default or experimental); ValueError naming the known ones otherwise."""
    if name in NAMED_CONFIGS:
        return NAMED_CONFIGS[name]
    every = named_configs()
    if name not in every:
        raise ValueError(f"unknown MoE config {name!r}; known: {', '.join(sorted(every))}")
    return every[name]


def _ks_unit(cfg: MoeConfig) -> int:
    return 32 * cfg.KSUB if cfg.mma == "fp8" else cfg.BK


def split_k(size_k: int, unit: int, tiles: int, nblocks: int, target: int, ks: int = 0) -> int:
    """K splits for a kernel whose grid is tiles x nblocks x KS: ``ks`` if given, else the smallest KS dividing
    size_k / unit with tiles * nblocks * KS >= target, keeping >= 2 units per split (so the prefetch has a next
    slab). ``tiles`` is a static upper bound on the active M tiles (min(num_tiles, S)), not the data-dependent
    count (at 16 tokens 96 bound vs ~63 active experts)."""
    n = size_k // unit
    if ks:
        if n % ks:
            raise ValueError(f"KS={ks} must divide {size_k}/{unit}={n}")
        return ks
    cands = [c for c in range(1, n + 1) if n % c == 0 and (n // c >= 2 or c == 1)]
    for c in cands:
        if tiles * nblocks * c >= target:
            return c
    return cands[-1]


def up_blocks(cfg: MoeConfig, inter: int) -> int:
    """Column blocks of the gate/up launch: I / BN_UP, twice that with ``split_gate_up`` (gate and up apart)."""
    return (2 if cfg.split_gate_up else 1) * inter // cfg.BN_UP


def split_ks(cfg: MoeConfig, S: int, E: int, d: int, inter: int) -> tuple[int, int]:
    """(KS_UP, KS_DOWN) of a kind-"sk" config at S slots."""
    tiles = min(num_tiles(S, E, cfg.BM), S)      # valid tiles hold >= 1 slot each
    unit = _ks_unit(cfg)
    return (split_k(d, unit, tiles, up_blocks(cfg, inter), cfg.min_programs, cfg.KS_UP),
            split_k(inter, unit, tiles, d // cfg.BN_DOWN, cfg.min_programs, cfg.KS_DOWN))


# Routed-expert weights in the load-time "il" layout (kernels/moe_layout.py; made by moe_layout.repack_experts /
# model.params.moe_il_weights): every size runs mma "swap_il", the token tile growing with the slots per expert.
# Run 39 (one H200, bench kernels --ops moe, E 96, ms per layer): 256 tokens BM16 1.04 / BM32 0.97; 1024 BM32 2.36 /
# BM64 2.57; 2048 BM64 4.10 / BM128 3.67; 4096 BM128 6.24, where ds_prefill_rt on checkpoint weights takes 10.8 and
# converting il weights back for it ~5 more (run 37), so il weights never go back to the prefill kernel.
# Run 44 (one H200, 2026-12-05, same bench): x dequantised once before the up kernel ("_xb") wins at BM 64 / 128 up to
# 2048 tokens -- 1024 tokens (64 slots per expert) bm32 2.52 / bm64_xb 2.38; 2048 (128) bm128 4.08 / bm128_xb 3.78 --
# but not at 4096 (bm128 6.51 / bm128_xb 6.62: the xb tile spills) nor at BM 32 or 16 (session 13, H100: 3-27 %
# slower at 6-384 tokens).
# Session 17 (one H100, 2026-12-06, same bench, benchmarks/results/kernels_20261206_h100_s17_moe_prefill_nf.json):
# launching the column blocks fastest ("_nf", MoeConfig.n_fast) wins above 128 slots per expert -- 4096 tokens
# bm128 7.08 / bm128_nf 6.70, 16384 24.69 / 19.36 -- and loses at 64 (1024 tokens bm64_xb 2.43 / bm64_xb_nf 2.69).
IL_DECODE_CONFIG_NAME = "sw_il"
# (largest slots per expert, config) in order; above the last: IL_WIDE_CONFIG_NAME
IL_BANDS = ((8, "sw_il"), (32, "sw_il_bm32"), (64, "sw_il_bm64_xb"))
# Session 18 (one H100, 2026-12-06, kernels_20261206_h100_s18_moe_prefill_g8.json): grouping 8 M tiles per column
# block ("_g8", MoeConfig.group_m) -- 4096 tokens bm128_nf 6.53 / _g4 6.42 / _g8 6.21, 16384 19.11 / 19.50 / 19.23.
# Session 19 (one H100, kernels_20261206_h100_s19_moe_prefill_hp.json): h stored in plane order for the down kernel
# ("_hp", MoeConfig.plane_h; bit-identical) -- 1024 tokens _g8 3.60 / _hp 3.57, 4096 6.18 / 6.00, 16384 19.41 / 18.24.
# Later in session 19 (same H100, kernels_20261206_h100_s19_moe_prefill_xp_dp.json / _moe_2048.json): x dequantised
# once into plane order ("_xp", plane_x) and two column blocks per down program ("_dp", down_pair), both bit-identical:
# 1024 tokens _hp 3.63 / _hp_xp_dp 2.37, 2048 bm128_xb 4.24 / _hp_xp_dp 3.16 / bm64_xb 4.31, 4096 _hp 6.05 /
# _hp_xp_dp 4.66, 16384 18.36 / 13.89; so the wide band now starts above 64 slots per expert (bm128_xb retired).
IL_WIDE_CONFIG_NAME = "sw_il_bm128_nf_g8_hp_xp_dp"


def pick_config(rows: int, experts: int, act_fp8: bool = True, layout: str = "checkpoint") -> MoeConfig:
    """Default config for ``rows`` token slots (T * k) over ``experts`` local experts; ``act_fp8``: FP8
    activations (precision "reference") or bf16 ones (the measurements: comment above); ``layout``: the weights'
    ("checkpoint", or "il" for the load-time layout, which only exists where someone opted in)."""
    if layout == "il":
        per_expert = rows / max(experts, 1)
        return named_config(next((n for m, n in IL_BANDS if per_expert <= m), IL_WIDE_CONFIG_NAME))
    if rows > 32 * experts:
        return PREFILL_CONFIG
    if not act_fp8:
        return DECODE_BF16_CONFIG
    return DECODE_SMALL_CONFIG if rows <= DECODE_SMALL_MAX_ROWS else DECODE_CONFIG


def _pow2_dividing(b: int, n: int, floor: int) -> int:
    while b >= floor and n % b:
        b //= 2
    return b


def fit_config(cfg: MoeConfig, d: int, inter: int) -> MoeConfig:
    """``cfg`` with its blocks shrunk (halved) until they divide the model's sizes: the tuned configs assume V4.1's
    d = 5120, I = 2304, a small model (the tiny preset: d = 256, I = 64) needs smaller ones. Column blocks stay
    >= 32 (one MXFP4 scale group), KSUB >= 1. Only the default config is fitted; an explicit one is checked as
    given (``moe_gemm_triton._check_shapes``)."""
    if d % 32 or inter % 32:
        raise ValueError(f"the Triton MoE GEMM needs hidden_size and moe_intermediate_size divisible by 32 (the "
                         f"MXFP4 scale group); got d={d}, I={inter}")
    k_both = gcd(d, inter)
    bn_up, bn_down = _pow2_dividing(cfg.BN_UP, inter, 32), _pow2_dividing(cfg.BN_DOWN, d, 32)
    bk, ksub = _pow2_dividing(cfg.BK, k_both, 32), _pow2_dividing(cfg.KSUB, k_both // 32, 1)
    if min(bn_up, bn_down, bk) < 32:
        raise ValueError(f"no block of the config {cfg} fits d={d}, I={inter} (blocks are powers of two >= 32)")
    return dataclasses.replace(cfg, BN_UP=bn_up, BN_DOWN=bn_down, BK=bk, KSUB=ksub)


ONEHOT_MAX_SLOTS = 2048   # tile_schedule's sort-free path up to this many slots (decode); argsort above


def tile_schedule(idx, E: int, BM: int, method: str = "auto"):
    """Sort the T*k slots by expert (stable) and cut them into M-tiles that never cross an expert.

    Returns (order, tile_e, tile_start, tile_end): order [S] slot ids in sorted order; per tile the expert
    (-1 for spare tiles), first sorted row, and the end row of that expert's run.
    ``method``: "sort" (stable argsort, bincount, searchsorted, gathers) or "onehot" (the same integers from
    one-hot compares and sums: no sort, scatter, while loop or gather -- fewer, fusible XLA ops for decode);
    "auto" takes "onehot" up to ONEHOT_MAX_SLOTS slots."""
    flat_e = idx.reshape(-1).astype(jnp.int32)
    S = flat_e.shape[0]
    if method == "auto":
        method = "onehot" if S <= ONEHOT_MAX_SLOTS else "sort"
    if method == "onehot":
        order, _, tiles = _onehot_schedule(flat_e, E, BM)
        return (order,) + tiles
    order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)
    gs = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    offs = jnp.cumsum(gs) - gs
    ntile = (gs + BM - 1) // BM
    tcum = jnp.cumsum(ntile)
    TM = num_tiles(S, E, BM)
    t = jnp.arange(TM, dtype=jnp.int32)
    e_of_t = jnp.searchsorted(tcum, t, side="right").astype(jnp.int32)
    valid = e_of_t < E
    ec = jnp.minimum(e_of_t, E - 1)
    local = t - (tcum[ec] - ntile[ec])
    tile_start = offs[ec] + local * BM
    tile_end = offs[ec] + gs[ec]
    tile_e = jnp.where(valid, ec, -1).astype(jnp.int32)
    return order, tile_e, tile_start.astype(jnp.int32), tile_end.astype(jnp.int32)


def _onehot_schedule(flat_e, E: int, BM: int):
    """Sort-free tile_schedule for small S: -> (order, rank, (tile_e, tile_start, tile_end)), rank[i] = sorted
    position of slot i (order[rank[i]] = i). O(S*S + S*E + TM*E) integer work, all compares and sums (rank: the
    number of (expert, slot) keys below a slot's own)."""
    S = flat_e.shape[0]
    ar_e = jnp.arange(E, dtype=jnp.int32)
    pos = jnp.arange(S, dtype=jnp.int32)
    key = flat_e * S + pos                                                # unique; orders by (expert, slot)
    rank = jnp.sum((key[None, :] < key[:, None]).astype(jnp.int32), axis=1)    # stable sorted position
    gs = jnp.sum((flat_e[:, None] == ar_e[None, :]).astype(jnp.int32), axis=0)
    offs = jnp.cumsum(gs) - gs
    order = jnp.sum(jnp.where(rank[None, :] == pos[:, None], pos[None, :], 0), axis=1).astype(jnp.int32)
    ntile = (gs + BM - 1) // BM
    tcum = jnp.cumsum(ntile)
    TM = num_tiles(S, E, BM)
    t = jnp.arange(TM, dtype=jnp.int32)
    e_of_t = jnp.sum((tcum[None, :] <= t[:, None]).astype(jnp.int32), axis=1)   # searchsorted side="right"
    valid = e_of_t < E
    ec = jnp.minimum(e_of_t, E - 1)
    sel = (ec[:, None] == ar_e[None, :]).astype(jnp.int32)                 # [TM, E], one 1 per row

    def pick(v):
        return jnp.sum(sel * v[None, :], axis=1)
    local = t - (pick(tcum) - pick(ntile))
    tile_start = pick(offs) + local * BM
    tile_end = pick(offs) + pick(gs)
    tile_e = jnp.where(valid, ec, -1).astype(jnp.int32)
    return order, rank.astype(jnp.int32), (tile_e, tile_start.astype(jnp.int32), tile_end.astype(jnp.int32))


def num_tiles(S: int, E: int, BM: int) -> int:
    return S // BM + min(E, S)


def prepare(x, idx, weight, *, E, BM, act_fp8):
    """Everything the kernels read besides the weights (pure JAX)."""
    T, d = x.shape
    k = idx.shape[1]
    flat_w = weight.reshape(-1).astype(jnp.float32)
    if T * k <= ONEHOT_MAX_SLOTS:
        # sort-free path; rw[p] = w[order[p]] as a masked sum (one nonzero term: exact) instead of a gather
        order, rank, (tile_e, tile_s, tile_end) = _onehot_schedule(idx.reshape(-1).astype(jnp.int32), E, BM)
        pos = jnp.arange(T * k, dtype=jnp.int32)
        rw = jnp.sum(jnp.where(rank[None, :] == pos[:, None], flat_w[None, :], 0.0), axis=1)
    else:
        order, tile_e, tile_s, tile_end = tile_schedule(idx, E, BM, method="sort")
        rw = flat_w[order]
    tok = order // k
    xb = x.astype(jnp.bfloat16)
    if act_fp8:
        xq, xs = quant.fp8_quant(xb, 32)
    else:
        xq, xs = xb, jnp.zeros((T, d // 32), jnp.float32)
    return dict(xq=xq, xs=xs, tok=tok, rw=rw, order=order, tile_e=tile_e, tile_s=tile_s, tile_end=tile_end)


def random_moe_problem(key, T: int, k: int, E: int, d: int, I: int, *, scale_range=(119, 123), x_scale=1.0):
    """Fresh random inputs in the checkpoint formats (tests and benchmarks): x bf16 [T, d]; distinct experts per
    token (top-k of Gumbel noise); positive routing weights summing to 1.5 (V4.1); MXFP4 weights as random
    nibble bytes (every byte is a valid E2M1 pair) with UE8M0 scales drawn from ``scale_range``."""
    import jax

    ks = jax.random.split(key, 10)
    x = (jax.random.normal(ks[0], (T, d), jnp.float32) * x_scale).astype(jnp.bfloat16)
    idx = jax.lax.top_k(jax.random.gumbel(ks[1], (T, E)), k)[1].astype(jnp.int32)
    s = jax.random.uniform(ks[2], (T, k), jnp.float32, 0.1, 1.0)
    weight = s / jnp.sum(s, axis=-1, keepdims=True) * 1.5

    def mx(kw, ks_, shape):
        w = jax.random.randint(kw, shape[:-1] + (shape[-1] // 2,), -128, 128, jnp.int32).astype(jnp.int8)
        sc = jax.random.randint(ks_, shape[:-1] + (shape[-1] // 32,), scale_range[0], scale_range[1] + 1,
                                jnp.int32).astype(jnp.uint8)
        return w, sc

    w1, s1 = mx(ks[3], ks[4], (E, I, d))
    w3, s3 = mx(ks[5], ks[6], (E, I, d))
    w2, s2 = mx(ks[7], ks[8], (E, d, I))
    return x, idx, weight, w1, s1, w3, s3, w2, s2
