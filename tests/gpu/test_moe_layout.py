"""mma "swap_il" (routed-expert weights in the load-time "il" layout, ``dsflash.kernels.moe_layout``; 2026-12-03,
CPU-checked only before this file first runs on a GPU) against ``routed_moe_reference`` and against ``sw_eo_np``.

The il kernels feed the MMAs the same bf16 planes in the same order as ``sw_eo_np`` (same tiles, splits and
epilogues), so their outputs must be bit-identical to ``sw_eo_np``'s on the checkpoint weights -- a stronger check
than the tolerance against the reference (test_moe_gemm.py's, 5e-3) that the il config also has to meet. The weights
are repacked once outside the jitted call, as at load time."""
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from dsflash.kernels import moe_gemm, moe_layout, moe_plan  # noqa: E402

pytestmark = pytest.mark.gpu
LIMIT = 10.0
TOL = 5e-3

CASES = [(1, 6, 16, 512, 256), (5, 6, 8, 512, 256), (64, 6, 16, 1024, 512), (300, 4, 8, 512, 768),
         (1, 6, 96, 5120, 2304), (16, 6, 96, 5120, 2304), (192, 6, 96, 5120, 2304)]   # V4.1: 1, 16, 32 x 6 rows


def _problem(case, tag, scale_range=(119, 123)):
    T, k, E, d, I = case
    key = jax.random.PRNGKey(zlib.crc32(repr((case, tag, scale_range)).encode()) % (2 ** 31))
    return moe_plan.random_moe_problem(key, T, k, E, d, I, scale_range=scale_range)


def _run(cfg_name, args, precision, weights=None):
    from dsflash.kernels import moe_gemm_triton as mt
    cfg = moe_plan.named_config(cfg_name)
    x, idx, w, *ws = args
    fn = jax.jit(lambda *a: mt.routed_moe_triton(*a, limit=LIMIT, precision=precision, config=cfg,
                                                 return_intermediates=True))
    out, inter = fn(x, idx, w, *(weights if weights is not None else ws))
    return np.asarray(out), np.asarray(inter["hq"]), np.asarray(inter["o"])


@pytest.mark.parametrize("precision", ["reference", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda v: "T{}k{}E{}d{}I{}".format(*v))
def test_il_matches_reference_and_is_bit_identical_to_sw_eo_np(case, precision):
    if precision == "bf16" and case[0] not in (5, 16):
        pytest.skip("bf16 activations: two shapes are enough")
    args = _problem(case, precision)
    il = moe_layout.repack_experts(*args[3:])
    out, h, o = _run("sw_il", args, precision, weights=il)
    assert out.shape == (case[0], case[3]) and np.all(np.isfinite(out))
    ref = np.asarray(moe_gemm.routed_moe_reference(*args, limit=LIMIT, precision=precision), np.float64)
    err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    out0, h0, o0 = _run("sw_eo_np", args, precision)
    same_o = np.array_equal(o.view(np.uint16), o0.view(np.uint16))
    same_h = np.array_equal(h.view(np.uint16), h0.view(np.uint16))
    print(f"{case} {precision}: rel err vs reference {err:.2e} (sw_eo_np "
          f"{float(np.linalg.norm(out0 - ref) / max(np.linalg.norm(ref), 1e-30)):.2e}); bit-identical to sw_eo_np: "
          f"h {same_h}, o {same_o}, out {np.array_equal(out, out0)}")
    assert err < TOL, err
    assert same_h and same_o, (same_h, same_o)


def test_il_extreme_scales_bit_identical():
    """Scales 2..128 (weights up to 12 in magnitude and down to 2^-126): still the same planes as sw_eo_np."""
    args = _problem((16, 6, 16, 512, 256), "extreme", scale_range=(2, 128))
    out, h, o = _run("sw_il", args, "reference", weights=moe_layout.repack_experts(*args[3:]))
    out0, h0, o0 = _run("sw_eo_np", args, "reference")
    assert np.array_equal(o.view(np.uint16), o0.view(np.uint16)) and np.array_equal(out, out0)


def test_il_weights_through_the_default_front_end():
    """Without a config: il weights run swap_il at every size (BM 16 / 32 / 128 by slots per expert, never the
    checkpoint-layout prefill kernel on converted weights), within the reference tolerance."""
    from dsflash.kernels import moe_gemm_triton as mt
    for case in ((16, 6, 16, 512, 256), (1024, 6, 16, 512, 256), (160, 6, 16, 512, 256)):
        args = _problem(case, "front")
        il = moe_layout.repack_experts(*args[3:])
        a = np.asarray(jax.jit(lambda *v: mt.routed_moe_triton(*v, limit=LIMIT))(*args[:3], *il))
        ref = np.asarray(moe_gemm.routed_moe_reference(*args, limit=LIMIT))
        assert np.all(np.isfinite(a)) and float(np.linalg.norm(a - ref) / np.linalg.norm(ref)) < TOL


@pytest.mark.parametrize("name", ["sw_il_bm32", "sw_il_bm64", "sw_il_bm128"])
@pytest.mark.parametrize("T", [256, 1024])
def test_wide_il_tiles_at_v41_widths_match_the_reference(name, T):
    """The prefill tiles (run 39) at V4.1 widths, within the tolerance every MoE kernel meets (not bit-identity to
    sw_eo_np: a wider tile changes the K split, so the partial sums add in another order)."""
    case = (T, 6, 96, 5120, 2304)
    args = _problem(case, name)
    out, h, o = _run(name, args, "reference", weights=moe_layout.repack_experts(*args[3:]))
    ref = np.asarray(moe_gemm.routed_moe_reference(*args, limit=LIMIT), np.float64)
    err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    print(f"{name} T{T}: rel err vs reference {err:.2e}")
    assert out.shape == (T, 5120) and np.all(np.isfinite(out)) and err < TOL, err


@pytest.mark.parametrize("name", ["sw_il_bm32", "sw_il_bm64", "sw_il_bm128"])
def test_x_dequantised_once_is_bit_identical_to_in_loop(name):
    """act "bf16rt" (x's FP8 codes dequantised once by moe_layout_kernels.x_dequant, then bf16 x in the up kernel)
    feeds the MMAs the same bf16 values as the in-loop dequantisation: same outputs bit for bit."""
    case = (1024, 6, 96, 5120, 2304)
    args = _problem(case, name)
    w = moe_layout.repack_experts(*args[3:])
    out, h, o = _run(name, args, "reference", weights=w)
    out_xb, h_xb, o_xb = _run(name + "_xb", args, "reference", weights=w)
    assert np.array_equal(np.asarray(o).view(np.uint16), np.asarray(o_xb).view(np.uint16))
    assert np.array_equal(np.asarray(h).view(np.uint16), np.asarray(h_xb).view(np.uint16))


@pytest.mark.parametrize("pair", [("sw_il", "sw_il_gu"), ("sw_il", "sw_il_gu_xb"), ("sw_il_bm32", "sw_il_bm32_gu")],
                         ids=lambda p: p[1])
@pytest.mark.parametrize("T", [1, 32, 192])
def test_split_gate_up_is_bit_identical_to_the_joint_kernel(pair, T):
    """split_gate_up: the same dots per matrix, their fp32 sums through the split-K epilogue, so h and o equal the
    joint kernel's bit for bit wherever both split K the same way (KS 1 at 32 and 192 tokens; at 1 token the auto
    split may differ, then within the reference tolerance)."""
    from dsflash.kernels import moe_gemm_triton as mt
    joint, gu = pair
    case = (T, 6, 96, 5120, 2304)
    args = _problem(case, gu)
    w = moe_layout.repack_experts(*args[3:])
    out, h, o = _run(joint, args, "reference", weights=w)
    out_g, h_g, o_g = _run(gu, args, "reference", weights=w)
    S, E, d, I = T * 6, 96, 5120, 2304
    same_split = (mt.sk_plan(moe_plan.named_config(joint), S, E, d, I)["ks_up"]
                  == mt.sk_plan(moe_plan.named_config(gu), S, E, d, I)["ks_up"])
    ref = np.asarray(moe_gemm.routed_moe_reference(*args, limit=LIMIT), np.float64)
    err = float(np.linalg.norm(out_g - ref) / max(np.linalg.norm(ref), 1e-30))
    print(f"{gu} T{T}: same K split {same_split}, rel err vs reference {err:.2e}")
    assert err < TOL, err
    if same_split:
        assert np.array_equal(h.view(np.uint16), h_g.view(np.uint16))
        assert np.array_equal(o.view(np.uint16), o_g.view(np.uint16))


@pytest.mark.parametrize("pair", [("sw_il_bm128", "sw_il_bm128_nf"), ("sw_il_bm128", "sw_il_bm128_nf_g4"),
                                  ("sw_il_bm128", "sw_il_bm128_nf_g8"), ("sw_il_bm64_xb", "sw_il_bm64_xb_nf"),
                                  ("sw_il_bm128_gu_xb", "sw_il_bm128_gu_xb_nf"),
                                  ("sw_il_bm128_nf_g8", "sw_il_bm128_nf_g8_hp"),
                                  ("sw_il_bm128_nf_g8", "sw_il_bm128_nf_g8_hp_sd2"),
                                  ("sw_il_bm128_nf_g8", "sw_il_bm128_nf_g8_hp_xp"),
                                  ("sw_il_bm128_nf_g8", "sw_il_bm128_nf_g8_xp"),
                                  ("sw_il_bm128_nf_g8", "sw_il_bm128_nf_g8_hp_dp"),
                                  ("sw_il_bm128_nf_g8", "sw_il_bm128_nf_g8_hp_xp_dp")], ids=lambda p: p[1])
def test_launch_order_is_bit_identical(pair):
    """n_fast / group_m change only the order the programs launch in (moe_layout_kernels._tile_il): every (tile,
    column block) program runs once with the same math, so h and o equal the base config's bit for bit. 4096 tokens:
    ~3 tiles per expert at BM 128, so groups are short and the last one partial (288 tiles). plane_h (``_hp``) only
    changes where h's columns are stored (the launcher un-permutes the returned h) and how the down kernel stages
    them: the same dots on the same operands, so the same bits. plane_x (``_xp``) likewise reads x dequantised once
    into plane order (act "bf16rt"): the values the in-loop dequantisation makes, in the same two dots."""
    base, new = pair
    case = (4096, 6, 96, 5120, 2304)
    args = _problem(case, new)
    w = moe_layout.repack_experts(*args[3:])
    out, h, o = _run(base, args, "reference", weights=w)
    out_n, h_n, o_n = _run(new, args, "reference", weights=w)
    assert np.array_equal(h.view(np.uint16), h_n.view(np.uint16))
    assert np.array_equal(o.view(np.uint16), o_n.view(np.uint16))


@pytest.mark.parametrize("pair", [("sw_il", "sw_il_tm"), ("sw_il", "sw_il_tm2"), ("sw_il_bm32", "sw_il_bm32_tm"),
                                  ("sw_il_bm32", "sw_il_bm32_tm2")], ids=lambda p: p[1])
@pytest.mark.parametrize("T", [6, 192])
def test_tile_major_is_bit_identical_to_plain_il(pair, T):
    """tile_major (session 28, level 2 session 30; ``moe_layout.to_tiles``): the weights permuted so that a program's
    (64-row block, slab) is one contiguous run; only ``_il_load``'s addresses change, so h and o equal the plain-il
    config's bit for bit on the same weights tiled at the config's level (V4.1 widths, the two decode bands)."""
    base, tm = pair
    case = (T, 6, 96, 5120, 2304)
    args = _problem(case, tm)
    w = moe_layout.repack_experts(*args[3:])
    level = moe_plan.named_config(tm).tile_major
    wt = moe_layout.tile_experts(*w, level=level)
    out, h, o = _run(base, args, "reference", weights=w)
    out_t, h_t, o_t = _run(tm, args, "reference", weights=wt)
    ref = np.asarray(moe_gemm.routed_moe_reference(*args, limit=LIMIT), np.float64)
    err = float(np.linalg.norm(out_t - ref) / max(np.linalg.norm(ref), 1e-30))
    same_h = np.array_equal(h.view(np.uint16), h_t.view(np.uint16))
    same_o = np.array_equal(o.view(np.uint16), o_t.view(np.uint16))
    print(f"{tm} (level {level}) T{T}: rel err vs reference {err:.2e}; bit-identical to {base}: h {same_h}, o {same_o}")
    assert err < TOL, err
    assert same_h and same_o, (same_h, same_o)
