"""bench kernels' loop floor (dsflash/bench/kernels.py): the no-work op has the timed op's output shape and dtype, and
_time_pair records the floor and each op's time less it (run 20 showed a ~25-30 us per-iteration floor on an H200
that hid the small kernels)."""
import types

import jax.numpy as jnp
import pytest

from dsflash.bench import kernels as bk


def test_loop_floor_op_matches_the_output_and_does_no_work():
    x = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)      # 2 input sets
    w = jnp.ones((8, 5), jnp.bfloat16)
    op = lambda x_, w_: (x_.astype(jnp.bfloat16) @ w_)                 # noqa: E731
    f = bk.loop_floor_op(op, (x,), (w,))
    got, want = f(x[0], w), op(x[0], w)
    assert got.shape == want.shape == (3, 5) and got.dtype == want.dtype == jnp.bfloat16
    assert bool((got == got.reshape(-1)[0]).all())                   # one broadcast value


def test_time_pair_records_floor_and_net_times():
    x = jnp.ones((2, 64, 64), jnp.float32)
    row = {"roofline_s": 1e-6}
    ops = {"triton": lambda a: a @ a, "xla_ref": lambda a: a @ a @ a}
    bk._time_pair(row, ops, (x,), (), types.SimpleNamespace(reps=1), print)
    assert row["loop_floor_s"] > 0
    for name in ops:
        assert 0 <= row[name + "_net_s"] <= row[name + "_s"]
        assert abs(row[name + "_net_s"] - max(row[name + "_s"] - row["loop_floor_s"], 0)) < 1e-12
    assert row["speedup_vs_xla_ref"] == row["xla_ref_s"] / row["triton_s"]


def test_mhc_plan_overrides_parse_and_refuse_bad_specs():
    """`bench kernels --mhc-plans`: named kernel_plan overrides, each timed beside the default plan."""
    from dsflash.bench.kernels import mhc_plan_overrides
    from dsflash.kernels import mhc_fused as mf
    assert mhc_plan_overrides("") == {}
    got = mhc_plan_overrides("b1=warps_b:1, ds40=BD:128/DS:40")
    assert got == {"b1": {"warps_b": 1}, "ds40": {"BD": 128, "DS": 40}}
    for ov in got.values():                        # both fit V4.1's mHC (n 4, d 5120) at a decode size
        mf.check_plan(dict(mf.kernel_plan(6, 4, 5120), **ov), 4, 5120)
    for bad in ("b1", "=warps_b:1", "b1=warps_b", "b1=warps_b:x", "b1=warps_b:1/"):
        with pytest.raises(ValueError, match="--mhc-plans"):
            mhc_plan_overrides(bad)


def test_bench_mhc_times_each_plan_and_compares_it_with_the_default(monkeypatch):
    """The mHC section with two plan overrides, the kernel stood in by the reference (no GPU here): each plan gets
    its own time and its largest difference from the default plan's outputs (0 for the stand-in)."""
    from dsflash.kernels import mhc_fused as mf
    from dsflash.kernels import mhc_fused_triton as mt
    seen = []

    def kernel(*z, plan=None, fn_terms=2, **kw):
        seen.append(plan)
        return mf.mhc_fused_reference(*z, **kw)
    monkeypatch.setattr(mt, "mhc_fused_triton", kernel)
    monkeypatch.setattr(mf, "mhc_fused", lambda *z, backend="auto", force=False, **kw: mf.mhc_fused_reference(*z, **kw))
    args = types.SimpleNamespace(d=256, mhc_tokens="6", mhc_plans="b1=warps_b:1,ds=DS:2", reps=1)
    rows = []
    bk.bench_mhc(args, {"copy_TBps": 1.0, "bf16_TFLOPs": 1.0}, lambda *_: None, rows)
    (row,) = rows
    assert row["plans"] == {"b1": {"warps_b": 1}, "ds": {"DS": 2}}
    for name in ("triton", "xla_ref", "triton_b1", "triton_ds"):
        assert row[name + "_s"] > 0, row
    assert row["max_diff_vs_default_b1"] == 0.0 and row["max_diff_vs_default_ds"] == 0.0
    assert {"warps_b": 1} in seen and {"DS": 2} in seen
