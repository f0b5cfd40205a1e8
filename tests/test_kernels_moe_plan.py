"""CPU checks of the Triton MoE GEMM's pure-JAX planning (tile schedule, activation prep) and the backend
dispatch. The kernels themselves are checked on the GPU (tests/gpu/test_moe_gemm.py) and, for logic, in
Triton's interpreter (scripts/triton_interpret_moe.py)."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dsflash.kernels import moe_gemm, moe_plan
from dsflash import quant


@pytest.mark.parametrize("T,k,E,BM", [(1, 6, 96, 16), (7, 3, 5, 16), (64, 6, 16, 16), (300, 6, 8, 128),
                                      (5, 2, 40, 128)])
def test_tile_schedule_covers_every_slot_once(T, k, E, BM):
    key = jax.random.PRNGKey(T * 1000 + E)
    # distinct experts per token, skewed so some experts are empty and some get many rows
    scores = jax.random.gumbel(key, (T, E)) + jnp.linspace(0, 3, E)
    idx = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    order, te, ts, tend = (np.asarray(a) for a in moe_plan.tile_schedule(idx, E, BM))
    S = T * k
    assert te.shape == (moe_plan.num_tiles(S, E, BM),)
    flat = np.asarray(idx).reshape(-1)
    assert np.array_equal(np.sort(order), np.arange(S))
    sorted_e = flat[order]
    assert np.all(np.diff(sorted_e) >= 0)
    covered = np.zeros(S, np.int32)
    for e, a, b in zip(te, ts, tend):
        if e < 0:
            continue
        rows = np.arange(a, min(a + BM, b))
        assert len(rows) > 0
        assert np.all(sorted_e[rows] == e)          # a tile never crosses an expert
        covered[rows] += 1
    assert np.all(covered == 1)
    # valid tiles first, spares (-1) after
    nvalid = int(np.sum(te >= 0))
    assert np.all(te[:nvalid] >= 0) and np.all(te[nvalid:] == -1)


def test_prepare_matches_reference_activation_round_trip():
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (9, 128), jnp.float32) * 3
    idx = jnp.tile(jnp.arange(3, dtype=jnp.int32), (9, 1))
    w = jnp.ones((9, 3), jnp.float32) / 3
    p = moe_plan.prepare(x, idx, w, E=4, BM=16, act_fp8=True)
    xa = quant.fp8_roundtrip(x.astype(jnp.bfloat16), 32).astype(jnp.float32)
    deq = quant.fp8_dequant(p["xq"], p["xs"], 32)
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(xa))
    assert np.array_equal(np.asarray(p["tok"]), np.asarray(p["order"]) // 3)


def test_pick_config_and_dispatch():
    # 2026-11-30 runs 7-9: the swapped-operand kernels fastest at every measured size, both activation formats;
    # 2026-12-01 run 12: their BM 8 form faster up to 64 tokens (384 slots) with FP8 activations
    for T in (1, 16, 64, 65, 256, 512):
        want = "sw_eo_np_bm8" if T <= 64 else "sw_eo_np"
        assert moe_plan.pick_config(T * 6, 96) is moe_plan.named_config(want), T
        assert moe_plan.pick_config(T * 6, 96, act_fp8=False) is moe_plan.named_config("sw_eo_np")
    assert moe_plan.pick_config(4096 * 6, 96) is moe_plan.named_config("sw_eo_prefill_w8")
    assert moe_plan.pick_config(4096 * 6, 96, act_fp8=False) is moe_plan.PREFILL_CONFIG
    assert moe_plan.pick_config(16384 * 6, 96) is moe_plan.PREFILL_CONFIG
    with pytest.raises(ValueError):
        moe_gemm.routed_moe(*([None] * 9), limit=10.0, backend="cuda")


def test_split_k_plan():
    """Split-K decode configs: auto KS fills >= min_programs where it can, divides K into whole units, keeps
    >= 2 units per split; explicit KS is checked. V4.1 numbers (d=5120, I=2304, 96 experts, top-6)."""
    cfg = moe_plan.named_config("sk_bf16")
    assert moe_plan.split_ks(cfg, 6, 96, 5120, 2304) == (5, 6)        # 1 token: 6 tiles x 36 x 5, 6 x 40 x 6
    assert moe_plan.split_ks(cfg, 96, 96, 5120, 2304) == (1, 1)       # 16 tokens: enough tiles already
    assert moe_plan.split_ks(moe_plan.named_config("sk_gemv"), 6, 96, 5120, 2304) == (5, 3)   # BM=1: 6 tiles
    assert moe_plan.split_ks(moe_plan.named_config("slab_bf16"), 6, 96, 5120, 2304) == (1, 1)
    for name in ("sk_bf16", "sk_bf16_bk256", "sk_bf16_w8", "sk_fp8", "sk_gemv", "sk_gemv_bk256"):
        c = moe_plan.named_config(name)
        unit = 32 * c.KSUB if c.mma == "fp8" else c.BK
        ku, kd = moe_plan.split_ks(c, 6, 96, 5120, 2304)
        assert (5120 // unit) % ku == 0 and (2304 // unit) % kd == 0
        assert 5120 // unit // ku >= 2 and 2304 // unit // kd >= 2
        assert 6 * (2304 // c.BN_UP) * ku >= c.min_programs and 6 * (5120 // c.BN_DOWN) * kd >= c.min_programs
    assert moe_plan.split_k(512, 128, 1, 1, 10 ** 6) == 2               # capped: >= 2 units per split
    with pytest.raises(ValueError):
        moe_plan.split_k(512, 128, 1, 1, 1, ks=3)


@pytest.mark.parametrize("T,k,E,BM,skew", [(1, 6, 96, 16, 0.0), (16, 6, 96, 16, 0.0), (256, 6, 96, 16, 3.0),
                                           (7, 3, 5, 16, 3.0), (5, 2, 40, 128, 0.0), (300, 6, 8, 128, 1.0),
                                           (3, 1, 1, 16, 0.0), (341, 6, 96, 16, 2.0)])
def test_onehot_schedule_equals_sort(T, k, E, BM, skew):
    """The sort-free decode prep (one-hot compares and sums) gives exactly the argsort path's integers, and
    prepare's gathered routing weights bit for bit."""
    key = jax.random.PRNGKey(T * 7 + E)
    scores = jax.random.gumbel(key, (T, E)) + jnp.linspace(0, skew, E)
    idx = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    if T > 1:   # some slots carry id E, ep_moe's "not local" marker: they sort last and join no tile
        idx = idx.at[::2, 0].set(E)
    a = moe_plan.tile_schedule(idx, E, BM, method="sort")
    b = moe_plan.tile_schedule(idx, E, BM, method="onehot")
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    w = jax.random.uniform(jax.random.fold_in(key, 1), (T, k), jnp.float32)
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, 64), jnp.float32)
    p = jax.jit(lambda x, i, w: moe_plan.prepare(x, i, w, E=E, BM=BM, act_fp8=True))(x, idx, w)
    order = np.asarray(a[0])
    np.testing.assert_array_equal(np.asarray(p["order"]), order)
    np.testing.assert_array_equal(np.asarray(p["rw"]), np.asarray(w).reshape(-1)[order])
    np.testing.assert_array_equal(np.asarray(p["tok"]), order // k)
    for name, v in zip(("tile_e", "tile_s", "tile_end"), a[1:]):
        np.testing.assert_array_equal(np.asarray(p[name]), np.asarray(v))


def test_fit_config_shrinks_blocks_to_small_models_and_keeps_v41_configs():
    for cfg in moe_plan.named_configs().values():          # tuned at V4.1's sizes: untouched there
        assert moe_plan.fit_config(cfg, 5120, 2304) == cfg
    for rows, act_fp8 in ((8, True), (8, False), (4096, True)):  # the tiny preset: d = 256, I = 64
        cfg = moe_plan.fit_config(moe_plan.pick_config(rows, 8, act_fp8), 256, 64)
        assert 64 % cfg.BN_UP == 0 and 256 % cfg.BN_DOWN == 0 and min(cfg.BN_UP, cfg.BN_DOWN, cfg.BK) >= 32
        assert 64 % cfg.BK == 0 and (64 // 32) % cfg.KSUB == 0
        if cfg.kind == "sk":                              # a split-K plan exists at that size
            assert moe_plan.split_ks(cfg, rows * 2, 8, 256, 64)[0] >= 1
    with pytest.raises(ValueError, match="divisible by 32"):
        moe_plan.fit_config(moe_plan.DECODE_CONFIG, 256, 48)


def test_post_scale_configs_plan():
    """The mma "swap_ps" decode variants (2026-12-01, not defaults): V4.1 split plans as the swapped kernels', and
    the launcher's static plan sends h as FP8 codes + scales and refuses bf16 activations. The split numbers are
    the ones the sm_90 compile stats in NOTES.md were taken at."""
    names = ("sw_ps", "sw_ps_bk64", "sw_ps_bn128", "sw_ps_bn128_bk64", "sw_ps_bm8", "sw_ps_bm8_w2")
    for name in names:
        c = moe_plan.named_config(name)
        assert c.kind == "sk" and c.mma == "swap_ps" and not c.prefetch
        assert moe_plan.pick_config(6, 96) is not c and moe_plan.pick_config(96, 96) is not c
        ku, kd = moe_plan.split_ks(c, 6, 96, 5120, 2304)
        assert 6 * (2304 // c.BN_UP) * ku >= c.min_programs and 6 * (5120 // c.BN_DOWN) * kd >= c.min_programs
        assert moe_plan.split_ks(c, 96, 96, 5120, 2304) == (1, 1)
    assert moe_plan.split_ks(moe_plan.named_config("sw_ps"), 6, 96, 5120, 2304) == (5, 3)
    assert moe_plan.split_ks(moe_plan.named_config("sw_ps_bn128"), 6, 96, 5120, 2304) == (10, 6)
    pytest.importorskip("triton")
    from dsflash.kernels import moe_gemm_triton as mt
    for name in names:
        c = moe_plan.named_config(name)
        assert mt.sk_plan(c, 96, 96, 5120, 2304)["hout"] == 0
        with pytest.raises(NotImplementedError):
            mt.sk_plan(c, 96, 96, 5120, 2304, act_fp8=False)
    assert moe_plan.split_ks(moe_plan.named_config("sw_ps_bm8"), 6, 96, 5120, 2304) == (5, 3)
    assert moe_plan.split_ks(moe_plan.named_config("sw_ps_bm8_ks1"), 6, 96, 5120, 2304) == (1, 1)
    assert moe_plan.num_tiles(96, 96, 8) == 108                  # 16 tokens: 12 more (spare) tiles than BM 16
    # the kinds before it are unchanged: swapped kernels send bf16 carriers, the fp8 split-K kernel codes + scales
    assert mt.sk_plan(moe_plan.named_config("sw_eo_np"), 96, 96, 5120, 2304)["hout"] == 1
    assert mt.sk_plan(moe_plan.named_config("sw_eo_np"), 96, 96, 5120, 2304, act_fp8=False)["hout"] == 2
    assert mt.sk_plan(moe_plan.named_config("sk_fp8"), 96, 96, 5120, 2304)["hout"] == 0
