"""CPU-host sm_90 compile of the MoE decode kernels (scripts/sm90_compile.py: triton's bundled ptxas / nvdisasm, no
GPU): guards the compile-level facts NOTES.md's 2026-12-01 section relies on -- no register spills in the decode
kernels, mma.sync for BM 8 tiles and wgmma for BM 16, and the post-scale kernels' shorter inner loop. Skipped where
triton is not installed (CI)."""
import os
import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sm90_compile  # noqa: E402


def _main_kernels(name, T):
    reps = sm90_compile.moe_reports(name, T)
    return [r for r in reps if "_kernel_" in r.name]


@pytest.mark.parametrize("name", ["sw_eo_np", "sw_ps", "sw_ps_bm8"])
def test_decode_kernels_compile_without_spills(name):
    for T in (1, 16):
        for r in _main_kernels(name, T):
            assert r.spill_stores == 0 and r.spill_loads == 0, (name, T, r.name, r.ptxas_log[-300:])
            assert r.main_loop is not None and r.loop_elems > 0, (name, r.name)


def test_post_scale_loop_is_shorter_and_bm8_uses_mma_sync():
    eo = {r.name: r for r in _main_kernels("sw_eo_np", 16)}
    bm8 = {r.name: r for r in _main_kernels("sw_ps_bm8", 16)}
    for r in eo.values():
        assert r.features["HGMMA(sass)"] > 0 and r.features["HMMA(sass)"] == 0
    for r in bm8.values():
        assert r.features["HMMA(sass)"] > 0 and r.features["HGMMA(sass)"] == 0
        assert r.regs <= 96, r.regs                       # 66 / 53 with triton 3.6.0
    # thread instructions per weight element in the inner loop: 6.7 / 6.8 (sw_eo_np) vs 3.6 / 4.4 (sw_ps_bm8)
    assert bm8["_moe_up_kernel_ps"].per_elem() < 0.8 * eo["_moe_up_kernel_sw"].per_elem()
    assert bm8["_moe_down_kernel_ps"].per_elem() < 0.8 * eo["_moe_down_kernel_sw"].per_elem()


def test_il_layout_decode_is_conversion_free_and_about_half_the_loop():
    """mma "swap_il" (load-time weight layout, kernels/moe_layout.py): wgmma fed straight from the decode registers (no
    shared-memory round trip or shuffle between the decode and the MMA: no STSM / LDSM / SHFL in the loop), no
    spills, and the loop at most 0.6x sw_eo_np's instructions per weight element (3.6 vs 6.7-6.8 with triton 3.6.0)."""
    eo = {r.name: r for r in _main_kernels("sw_eo_np", 16)}
    for T in (1, 16):
        il = {r.name: r for r in _main_kernels("sw_il", T)}
        assert set(il) == {"_moe_up_kernel_il", "_moe_down_kernel_il"}, set(il)
        for r in il.values():
            assert r.spill_stores == 0 and r.spill_loads == 0, (T, r.name)
            assert r.features["HGMMA(sass)"] > 0 and r.features["HMMA(sass)"] == 0
            lp = r.main_loop
            assert all(lp.ops[o] == 0 for o in ("STSM", "LDSM", "SHFL")), (T, r.name, dict(lp.ops))
            assert lp.ops["HMUL2"] == r.loop_elems // (32 * r.num_warps) // 2, dict(lp.ops)   # one per 2 weights
            assert lp.ops["F2FP"] <= 16 and lp.ops["HADD2"] <= 16       # only x's FP8 dequantisation (up kernel)
        assert il["_moe_up_kernel_il"].per_elem() < 0.6 * eo["_moe_up_kernel_sw"].per_elem()
        assert il["_moe_down_kernel_il"].per_elem() < 0.6 * eo["_moe_down_kernel_sw"].per_elem()


def test_x_dequantised_once_shortens_the_prefill_up_loop():
    """act "bf16rt" on the il prefill tile (x's FP8 -> bf16 once per token, not in each of the 36 column tiles):
    the up kernel's loop loses the x conversion (846 -> 568 SASS per iteration at BM 128, 641 -> 482 at BM 64 with
    triton 3.6.0), the down kernel is unchanged, and the dequant kernel is a small spill-free pass."""
    base = {r.name: r for r in sm90_compile.moe_reports("sw_il_bm64", 4096)}
    xb = {r.name: r for r in sm90_compile.moe_reports("sw_il_bm64_xb", 4096)}
    assert set(xb) == set(base) | {"_x_dequant_kernel"}, set(xb)
    up, up_xb = base["_moe_up_kernel_il"], xb["_moe_up_kernel_il"]
    assert up_xb.spill_stores == 0 and up_xb.spill_loads == 0
    assert up_xb.per_elem() < 0.8 * up.per_elem(), (up_xb.per_elem(), up.per_elem())
    assert up_xb.main_loop.ops["F2FP"] < up.main_loop.ops["F2FP"] // 2, (dict(up_xb.main_loop.ops), dict(up.main_loop.ops))
    assert xb["_moe_down_kernel_il"].per_elem() == base["_moe_down_kernel_il"].per_elem()
    dq = xb["_x_dequant_kernel"]
    assert dq.spill_stores == 0 and dq.regs <= 64, dq.regs


def test_split_gate_up_doubles_the_up_kernels_programs_per_sm():
    """split_gate_up (one of W1 / W3 a program, session 13): the up kernel keeps one accumulator and one matrix's
    decoded planes, so at 192 tokens its registers fall from 116 to 64 with triton 3.6.0 and twice the programs fit
    an SM (ncu read the joint kernel latency-bound at 4); its loop is one matrix's share of the joint loop plus x's
    dequantisation, which each program now repeats; no spills, still wgmma."""
    joint = {r.name: r for r in _main_kernels("sw_il", 192)}["_moe_up_kernel_il"]
    gu = {r.name: r for r in _main_kernels("sw_il_gu", 192)}
    assert set(gu) == {"_moe_up_kernel_il", "_moe_down_kernel_il"}, set(gu)   # + the split-K epilogue
    up = gu["_moe_up_kernel_il"]
    assert up.spill_stores == 0 and up.spill_loads == 0 and up.features["HGMMA(sass)"] > 0
    assert up.regs <= 80 < joint.regs, (up.regs, joint.regs)
    assert up.main_loop.ops["HMUL2"] * 2 == joint.main_loop.ops["HMUL2"], (up.main_loop.ops, joint.main_loop.ops)
    assert up.per_elem() < 1.3 * joint.per_elem(), (up.per_elem(), joint.per_elem())


def _blocks_per_sm(r):
    return int(sm90_compile._occupancy(r.regs, r.num_warps, r.smem).split()[0])


@pytest.mark.parametrize("name", ["sw_il_bm128_ksd3", "sw_il_bm64_xb_s2", "sw_il_bm128_gu_xb", "sw_il_bm64_gu_xb_s2",
                                  "sw_il_bm128_nf_g8_hp", "sw_il_bm128_nf_g8_hp_sd2", "sw_il_bm128_nf_g8_hp_xp",
                                  "sw_il_bm128_nf_g8_hp_dp", "sw_il_bm128_nf_g8_hp_xp_dp"])
def test_prefill_candidates_compile_without_spills(name):
    """The 2026-12-06 prefill candidates (experimental/moe_configs.py) at 4096 tokens: every launch spill-free, the
    GEMMs on wgmma, and the facts each was added for (triton 3.6.0: NOTES.md / the helper's table) -- the split down
    GEMM through the split-K reduction, 4 down programs per SM at BM 64 stages 2, 3 split up programs per SM there, and
    BM 128 split gate / up without the 16 B spill of sw_il_bm128_xb's joint up kernel."""
    reps = {r.name: r for r in sm90_compile.moe_reports(name, 4096)}
    for r in reps.values():
        # down_pair's two accumulators: 12 B spilled outside the loop (the epilogue's second store; triton 3.6.0)
        allowed = 16 if name.endswith("_dp") and r.name == "_moe_down_kernel_il" else 0
        assert r.spill_stores <= allowed and r.spill_loads <= allowed, (name, r.name, r.ptxas_log[-300:])
    up, down = reps["_moe_up_kernel_il"], reps["_moe_down_kernel_il"]
    for r in (up, down):
        assert r.features["HGMMA(sass)"] > 0 and r.main_loop is not None and r.loop_elems > 0, (name, r.name)
    if name.endswith("_ksd3"):
        assert "_moe_down_reduce_sk" in reps and "KS=3" in down.label, (set(reps), down.label)
    if "_gu" in name:
        assert "_moe_up_epilogue_sk" in reps and "_x_dequant_kernel" in reps, set(reps)
    if "bm64" in name and name.endswith("_s2"):
        assert _blocks_per_sm(down) >= 4, (down.regs, down.smem)
    if name == "sw_il_bm64_gu_xb_s2":
        assert _blocks_per_sm(up) >= 3, (up.regs, up.smem)
    if "_hp" in name:
        # plane_h (session 18): h's two planes staged straight into the wgmma operand, so the down loop has no even /
        # odd split (PRMT), no store back (STS) and no LDS of h (triton 3.6.0: 377 -> 265 SASS, 208 -> 167 registers)
        lp = down.main_loop
        assert lp.ops["PRMT"] == 0 and lp.ops["STS"] == 0, dict(lp.ops)
        if not name.endswith("_dp"):                                # (two weight slabs a loop with down_pair)
            assert lp.ops["LDS"] <= 8 and lp.n < 0.75 * 377 and down.regs <= 168, (dict(lp.ops), lp.n, down.regs)
        if "_xp" in name:
            # plane_x (session 19): x dequantised once into plane order, so the up loop has neither x's dequantisation
            # (F2FP / HADD2 / FMUL per element) nor its even / odd split (PRMT / STS) (triton 3.6.0: 842 -> 447 SASS)
            lp = up.main_loop
            assert "_x_dequant_kernel" in reps, set(reps)
            assert lp.ops["F2FP"] == 0 and lp.ops["HADD2"] == 0 and lp.ops["PRMT"] == 0 and lp.ops["STS"] == 0, \
                dict(lp.ops)
            assert lp.n < 0.6 * 842, lp.n
        else:
            assert up.main_loop.n <= 1.02 * 840, up.main_loop.n      # the up loop unchanged (its h store permuted)
    if name.endswith("_dp"):
        # down_pair: half the down programs, each with both column blocks' 8 + 8 wgmmas on one h slab, no spill in the
        # loop (triton 3.6.0: 440 SASS a slab for two blocks against _hp's 265 for one)
        assert "(40, " in down.label and down.main_loop.ops["HGMMA"] == 16, (down.label, dict(down.main_loop.ops))
        assert down.main_loop.ops["LDL"] == 0 and down.main_loop.ops["STL"] == 0, dict(down.main_loop.ops)
        assert down.main_loop.n < 2 * 265 * 0.9, down.main_loop.n
    if name.endswith("_sd2"):
        assert down.num_stages == 2 and up.num_stages == 3 and _blocks_per_sm(down) >= 3, (down.regs, down.smem)


@pytest.mark.parametrize("name,base", [("sw_il_bm128_nf", "sw_il_bm128"), ("sw_il_bm64_xb_nf", "sw_il_bm64_xb"),
                                       ("sw_il_bm128_nf_g8", "sw_il_bm128"),
                                       ("sw_il_bm128_gu_xb_nf", "sw_il_bm128_gu_xb")])
def test_n_fast_swaps_the_grid_and_keeps_the_loop(name, base):
    """n_fast (column blocks launched fastest) changes which program id names the M tile, nothing else: the launch
    grids are the base config's with their first two axes swapped, no spills, and the hot loops within a few SASS of
    the base config's (triton 3.6.0: 856 / 378 against 846 / 374 at BM 128). group_m (the grouped order) only adds
    the program-id arithmetic before the loop."""
    new = {r.name: r for r in sm90_compile.moe_reports(name, 4096)}
    old = {r.name: r for r in sm90_compile.moe_reports(base, 4096)}
    assert set(new) == set(old), (set(new), set(old))
    for k in ("_moe_up_kernel_il", "_moe_down_kernel_il"):
        g_new = new[k].label.split("grid ")[1].split(")")[0]
        g_old = old[k].label.split("grid ")[1].split(")")[0]
        a, b, c = (int(v) for v in g_old.strip("(").split(","))
        assert [int(v) for v in g_new.strip("(").split(",")] == [b, a, c], (g_new, g_old)
        assert new[k].spill_stores == 0 and new[k].spill_loads == 0, new[k].ptxas_log[-300:]
        assert abs(new[k].main_loop.n - old[k].main_loop.n) <= 0.05 * old[k].main_loop.n, k
