"""``bench forward --mirror`` on dep=2 (faked CPU devices): unequal per-rank decode contexts run as is and
mirrored (every rank given rank r's work), which prices DP imbalance."""
import json

from dsflash.bench.__main__ import main as bench_main
from test_bench_forward import tiny4


def test_mirror_fields(tmp_path):
    _, cfgp = tiny4(tmp_path)
    out = tmp_path / "res"
    rc = bench_main(["forward", "--preset", cfgp, "--mesh", "dep=2", "--decode", "1@40", "--reps", "2", "--warmup",
                     "1", "--no-breakdown", "--no-uniform", "--mirror", "--dp-imbalance", "0.5", "--no-draft",
                     "--fast-compile", "--out", str(out), "--no-plot"])
    assert rc == 0
    r = json.loads(next(out.glob("forward_*.json")).read_text())
    (pt,) = r["points"]
    m = pt["mirror"]
    assert m["rank_contexts"] == [20, 60] and set(m["mirrored"]) == {"0", "1"}
    assert [m["mirrored"][k]["context"] for k in ("0", "1")] == [20, 60]
    assert m["asis_ms"] > 0 and m["mirrored_mean_ms"] > 0
    assert abs(m["imbalance_cost"] - (m["asis_ms"] / m["mirrored_mean_ms"] - 1)) < 1e-9
    # contexts 20..60 + 4 rows fit one 64-token page: as-is and mirrored runs reuse the point's program
    assert pt["step_ms"]["compiled_program_reused"] is False
