"""The il decode ladder (``MoeConfig.probe``, session 29; scripts/gpu_moe_ladder.py) on a CPU host: the knob defaults
to 0 and stays off every launch that does not ask for it, the named probe configs resolve and carry PROBE (and the
loop's num_stages) to both il launches through the real launcher, bad combinations are refused, and -- by the sm_90
compile (triton's bundled ptxas, no GPU) -- the dot-less rungs still stream their weights through the pipelined
cp.async path the kernel uses. Skipped where triton is not installed."""
import dataclasses
import os
import sys

import numpy as np
import pytest

pytest.importorskip("triton")
import jax  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sm90_compile  # noqa: E402

from dsflash.kernels import moe_plan  # noqa: E402
from dsflash.kernels.experimental import moe_configs, moe_layout_kernels as K  # noqa: E402
from dsflash.kernels.moe_config import MoeConfig  # noqa: E402

PROBE_NAMES = [f"{b}_probe{p}" for b in ("sw_il", "sw_il_bm32") for p in (1, 2, 3, 4, 5, 6, 7, 8)]
# the tile-major layout's rungs (session 30): rungs 1, 2, 5, 7 of the tiled decode bands (moe_configs.TM_PROBE_BASES)
TM_PROBE_NAMES = [f"{b}_probe{p}" for b in ("sw_il_tm", "sw_il_bm32_tm", "sw_il_tm2", "sw_il_bm32_tm2")
                  for p in (1, 2, 5, 7)]


def _param_default(fn, name):
    return next(p.default for p in fn.params if p.name == name)


def test_probe_defaults_to_zero_everywhere_but_the_probe_configs():
    assert MoeConfig().probe == 0
    assert _param_default(K._moe_up_kernel_il, "PROBE") == 0
    assert _param_default(K._moe_down_kernel_il, "PROBE") == 0
    assert _param_default(K._moe_up_kernel_il, "NSTAGE") is None
    assert _param_default(K._moe_down_kernel_il, "NSTAGE") is None
    named = moe_plan.named_configs()
    assert {n for n, c in named.items() if c.probe} == set(PROBE_NAMES) | set(TM_PROBE_NAMES)
    for name in moe_plan.NAMED_CONFIGS:                       # the serving defaults
        assert moe_plan.NAMED_CONFIGS[name].probe == 0


@pytest.mark.parametrize("name", PROBE_NAMES)
def test_probe_configs_resolve_and_reach_both_il_launches(name):
    base, p = name.rsplit("_probe", 1)
    cfg = moe_plan.named_config(name)
    # ladder 2's rung 8 is rung 7's loop in split_gate_up programs
    assert cfg == dataclasses.replace(moe_plan.named_config(base), probe=int(p), split_gate_up=int(p) == 8)
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
        K.check_config(dataclasses.replace(cfg, probe=9))
    for p in (1, 5, 6, 7):
        for kw in (dict(plane_h=True), dict(split_gate_up=True), dict(act="bf16rt", plane_x=True),
                   dict(plane_h=True, down_pair=True)):
            with pytest.raises(ValueError, match="decode ladder"):
                K.check_config(dataclasses.replace(cfg, probe=p, **kw))
    with pytest.raises(ValueError, match="needs split_gate_up"):
        K.check_config(dataclasses.replace(cfg, probe=8))
    for kw in (dict(plane_h=True), dict(act="bf16rt", plane_x=True)):
        with pytest.raises(ValueError, match="decode ladder|plane_h"):
            K.check_config(dataclasses.replace(cfg, probe=8, split_gate_up=True, **kw))
    K.check_config(dataclasses.replace(cfg, probe=8, split_gate_up=True))


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


# ---- ladder 2 (session 30): rungs 5-8, the up kernel's load stream varied ---------------------------------------
def _up(name, T=192):
    return {r.name: r for r in sm90_compile.moe_reports(name, T)}["_moe_up_kernel_il"]


def _copies(rep):
    import collections
    import re
    return collections.Counter(m.group(1) for m in re.finditer(r"\b(LDGSTS\S*)", rep.sass))


def test_ladder2_rung6_moves_the_scale_words_only():
    """Rung 6 reads the same number of scale words a step with the same 4-byte copies as rung 1 (so only the
    addresses change: one contiguous run, not one word a row K / 32 bytes apart), into the same stages."""
    r1, r6 = _up("sw_il_bm32_probe1"), _up("sw_il_bm32_probe6")
    assert _copies(r6) == _copies(r1) and _copies(r1)["LDGSTS.E"] > 0, (_copies(r1), _copies(r6))
    assert r6.smem == r1.smem and r6.spill_stores == 0
    assert abs(r6.main_loop.n - r1.main_loop.n) <= 4


def test_ladder2_rungs_5_and_7_drop_their_streams():
    """Rung 5: the weight copies of rung 1 and no 4-byte (scale) copy; rung 7: half of rung 1's copies of each kind
    and half its shared memory stages (one matrix)."""
    c1, c5, c7 = (_copies(_up(f"sw_il_bm32_probe{p}")) for p in (1, 5, 7))
    assert c5["LDGSTS.E.BYPASS.128"] == c1["LDGSTS.E.BYPASS.128"] and c5["LDGSTS.E"] == 0, (c1, c5)
    assert 2 * c7["LDGSTS.E.BYPASS.128"] == c1["LDGSTS.E.BYPASS.128"] and 2 * c7["LDGSTS.E"] == c1["LDGSTS.E"], c7
    assert 2 * _up("sw_il_bm32_probe7").smem == _up("sw_il_bm32_probe1").smem


def test_ladder2_rung8_is_one_matrix_a_program_over_twice_the_grid():
    _, c1 = sm90_compile.moe_launches("sw_il_bm32_probe1", 192)
    _, c8 = sm90_compile.moe_launches("sw_il_bm32_probe8", 192)
    up1 = next(c for c in c1 if c["kernel"].__name__ == "_moe_up_kernel_il")
    up8 = next(c for c in c8 if c["kernel"].__name__ == "_moe_up_kernel_il")
    assert up8["constexprs"]["GU"] == 1 and up8["constexprs"]["PROBE"] == 8 and up1["constexprs"]["GU"] == 0
    assert up8["grid"][0] == up1["grid"][0] and up8["grid"][1] == 2 * up1["grid"][1], (up1["grid"], up8["grid"])
    assert up8["grid"][2] == up1["grid"][2] == 1          # the same K loop (one split) in every program


def test_ladder_rung_bytes():
    import gpu_moe_ladder as L
    up, down = L.KERNELS
    assert L.rung_fraction(0, up) == L.rung_fraction(1, up) == L.rung_fraction(6, up) == L.rung_fraction(8, up) == 1
    assert L.rung_fraction(7, up) == 0.5 and L.rung_fraction(7, down) == 1.0
    assert L.rung_fraction(5, up) == L.rung_fraction(5, down) == 16 / 17     # nibbles: K/2 B a row, scales K/32
    assert L.parse_variants("0:pinned,1:pinned,5") == [(0, "free"), (1, "pinned"), (5, "free")]


def test_ncu_summary_parses_the_text_report(tmp_path):
    import gpu_moe_ladder as L
    text = """==PROF== Disconnected from process 1
  _moe_up_kernel_il (132, 36, 1)x(128, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: Command line profiler metrics
    dram__bytes_read.sum                                                                  Gbyte         1.25
    gpu__time_duration.sum                                                                msecond       0.68
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio               inst         1.44
    l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum                                  sector   10,000,000
    l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum                                request    2,500,000
  _moe_down_kernel_il (132, 80, 1)x(128, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    dram__bytes_read.sum                                                                  Mbyte       636.00
    gpu__time_duration.sum                                                                     us       240.00
"""
    ks = L.parse_ncu(text)
    assert [k for k, _ in ks] == list(L.KERNELS)
    assert ks[0][1]["gpu__time_duration.sum"] == pytest.approx(680.0)
    assert ks[0][1]["l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum"] == 1e7
    assert ks[1][1]["dram__bytes_read.sum"] == pytest.approx(0.636)
    log = tmp_path / "a.log"
    log.write_text(text)
    merged = L.ncu_summary([str(log)], [(192, "sw_il_bm32")], [(1, "pinned")])
    assert set(merged) == {(0, L.KERNELS[0]), (0, L.KERNELS[1])}


_CHILD = r"""
import sys, dataclasses, hashlib
sys.path.insert(0, "scripts")
import triton_interpret_moe as TI      # TRITON_INTERPRET=1 before any kernel module is imported
import numpy as np
from dsflash.kernels import moe_gemm_triton as mt, moe_layout, moe_plan
name, flip, stop = sys.argv[1], sys.argv[2], sys.argv[3]
seen = {}


class Stop(Exception):
    pass


class Shim(TI._JtShim):     # the outputs of each launch by kernel name; stop after kernel ``stop``
    @staticmethod
    def triton_call(*args, kernel, **kw):
        r = TI._JtShim.triton_call(*args, kernel=kernel, **kw)
        outs = r if isinstance(r, tuple) else (r,)
        seen[kernel.__name__] = [np.asarray(o) for o in outs]
        if kernel.__name__ == stop:
            raise Stop
        return r


sys.modules["jax_triton"] = Shim
T, k, E, d, I = 5, 2, 4, 256, 128
x, idx, weight, w1, s1, w3, s3, w2, s2 = TI._problem(T, k, E, d, I, 0)
iw = [np.array(a) for w, sc in ((w1, s1), (w3, s3), (w2, s2)) for a in moe_layout.repack(w, sc)]
flips = {"s13": (1, 3), "s2": (5,), "w3": (2,), "none": ()}[flip]
rng = np.random.default_rng(1)
for j in flips:     # random bits (the probes xor what they load, so one mask on every element could cancel)
    iw[j] = iw[j] ^ rng.integers(0, np.iinfo(iw[j].dtype).max, iw[j].shape, dtype=iw[j].dtype, endpoint=True)
# KS_UP 2: the up kernel's fp32 sums go out as partials (the joint kernel's own epilogue multiplies the gate sums by
# the up sums, which the probes leave at zero), so what each rung's up loop read is visible in its output
cfg = dataclasses.replace(moe_plan.named_config(name), decode="tl", KS_UP=2)
p = {kk: np.array(v) for kk, v in mt.prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=True).items()}
try:
    mt._launch(p, *iw, T=T, k=k, d=d, I=I, E=E, limit=10.0, act_fp8=True, cfg=cfg)
except Stop:
    pass
for kn in ("_moe_up_kernel_il", "_moe_down_kernel_il"):
    if kn in seen:
        o = seen[kn][0]
        print("RESULT", kn, "x".join(map(str, o.shape)), int(np.isfinite(o.astype(np.float32)).all()),
              hashlib.sha1(o.tobytes()).hexdigest())
"""


def _interpret(name, flip="none", stop=""):
    """One interpreter run of the real launcher in a fresh process (the interpreter needs TRITON_INTERPRET before
    the kernels are imported; a process with several launches flakes now and then, NOTES.md), stopped after kernel
    ``stop`` if given: {kernel: (shape, finite, sha1 of its first output)}. Re-run once if it fails."""
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root), "JAX_PLATFORMS": "cpu"}
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _CHILD, name, flip, stop], cwd=root, env=env, capture_output=True,
                           text=True, timeout=120)
        res = {ln.split()[1]: (ln.split()[2], bool(int(ln.split()[3])), ln.split()[4])
               for ln in r.stdout.splitlines() if ln.startswith("RESULT ")}
        if r.returncode == 0 and res:
            return res
    raise AssertionError(f"{name} ({flip}) failed twice in the interpreter:\n{r.stderr[-2000:]}")


UP, DOWN = "_moe_up_kernel_il", "_moe_down_kernel_il"


@pytest.mark.parametrize("name,flip,kernel,changes", [
    ("sw_il_probe5", "s13", UP, False),     # no scale loads: W1 / W3's scale words do not reach the up output
    ("sw_il_probe5", "s2", DOWN, False),    # ... nor W2's the down output
    ("sw_il_probe6", "s13", UP, True),      # contiguous scale words: they do
    ("sw_il_probe6", "s2", DOWN, True),
    ("sw_il_probe7", "w3", UP, False),      # W1 only: W3 does not reach the up output
    ("sw_il_probe7", "s13", UP, True),      # (W1's scales do)
    ("sw_il_probe8", "w3", UP, True),       # one matrix a program: the up programs read W3
])
def test_ladder2_rungs_run_in_the_interpreter(name, flip, kernel, changes):
    """Interpreter runs (DECODE 0) of the new rungs through the real launcher (KS_UP 2): the kernel's output is
    finite, of the launcher's shape, and depends on exactly the buffers the rung reads (one of them flipped)."""
    a, b = _interpret(name, "none", kernel), _interpret(name, flip, kernel)
    shape, fin, h0 = a[kernel]
    assert fin and b[kernel][1] and b[kernel][0] == shape, (a, b)
    if kernel == DOWN:
        assert shape == "10x256", shape                         # o [S, d]
    else:
        assert shape == "2x10x256", shape                       # partials [KS, S, 2 I]
    assert (b[kernel][2] != h0) == changes, (name, flip, a, b)


# ---- the tile-major layout's ladder (session 30; gpu_queue.sh moe_tm) --------------------------------------------
@pytest.mark.parametrize("name", TM_PROBE_NAMES + ["sw_il_tm", "sw_il_tm2", "sw_il_bm32_tm", "sw_il_bm32_tm2"])
def test_tile_major_configs_reach_both_il_launches_with_their_level(name):
    """tile_major reaches both il launches as TM (1 or 2), with the probe's PROBE / NSTAGE as at plain il; the plain
    decode bands launch TM 0 (always passed: jax-triton sends a left-out constexpr as None)."""
    base, _, p = name.partition("_probe")
    cfg = moe_plan.named_config(name)
    level = 2 if base.endswith("2") else 1
    assert cfg.tile_major == level and cfg.probe == int(p or 0)
    T = 192 if "bm32" in base else 6
    _, calls = sm90_compile.moe_launches(name, T)
    il = [c for c in calls if c["kernel"].__name__.endswith("_kernel_il")]
    assert len(il) == 2
    for c in il:
        assert c["constexprs"]["TM"] == level and c["constexprs"]["PROBE"] == int(p or 0), c["constexprs"]
    for plain in ("sw_il", "sw_il_bm32", "sw_il_probe1"):
        _, calls = sm90_compile.moe_launches(plain, T)
        assert all(c["constexprs"]["TM"] == 0 for c in calls if c["kernel"].__name__.endswith("_kernel_il"))


def test_ladder_tiles_the_weights_for_tile_major_bases_and_skips_missing_rungs():
    import gpu_moe_ladder as L
    from dsflash.kernels import moe_layout
    il = tuple(moe_layout.repack_experts(*moe_plan.random_moe_problem(jax.random.PRNGKey(1), 3, 2, 2, 256, 128)[3:]))
    cache = {}
    assert L.tiled_weights(il, moe_plan.named_config("sw_il"), cache) is il and not cache
    t2 = L.tiled_weights(il, moe_plan.named_config("sw_il_bm32_tm2_probe1"), cache)
    assert set(cache) == {2} and L.tiled_weights(il, moe_plan.named_config("sw_il_tm2"), cache) is t2
    for a, b in zip(t2, moe_layout.tile_experts(*il, level=2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    L.tiled_weights(il, moe_plan.named_config("sw_il_tm"), cache)
    assert set(cache) == {1, 2}
    assert L.known_config("sw_il_tm2_probe1") and not L.known_config("sw_il_tm2_probe6")
    with pytest.raises(ValueError, match="probe 6"):
        K.check_config(dataclasses.replace(moe_plan.named_config("sw_il_tm"), probe=6))
