"""The il decode ladder (``MoeConfig.probe``, session 29; scripts/gpu_moe_ladder.py) on a CPU host: the knob defaults
to 0 and stays off every launch that does not ask for it, the named probe configs resolve and carry PROBE (and the
loop's num_stages) to both il launches through the real launcher, bad combinations are refused, and -- by the sm_90
compile (triton's bundled ptxas, no GPU) -- the dot-less rungs still stream their weights through the pipelined
cp.async path the kernel uses. Skipped where triton is not installed."""
import dataclasses
import os
import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sm90_compile  # noqa: E402

from dsflash.kernels import moe_plan  # noqa: E402
from dsflash.kernels.experimental import moe_configs, moe_layout_kernels as K  # noqa: E402
from dsflash.kernels.moe_config import MoeConfig  # noqa: E402

PROBE_NAMES = [f"{b}_probe{p}" for b in ("sw_il", "sw_il_bm32") for p in (1, 2, 3, 4)]


def _param_default(fn, name):
    return next(p.default for p in fn.params if p.name == name)


def test_probe_defaults_to_zero_everywhere_but_the_probe_configs():
    assert MoeConfig().probe == 0
    assert _param_default(K._moe_up_kernel_il, "PROBE") == 0
    assert _param_default(K._moe_down_kernel_il, "PROBE") == 0
    assert _param_default(K._moe_up_kernel_il, "NSTAGE") is None
    assert _param_default(K._moe_down_kernel_il, "NSTAGE") is None
    named = moe_plan.named_configs()
    assert {n for n, c in named.items() if c.probe} == set(PROBE_NAMES)
    for name in moe_plan.NAMED_CONFIGS:                       # the serving defaults
        assert moe_plan.NAMED_CONFIGS[name].probe == 0


@pytest.mark.parametrize("name", PROBE_NAMES)
def test_probe_configs_resolve_and_reach_both_il_launches(name):
    base, p = name.rsplit("_probe", 1)
    cfg = moe_plan.named_config(name)
    assert cfg == dataclasses.replace(moe_plan.named_config(base), probe=int(p))
    T = 6 if base == "sw_il" else 192
    _, calls = sm90_compile.moe_launches(name, T)
    il = {c["kernel"].__name__: c for c in calls if c["kernel"].__name__.endswith("_kernel_il")}
    assert set(il) == {"_moe_up_kernel_il", "_moe_down_kernel_il"}
    for kn, c in il.items():
        assert c["constexprs"]["PROBE"] == int(p), (kn, c["constexprs"])
        assert c["constexprs"]["NSTAGE"] == c["num_stages"] == cfg.stages, (kn, c)


@pytest.mark.parametrize("base,T", [("sw_il", 6), ("sw_il_bm32", 192)])
def test_probe_zero_launches_keep_their_constexprs(base, T):
    """At probe 0 the il launches get PROBE 0 and NSTAGE None -- the kernels' defaults, passed explicitly (jax-triton
    sends a left-out constexpr as None: tests/test_kernels_launch_constexprs.py), so the K loop carries no num_stages
    of its own and the kernels compile as before the ladder existed (the sm_90 SASS was checked identical when it
    was added)."""
    _, calls = sm90_compile.moe_launches(base, T)
    il = [c for c in calls if c["kernel"].__name__.endswith("_kernel_il")]
    assert len(il) == 2
    for c in il:
        assert c["constexprs"].get("PROBE", 0) == 0 and c["constexprs"].get("NSTAGE") is None, c["constexprs"]
    assert K.il_up_constexprs(moe_plan.named_config(base)) == dict(GU=0, XP=0, PROBE=0, NSTAGE=None)
    assert K.il_down_constexprs(moe_plan.named_config(base)) == dict(DP=0, PROBE=0, NSTAGE=None)


def test_bad_probe_configs_are_refused():
    cfg = moe_plan.named_config("sw_il")
    with pytest.raises(ValueError, match="probe is one of"):
        K.check_config(dataclasses.replace(cfg, probe=5))
    for kw in (dict(plane_h=True), dict(split_gate_up=True), dict(act="bf16rt", plane_x=True),
               dict(plane_h=True, down_pair=True)):
        with pytest.raises(ValueError, match="decode ladder"):
            K.check_config(dataclasses.replace(cfg, probe=1, **kw))


def test_ladder_occupancy_helpers_match_the_compile_tool():
    import gpu_moe_ladder as L
    for regs, warps, smem in ((116, 4, 37120), (64, 4, 29440), (61, 4, 26112), (40, 4, 13056), (128, 4, 48128)):
        blocks = L.blocks_per_sm(regs, warps, smem)
        assert sm90_compile._occupancy(regs, warps, smem).startswith(f"{blocks} blocks"), (regs, smem)
    for own, b0 in ((26112, 4), (13056, 7), (33024, 4), (45824, 4)):
        s = L.pin_smem(own, b0)
        assert s >= own and L.blocks_per_sm(32, 4, s) == min(b0, L.blocks_per_sm(32, 4, own))


def test_dotless_rungs_keep_the_pipelined_weight_loads():
    """Rungs 1 / 2 have no dot: Triton pipelines such a loop's loads only when the loop carries num_stages (NSTAGE).
    With it the weights still arrive by cp.async (LDGSTS) into the same number of shared-memory stages; without it
    they would be plain register loads -- a different kernel."""
    reps = {r.name: r for r in sm90_compile.moe_reports("sw_il_bm32_probe1", 192)}
    up = reps["_moe_up_kernel_il"]
    assert up.features["HGMMA(sass)"] == 0 and up.ops["LDGSTS"] > 0 and up.main_loop.ops["LDGSTS"] > 0
    # 3 stages ahead of two 4-KB weight slabs + two 256-B scale columns (26,112 B with triton 3.6.0)
    assert up.smem >= 3 * (2 * 4096 + 2 * 256), up.smem
    assert up.spill_stores == 0 and up.spill_loads == 0
    ref = {r.name: r for r in sm90_compile.moe_reports("sw_il_bm32", 192)}["_moe_up_kernel_il"]
    assert up.main_loop.n < 0.3 * ref.main_loop.n            # the loop is little more than its loads


def test_probe_configs_are_only_for_the_decode_bands():
    assert set(moe_configs.PROBE_BASES) == {"sw_il", "sw_il_bm32"}
