"""``python -m dsflash.bench guided`` records the device it ran on (it wrote "cpu" whatever the device was)."""
import json

import jax

from dsflash.bench import guided


def test_guided_bench_records_its_device_and_kernels(tmp_path):
    out = tmp_path / "g.json"
    assert guided.main(["--model", "tiny", "--num-prompts", "2", "--max-tokens", "4", "--speculative-modes", "off",
                        "--modes", "json", "--no-full-vocab", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["device"] == jax.devices()[0].device_kind
    assert d["platform"] == jax.default_backend()
    assert d["kernels"].startswith("kernels (backend ")
    (r,) = d["results"]
    assert r["mode"] == "json" and r["guided_tokens"] == r["generated_tokens"] > 0
