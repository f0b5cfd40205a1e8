"""``bench forward`` breakdown: attention / MoE / routed / other from ablated programs (CPU, 4-layer tiny)."""
import json

from dsflash.bench.__main__ import main as bench_main
from test_bench_forward import tiny4


def test_breakdown_fields(tmp_path):
    _, cfgp = tiny4(tmp_path)
    out = tmp_path / "res"
    rc = bench_main(["forward", "--preset", cfgp, "--decode", "1@32", "--reps", "2", "--warmup", "1",
                     "--no-uniform", "--no-draft", "--fast-compile", "--out", str(out), "--no-plot"])
    assert rc == 0
    r = json.loads(next(out.glob("forward_*.json")).read_text())
    (pt,) = r["points"]
    assert set(pt["variants_ms"]) == {"no_attn", "no_moe", "no_routed", "no_both"}
    b = pt["breakdown_ms"]
    full = pt["step_ms"]["median"]
    assert set(b) >= {"attention", "moe", "routed", "shared_and_gate", "other", "interaction"}
    assert 0 < b["other"] < full
    assert abs(b["attention"] + b["moe"] + b["other"] + b["interaction"] - full) < 1e-6 * max(1.0, full)
    assert "uniform_ms" not in pt and r["method"]["breakdown"]
