"""``bench serve`` against the real dsflash server (``python -m dsflash.serve``, the built-in model):
``--input-len N`` sends exactly N prompt tokens as the server counts them (``usage.prompt_tokens``),
on the chat and the completions endpoint, and the server's per-chunk usage
(``continuous_usage_stats``) gives every chunk's token count. One server for the module; short runs
(1-2 output tokens per request) so that the module stays well under a minute after the model is up."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx")

from test_server_util import default_test_model, start_server  # noqa: E402

from dsflash.bench import serve as bench_serve  # noqa: E402
from dsflash.bench.workloads import FixedConfig, FixedWorkload  # noqa: E402

MODEL = default_test_model()


@pytest.fixture(scope="module")
def server():
    args = [] if MODEL == "demo" else ["--model", MODEL]
    srv = start_server(*args)
    yield srv
    srv.terminate()
    srv.close()


def _run(server, tmp_path, *args) -> dict:
    out = tmp_path / "out"
    rc = bench_serve.main(["--base-url", server.base + "/v1", "--concurrency", "1", "--warmup-requests", "0",
                           "--save-requests", "--no-plot", "--out-dir", str(out), *args])
    files = sorted(out.glob("serve_*.json"))
    assert rc == 0 and len(files) == 1, (rc, files)
    return json.loads(files[0].read_text())


def _measured(res) -> list[dict]:
    reqs = [r for r in res["points"][0]["requests"] if not r["warmup"]]
    assert reqs and all(r["success"] for r in reqs), [r["error"] for r in reqs]
    return reqs


@pytest.mark.parametrize("endpoint,n", [("chat", 17), ("chat", 64), ("completions", 40)])
def test_input_len_is_exact_in_server_tokens(server, tmp_path, endpoint, n):
    res = _run(server, tmp_path, "--endpoint", endpoint, "--input-len", str(n), "--output-len", "2",
               "--num-requests", "2")
    cfg = res["config"]
    if not cfg["tokenizer"].endswith("tokenizer.json"):
        pytest.skip(f"no client tokenizer for model {MODEL!r}: {cfg['tokenizer']}")
    assert cfg["prompt_lengths"].startswith("exact"), cfg["prompt_lengths"]
    assert cfg["prompt_overhead_tokens"] >= 1                   # BOS at least (chat: the template too)
    for r in _measured(res):
        assert r["prompt_tokens_from_server"] and r["prompt_tokens"] == n, r
    assert res["points"][0]["prompt_len_mismatch"] == 0
    assert res["points"][0]["metrics"]["total_input_tokens"] == 2 * n


def test_lengths_drawn_per_request_and_prefix_are_exact(server, tmp_path):
    # --range-ratio draws a length per request; each must arrive exactly, shared prefix included
    res = _run(server, tmp_path, "--input-len", "48", "--range-ratio", "0.5", "--prefix-len", "12",
               "--output-len", "1", "--num-requests", "4")
    if not res["config"]["prompt_lengths"].startswith("exact"):
        pytest.skip(res["config"]["prompt_lengths"])
    wl = FixedWorkload(FixedConfig(input_len=48, range_ratio=0.5, prefix_len=12), seed=0)
    got = [(r["prompt_tokens"], wl.lengths(r["lane"], int(r["session_id"].rsplit("-", 1)[1]))[0])
           for r in _measured(res)]
    assert all(a == b for a, b in got), got
    assert len({b for _, b in got}) > 1                          # several lengths, not one


def test_per_chunk_usage_counts_every_token(server, tmp_path):
    res = _run(server, tmp_path, "--input-len", "32", "--output-len", "24", "--num-requests", "1")
    m = res["points"][0]["metrics"]
    assert m["chunk_tokens_source"] == {"server": 1}
    (r,) = _measured(res)
    assert sum(r["chunk_tokens"]) == r["output_tokens"] == 24
    assert len(r["chunk_tokens"]) == r["num_chunks"] == len(r["chunk_gaps"]) + 1
    # ITL per token: one sample per token after the first chunk, adding up to E2EL - TTFT
    assert m["itl_ms"]["count"] == 24 - r["chunk_tokens"][0]
    assert m["itl_ms"]["mean"] * m["itl_ms"]["count"] == pytest.approx(1e3 * (r["latency"] - r["ttft"]), rel=1e-6)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_server_continuous_usage_stats(server, path):
    import httpx
    model = httpx.get(server.base + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 14, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "the of and to in"}]
    else:
        body["prompt"] = "the of and to in"
    with httpx.stream("POST", server.base + path, json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_choices = [e for e in events if e["choices"]]
    done = [e["usage"]["completion_tokens"] for e in with_choices]
    assert all(e["usage"] is not None and e["usage"]["prompt_tokens"] > 0 for e in with_choices)
    assert done == sorted(done) and done[-1] == 14            # cumulative, ends at the total
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 14
    # without the option: usage null on every chunk, as before
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.base + path, json=body, timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(e["usage"] is None for e in events if e["choices"])
