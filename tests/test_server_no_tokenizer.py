"""A server without a tokenizer (``--skip-tokenizer-init``; the bench presets at the real vocabulary have none): prompts
must be token ids, every completion choice carries its ``token_ids`` (streamed as they come, though the text stays
empty), and ``bench serve`` measures it (before, the client saw no content and counted every request failed: the
first GPU ``bench serve`` run, 2026-12-02)."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

from test_server_util import ServerProcess, error_of, shared_cache_env  # noqa: E402

from dsflash.bench import serve as bench_serve  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 250, 11]


@pytest.fixture(scope="module")
def server():
    # the default server's programs (the tokenizer changes none): loaded from the run's shared cache when there
    srv = ServerProcess("--skip-tokenizer-init", extra_env=shared_cache_env())
    yield srv
    srv.terminate()
    srv.close()


def _model(server):
    return httpx.get(server.base + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_text_prompts_and_chat_are_clear_400s(server):
    r = httpx.post(server.base + "/v1/completions", json={"model": _model(server), "prompt": "hello"}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = httpx.post(server.base + "/v1/chat/completions", timeout=60,
                   json={"model": _model(server), "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "tokenizer" in error_of(r)["message"]


def test_token_ids_returned_whole_and_streamed(server):
    body = {"model": _model(server), "prompt": PROMPT, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    (ch,) = r.json()["choices"]
    assert ch["text"] == "" and len(ch["token_ids"]) == 9 and r.json()["usage"]["completion_tokens"] == 9
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}, timeout=300) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    pieces = [e["choices"][0]["token_ids"] for e in events if e["choices"]]
    assert sum(pieces, []) == ch["token_ids"]               # the same greedy tokens, as they come
    assert sum(1 for p in pieces if p) >= 2                 # streamed in several chunks, not only at the end


def test_bench_serve_counts_streamed_token_ids(server, tmp_path):
    out = tmp_path / "out"
    rc = bench_serve.main(["--base-url", server.base + "/v1", "--endpoint", "completions", "--prompt-format",
                           "token-ids", "--vocab-size", "512", "--input-len", "24", "--output-len", "12",
                           "--concurrency", "2", "--num-requests", "4", "--warmup-requests", "0", "--save-requests",
                           "--no-plot", "--out-dir", str(out)])
    (f,) = sorted(out.glob("serve_*.json"))
    res = json.loads(f.read_text())
    assert rc == 0, res["points"][0]["metrics"].get("errors")
    reqs = [r for r in res["points"][0]["requests"] if not r["warmup"]]
    assert len(reqs) == 4 and all(r["success"] for r in reqs), [r["error"] for r in reqs]
    assert all(r["output_tokens"] == 12 and sum(r["chunk_tokens"]) == 12 for r in reqs)
    assert res["points"][0]["metrics"]["tpot_ms"]["count"] == 4
