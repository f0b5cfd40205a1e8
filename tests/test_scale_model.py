"""The scale model (dsflash/bench/scale_model.py): calibration reproduced, scaling laws, CLI, argument errors."""
import json

import pytest

from dsflash.bench import scale_model as sm
from dsflash.bench.__main__ import main as bench_main


@pytest.fixture(scope="module")
def cal():
    return sm.Calibration.load()


@pytest.fixture(scope="module")
def lay():
    return sm.layouts()


def _at_point(cal, bench, name):
    p = cal.points[name]
    decode = p["phase"] == "decode"
    return p, sm.predict(cal, bench, phase=p["phase"], dep=1, sequences=p["sequences"] if decode else 1,
                         rows=p["rows"] if decode else p["tokens"], context=p["context"],
                         settings=sm.Settings(sigma_ms=0.0), hits_override=p["experts_hit"])


@pytest.mark.parametrize("name", ["decode_6_4k", "decode_192_4k", "prefill_4096"])
def test_reproduces_calibration_per_op_at_dep1(cal, lay, name):
    bench, _ = lay
    p, pr = _at_point(cal, bench, name)
    for op, ms in p["ops"].items():
        got = pr["terms_ms"]["routed_experts"] if op == sm.MOE_OP else pr["ops_ms"][op]
        assert got == pytest.approx(ms, rel=1e-9, abs=1e-12), op
    assert pr["step_ms"] == pytest.approx(p["step_ms"], rel=1e-9)
    assert pr["terms_ms"]["dispatch_combine"] == 0.0 and pr["terms_ms"]["straggler"] == 0.0


def test_128k_point_exact_except_the_context_free_moe_law(cal, lay):
    bench, _ = lay
    p, pr = _at_point(cal, bench, "decode_192_128k")
    for op, ms in p["ops"].items():
        if op != sm.MOE_OP:
            assert pr["ops_ms"][op] == pytest.approx(ms, rel=1e-9, abs=1e-12), op
    # the MoE law has no context term: the 128K point's routed experts are a check, within 2 %
    assert pr["terms_ms"]["routed_experts"] == pytest.approx(p["ops"][sm.MOE_OP], rel=0.02)


def test_layouts_follow_the_configs(lay):
    bench, v41 = lay
    assert (bench.layers, bench.compressed, bench.index, bench.kv_source, bench.experts) == (4, 2, 2, 2, 96)
    assert (v41.layers, v41.compressed, v41.index, v41.kv_source, v41.experts) == (40, 38, 8, 4, 384)
    assert v41.expert_bytes == pytest.approx(18.8e6, rel=0.01)  # BENCHMARKS: 18.8 MB per expert


def test_scaling_laws(cal, lay):
    _, v41 = lay
    deps = (4, 8, 16, 32, 64)
    pr = [sm.predict(cal, v41, dep=n, sequences=32, rows=1, context=8192) for n in deps]
    expert_bytes = [p["moe"]["expert_bytes_hit_per_layer"] for p in pr]
    dispatch = [p["dispatch"]["bytes_per_gpu_per_layer"] for p in pr]
    # routed-expert weight bytes per GPU fall with the DEP size ...
    assert all(a > b for a, b in zip(expert_bytes, expert_bytes[1:])), expert_bytes
    assert expert_bytes[-1] < expert_bytes[0] / 4
    # ... while the dispatch volume per GPU does not vanish (it grows towards t k d (bx + bo) cf)
    assert all(b >= a for a, b in zip(dispatch, dispatch[1:])), dispatch
    assert dispatch[-1] > 0.7 * 2.0 * 32 * 6 * 5120 * 4
    # data-parallel dense work, launch gaps and host time are constant in N; stragglers grow
    for term in ("dense_attention", "head_embed", "launch_gaps", "host"):
        vals = [p["terms_ms"][term] for p in pr]
        assert max(vals) == pytest.approx(min(vals), rel=1e-12), term
    strag = [p["terms_ms"]["straggler"] for p in pr]
    assert all(b > a for a, b in zip(strag, strag[1:]))
    # the routed-expert time falls from DEP4 to DEP32 (the seed: 13.4 -> 6.0 ms)
    assert pr[3]["terms_ms"]["routed_experts"] < 0.5 * pr[0]["terms_ms"]["routed_experts"]
    # host time per step adds once, whatever N
    host = sm.Settings(host_ms=2.0)
    h = [sm.predict(cal, v41, dep=n, sequences=32, context=8192, settings=host)["step_ms"] - p["step_ms"]
         for n, p in zip(deps, pr)]
    assert h == pytest.approx([2.0] * len(deps))


def test_allgather_volume_grows_with_n_and_prefill_buffer_pads_per_destination(cal, lay):
    _, v41 = lay
    ag = [sm.predict(cal, v41, dep=n, sequences=32, settings=sm.Settings(collective="allgather"))
          ["dispatch"]["bytes_per_gpu_per_layer"] for n in (4, 8, 16)]
    assert ag[1] == pytest.approx(ag[0] * 7 / 3) and ag[2] == pytest.approx(ag[0] * 15 / 3)
    pad = sm.predict(cal, v41, phase="prefill", dep=16, sequences=1, rows=4096)["dispatch"]["bytes_per_gpu_per_layer"]
    rag = sm.predict(cal, v41, phase="prefill", dep=16, sequences=1, rows=4096,
                     settings=sm.Settings(collective="ragged"))["dispatch"]["bytes_per_gpu_per_layer"]
    assert pad > 10 * rag


def test_eplb_restores_balancedness_under_skew():
    off = sm.routing_stats(32, 32, R=32, eplb=False, zipf=1.2)["balancedness"]
    on = sm.routing_stats(32, 32, R=32, eplb=True, zipf=1.2)["balancedness"]
    uni = sm.routing_stats(32, 32)["balancedness"]
    assert off < 0.5 < 0.85 < on
    assert 0.8 < uni < 1.0
    assert sm.balancedness(1, 32) == 1.0


def test_tp4_one_user_faster_than_dep4_one_sequence(cal, lay):
    _, v41 = lay
    tp = sm.predict(cal, v41, dep=1, tp=4, sequences=1)
    dep = sm.predict(cal, v41, dep=4, sequences=1)
    assert tp["step_ms"] < dep["step_ms"]
    assert tp["dispatch"]["collective"] == "allreduce"


def test_cli_writes_valid_json_and_plot(tmp_path):
    out = tmp_path / "sm.json"
    png = tmp_path / "sm.png"
    rc = bench_main(["scale-model", "--dep", "4,8,32", "--batches", "1,32", "--prefill-tokens", "4096",
                     "--no-eplb-scenarios", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "scale_model"
    assert {p["dep"] for p in res["predictions"]["decode"]} == {4, 8, 32}
    assert set(res["predictions"]["decode"][0]["terms_ms"]) == {
        "dense_attention", "head_embed", "routed_experts", "dispatch_combine", "launch_gaps", "host", "straggler"}
    kinds = {v["kind"] for v in res["validation"]}
    assert {"calibration", "held_out"} <= kinds
    dep2 = [v for v in res["validation"] if v["point"].startswith("DEP2")]
    assert len(dep2) == 1 and dep2[0]["measured_ms"] == pytest.approx(47.18, abs=0.01)
    for v in res["validation"]:
        assert v["error_pct"] == pytest.approx(100 * (v["predicted_ms"] - v["measured_ms"]) / v["measured_ms"])
    assert res["assumptions"] and res["fabric"]["nvlink_GBps"] > 0
    assert res["seed_comparison"]["seed"]["ratio"] == pytest.approx(6.0 / 13.4)
    pytest.importorskip("matplotlib")
    assert png.exists() and png.stat().st_size > 1000


@pytest.mark.parametrize("argv, field", [
    (["--dep", "0"], "dep"),
    (["--dep", "4,x"], "bad list"),
    (["--batches", "0"], "batches"),
    (["--fabric", "pcie"], "fabric"),
    (["--collective", "ring"], "collective"),
    (["--overlap", "1.5"], "overlap"),
    (["--efficiency", "0"], "efficiency"),
    (["--gaps", "never"], "gaps"),
    (["--accept-len", "3"], "accept_len"),
    (["--latency-us", "-1"], "latency_us"),
])
def test_bad_arguments_raise_value_error_naming_the_field(tmp_path, argv, field):
    with pytest.raises(ValueError, match=field):
        sm.main(argv + ["--no-eplb-scenarios", "--out", str(tmp_path / "x.json"), "--plot", "none"])


@pytest.mark.parametrize("kw, field", [
    (dict(dep=0), "dep"), (dict(sequences=0), "sequences"), (dict(rows=0), "rows"), (dict(context=-1), "context"),
    (dict(phase="train"), "phase"), (dict(tp=4, dep=4), "tp"),
    (dict(settings=sm.Settings(redundant=-1)), "redundant"),
    (dict(settings=sm.Settings(capacity_factor=0)), "capacity_factor"),
])
def test_predict_rejects_bad_arguments(cal, lay, kw, field):
    with pytest.raises(ValueError, match=field):
        sm.predict(cal, lay[1], **kw)
