"""``python -m dsflash.bench eplb --mesh dep=8`` (tiny, CPU): balancedness before/after for real, uniform and
Zipf-skewed routing (dsflash.bench.eplb.synthetic_rows) plus the model's own router; JSON out."""
import json

from dsflash.bench import eplb as BE
from dsflash.bench.__main__ import main as bench_main


def test_ep_ranks_and_rounding():
    assert BE.ep_ranks("dep=8") == 8 and BE.ep_ranks("dep=4,tp=2") == 8 and BE.ep_ranks("dp=2,dep=4") == 4
    assert BE.round_up_redundant(8, 2, 8) == 8 and BE.round_up_redundant(384, 32, 32) == 32
    assert BE.round_up_redundant(4, 0, 8) == 4


def test_bench_eplb_end_to_end(tmp_path, capsys):
    rc = bench_main(["eplb", "--mesh", "dep=8", "--steps", "6", "--tokens", "128", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "uniform" in text and "skewed" in text and "real" in text
    (path,) = tmp_path.glob("eplb_*.json")
    r = json.loads(path.read_text())
    assert r["ep_ranks"] == 8 and r["mesh"] == "dep=8" and r["preset"] == "tiny" and r["commit"] and r["config_hash"]
    rows = {(x["model"], x["kind"]): x for x in r["rows"]}
    assert set(rows) == {("target", "uniform"), ("target", "skewed"), ("draft", "uniform"), ("draft", "skewed"),
                         ("target", "real")}
    for x in rows.values():
        assert 0 < x["before"] <= 1 and 0 < x["after"] <= 1 and x["P"] % 8 == 0 and x["ranks"] == 8
    # uniform routing is better balanced than Zipf-skewed routing before any rebalance, and EPLB helps skew
    for m in ("target", "draft"):
        assert rows[(m, "uniform")]["before"] > rows[(m, "skewed")]["before"]
        assert rows[(m, "skewed")]["after"] > rows[(m, "skewed")]["before"]
