"""End to end: ``bench serve`` against a tiny streaming OpenAI-like server started in-test on a free
loopback port, whose delays are known: TTFT and ITL measured by the client must match them."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from dsflash.bench import serve as bench_serve  # noqa: E402

BLOCK = 8  # words per prefix-cache block of the fake server


class FakeServer:
    """Streams ``max_tokens`` one-word chunks: a role-only chunk at once, the first token after
    ``ttft`` seconds, then one every ``itl`` seconds; usage (with cached_tokens from a chained-hash
    prefix cache over words) in a final chunk. Every ``fail_every``-th request gets HTTP 500."""

    def __init__(self, ttft: float, itl: float, fail_every: int = 0, api_key: str | None = None,
                 tokens_per_chunk: int = 1):
        self.ttft, self.itl, self.fail_every, self.api_key = ttft, itl, fail_every, api_key
        self.k = tokens_per_chunk   # words ("tokens") per chunk, as speculative decoding streams them
        self.n = 0
        self.blocks: set[int] = set()
        self.bodies: list[dict] = []
        self.app = self._make_app()

    def _prompt_words(self, body: dict) -> list[str]:
        if "messages" in body:
            text = " ".join(f"<{m['role']}> {m['content']}" for m in body["messages"])
        else:
            p = body["prompt"]
            text = " ".join(map(str, p)) if isinstance(p, list) else p
        return text.split()

    def _cached(self, words: list[str]) -> int:
        h, cached, hit = 0, 0, True
        for i in range(0, len(words) - len(words) % BLOCK, BLOCK):
            h = hash((h, tuple(words[i:i + BLOCK])))
            if hit and h in self.blocks:
                cached += BLOCK
            else:
                hit = False
            self.blocks.add(h)
        return cached

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        async def handle(request: Request, chat: bool):
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            body = await request.json()
            self.bodies.append(body)
            self.n += 1
            if self.fail_every and self.n % self.fail_every == 0:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            words = self._prompt_words(body)
            cached = self._cached(words)
            n_out = int(body["max_tokens"])
            obj = "chat.completion.chunk" if chat else "text_completion"

            opts = body.get("stream_options") or {}
            continuous = bool(opts.get("include_usage") and opts.get("continuous_usage_stats"))

            def chunk(text, finish=None, done=0):
                if chat:
                    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": finish}
                c = {"id": "x", "object": obj, "choices": [choice]}
                if continuous:   # cumulative usage on every chunk (vLLM's continuous_usage_stats)
                    c["usage"] = {"prompt_tokens": len(words), "completion_tokens": done,
                                  "total_tokens": len(words) + done}
                return "data: " + json.dumps(c) + "\n\n"

            async def gen():
                if chat:
                    yield "data: " + json.dumps({"id": "x", "object": obj, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n"
                await asyncio.sleep(self.ttft)
                for j, i in enumerate(range(0, n_out, self.k)):
                    if j:
                        await asyncio.sleep(self.itl)
                    last = min(i + self.k, n_out)
                    yield chunk("".join(f" w{t}" for t in range(i, last)), "length" if last == n_out else None,
                                done=last)
                usage = {"prompt_tokens": len(words), "completion_tokens": n_out,
                         "total_tokens": len(words) + n_out, "prompt_tokens_details": {"cached_tokens": cached}}
                yield "data: " + json.dumps({"id": "x", "object": obj, "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, False)

        return app


@pytest.fixture
def fake_server():
    servers = []

    def start(**kw) -> tuple[FakeServer, str]:
        fs = FakeServer(**kw)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(fs.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
        th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        deadline = time.time() + 10
        while not server.started:
            assert time.time() < deadline, "fake server did not start"
            time.sleep(0.02)
        servers.append((server, th, sock))
        return fs, f"http://127.0.0.1:{port}/v1"

    yield start
    for server, th, sock in servers:
        server.should_exit = True
        th.join(timeout=5)
        sock.close()


def _load(out_dir) -> dict:
    files = sorted(out_dir.glob("serve_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_fixed_sweep_matches_server_delays(fake_server, tmp_path):
    ttft, itl, n_out = 0.20, 0.05, 6
    fs, url = fake_server(ttft=ttft, itl=itl, api_key="k123")
    rc = bench_serve.main([
        "--base-url", url, "--api-key", "k123", "--sweep", "1,2", "--num-requests", "4",
        "--input-len", "64", "--output-len", str(n_out), "--num-gpus", "2", "--gpu-hour-usd", "3.6",
        "--slo", "ttft=1000,tpot=200", "--label", "e2e fixed", "--out-dir", str(tmp_path)])
    assert rc == 0
    res = _load(tmp_path)
    assert res["valid"] and res["label"] == "e2e fixed" and len(res["commit"]) in (40, 7)
    assert res["config"]["model"] == "fake-model"              # discovered via GET /models
    assert [p["concurrency"] for p in res["points"]] == [1, 2]
    assert (tmp_path / (sorted(tmp_path.glob("serve_*.json"))[0].stem + ".png")).exists()
    # two 1-token probes calibrate server tokens per prompt word (the fake server: one per word)
    probes = [b for b in fs.bodies if b["messages"][0]["content"].startswith("[probe ")]
    assert len(probes) == 2 and all(b["max_tokens"] == 1 for b in probes)
    assert res["config"]["tokens_per_word"] == pytest.approx(1.0)
    # every other request carried ignore_eos + max_tokens and asked for usage in the stream
    rest = [b for b in fs.bodies if b not in probes]
    assert len(rest) == 2 * 4 + 1 + 2
    assert all(b["ignore_eos"] is True and b["stream"] is True and b["max_tokens"] == n_out
               and b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True} for b in rest)
    for p in res["points"]:
        m = p["metrics"]
        c = p["concurrency"]
        assert m["completed"] == 4 and m["failed"] == 0
        assert p["warmup_requests"] == c                       # one per lane, excluded
        assert m["total_output_tokens"] == 4 * n_out and p["output_len_mismatch"] == 0
        assert m["input_tokens_from_server"] and m["output_tokens_from_server"]
        # the server's known delays (the empty role chunk must not count as the first token). Lower bounds
        # are exact (nothing arrives before the server sends it); upper bounds allow scheduling jitter of a
        # loaded 2-core CI machine, still far below one extra chunk of a wrong definition.
        assert ttft * 1e3 <= m["ttft_ms"]["mean"] < ttft * 1e3 + 150
        assert ttft * 1e3 <= m["ttft_ms"]["p90"] < ttft * 1e3 + 200
        assert m["itl_ms"]["count"] == 4 * (n_out - 1)
        for key in (("itl_ms", "median"), ("itl_ms", "mean"), ("tpot_ms", "mean")):
            assert -15 < m[key[0]][key[1]] - itl * 1e3 < 30, key
        e2e = (ttft + (n_out - 1) * itl) * 1e3
        assert e2e <= m["e2el_ms"]["mean"] < e2e + 300
        assert m["p90_interactivity"] == pytest.approx(1000.0 / m["tpot_ms"]["p90"])
        assert m["chunk_tokens_source"] == {"server": 4} and m["tokens_per_chunk"]["mean"] == 1.0
        # closed loop: c lanes each ~one request at a time -> throughput ~ c / E2EL
        expect_rps = c / (e2e / 1e3)
        assert 0.4 * expect_rps < m["request_throughput"] <= 1.05 * expect_rps
        assert m["output_throughput_per_gpu"] == pytest.approx(m["output_throughput"] / 2)
        assert m["usd_per_million_output_tokens"] == pytest.approx(3.6 * 2 / 3600 / m["output_throughput"] * 1e6)
        assert m["good_completed"] == 4 and m["goodput"] == pytest.approx(m["request_throughput"])
        assert m["cached_input_tokens"] is not None      # server reported cached_tokens
        assert p["prompt_tokens_vs_estimate"] == pytest.approx(1.0, abs=0.1)
        assert m["mean_input_tokens"] == pytest.approx(64, abs=2)


@pytest.mark.parametrize("per_chunk_usage", [True, False])
def test_multi_token_chunks_are_counted_per_token(fake_server, tmp_path, per_chunk_usage):
    # speculative-decoding-like stream: 9 tokens in 3 chunks of 3, 0.06 s apart, first after 0.1 s
    ttft, gap, k, n_out = 0.10, 0.06, 3, 9
    fs, url = fake_server(ttft=ttft, itl=gap, tokens_per_chunk=k)
    rc = bench_serve.main([
        "--base-url", url, "--concurrency", "1", "--num-requests", "3", "--input-len", "16",
        "--output-len", str(n_out), "--tokens-per-word", "1", "--out-dir", str(tmp_path), "--no-plot",
        *([] if per_chunk_usage else ["--no-continuous-usage"])])
    assert rc == 0
    m = _load(tmp_path)["points"][0]["metrics"]
    # per chunk counts from the server's cumulative usage, or (without) from the text of each chunk
    assert m["chunk_tokens_source"] == {("server" if per_chunk_usage else "text-length"): 3}
    assert m["tokens_per_chunk"]["mean"] == pytest.approx(3.0)
    assert m["total_output_tokens"] == 3 * n_out
    # by hand: TPOT = 2 gaps / (9 - 1) = 15 ms; ITL per token: the 6 tokens after the first chunk
    # share the 2 gaps -> 20 ms each; per chunk (vLLM's ITL) it would be 60 ms
    assert m["itl_ms"]["count"] == 3 * (n_out - k)
    assert -3 < m["tpot_ms"]["mean"] - 1e3 * 2 * gap / (n_out - 1) < 10
    assert -3 < m["itl_ms"]["median"] - 1e3 * gap / k < 10
    assert -5 < m["icl_ms"]["median"] - 1e3 * gap < 30
    assert m["p90_interactivity"] == pytest.approx(1000.0 / m["tpot_ms"]["p90"])
    assert m["per_user_output_throughput"]["median"] > 50          # ~1/15 ms = 67 tok/s, not 1/60 ms


def test_failures_mark_run_invalid(fake_server, tmp_path):
    fs, url = fake_server(ttft=0.01, itl=0.002, fail_every=3)
    rc = bench_serve.main([
        "--base-url", url, "--model", "fake-model", "--concurrency", "2", "--num-requests", "12",
        "--input-len", "16", "--output-len", "4", "--endpoint", "completions", "--out-dir", str(tmp_path),
        "--no-plot"])
    assert rc == 3
    res = _load(tmp_path)
    m = res["points"][0]["metrics"]
    assert not res["valid"] and not m["valid"]
    assert m["failed"] >= 3 and m["failed_fraction"] > 0.10
    assert "HTTP 500: injected failure" in m["errors"]
    assert any("failed" in r for r in m["invalid_reasons"])


def test_agentx_sessions_against_fake_server(fake_server, tmp_path):
    fs, url = fake_server(ttft=0.02, itl=0.004)
    rc = bench_serve.main([
        "--base-url", url, "--workload", "agentx", "--concurrency", "2", "--num-requests", "24",
        "--warmup-requests", "1", "--agentx-system-tokens", "64", "--agentx-first-turn-tokens", "32",
        "--agentx-turn-tokens", "16", "--agentx-output-tokens", "8", "--agentx-min-output-tokens", "4",
        "--agentx-min-turns", "6", "--agentx-max-turns", "8", "--agentx-think-time", "0.01",
        "--agentx-subagent-prob", "0.5", "--agentx-max-fanout", "3", "--agentx-subagent-task-tokens", "16",
        "--agentx-max-context-tokens", "4096", "--save-requests", "--out-dir", str(tmp_path), "--no-plot"])
    assert rc == 0
    res = _load(tmp_path)
    p = res["points"][0]
    m = p["metrics"]
    assert m["completed"] == 24 and m["failed"] == 0
    assert p["requests_by_kind"].get("root", 0) > 0 and p["requests_by_kind"].get("subagent", 0) > 0
    # warm-up: one primer + one root turn per lane (plus any subagents of it), all excluded
    kinds = [r["kind"] for r in p["requests"] if r["warmup"]]
    assert kinds.count("primer") == 2 and kinds.count("root") == 2
    assert all(r["start_time"] >= 0 for r in p["requests"] if not r["warmup"])   # inside the window
    # long shared prefixes growing per turn: most measured input is a prefix-cache hit
    assert m["prefix_hit_rate"] > 0.5
    assert m["uncached_input_tokens"] == m["total_input_tokens"] - m["cached_input_tokens"]
    # the chat history sent back is the text the server generated
    roots = [b for b in fs.bodies if any(msg["role"] == "assistant" for msg in b["messages"])]
    assert any(" w0 w1" in msg["content"] for b in roots for msg in b["messages"] if msg["role"] == "assistant")


def test_duration_bounded_run(fake_server, tmp_path):
    fs, url = fake_server(ttft=0.01, itl=0.01)
    t = time.perf_counter()
    rc = bench_serve.main([
        "--base-url", url, "--concurrency", "3", "--duration", "1.0", "--input-len", "16", "--output-len", "5",
        "--out-dir", str(tmp_path), "--no-plot"])
    wall = time.perf_counter() - t
    assert rc == 0 and wall < 10
    m = _load(tmp_path)["points"][0]["metrics"]
    # the window closes at 1 s; requests in flight then drain (each ~0.05 s)
    assert 1.0 <= m["duration_s"] < 1.5
    assert m["completed"] >= 3 * 10 and m["failed"] == 0
    assert m["request_throughput"] == pytest.approx(m["completed"] / m["duration_s"])


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()                                   # nothing listens there now
    rc = bench_serve.main(["--base-url", f"http://127.0.0.1:{port}/v1", "--out-dir", str(tmp_path)])
    assert rc == 2
    assert "error" in capsys.readouterr().err
    assert not list(tmp_path.glob("serve_*"))


def test_module_entry_points():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(bench_serve.__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "dsflash.bench.serve", "--help"], cwd=root, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--sweep" in r.stdout and "--gpu-hour-usd" in r.stdout
    if (root / "dsflash" / "bench" / "__main__.py").exists():
        r = subprocess.run([sys.executable, "-m", "dsflash.bench", "serve", "--help"], cwd=root,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "--sweep" in r.stdout


def test_requests_still_running_after_drain_are_cancelled_and_fail(fake_server, tmp_path):
    fs, url = fake_server(ttft=0.01, itl=0.2)       # 30 tokens: ~6 s per request
    t = time.perf_counter()
    rc = bench_serve.main([
        "--base-url", url, "--concurrency", "2", "--duration", "0.3", "--drain-timeout", "0.3",
        "--warmup-requests", "0", "--input-len", "16", "--output-len", "30", "--tokens-per-word", "1",
        "--out-dir", str(tmp_path), "--no-plot"])
    assert rc == 3 and time.perf_counter() - t < 5
    p = _load(tmp_path)["points"][0]
    m = p["metrics"]
    assert m["completed"] == 0 and m["failed"] == 2 and not m["valid"]
    assert any("cancelled" in e for e in m["errors"])
    assert any("drain" in n for n in p["notes"])


def test_compare_two_sweeps_at_fixed_interactivity(tmp_path, capsys):
    def result(label, pts):
        return {"label": label, "commit": "c" * 40, "summary": [
            {"concurrency": c, "valid": True, "p90_interactivity": {"median": x},
             "output_throughput_per_gpu": {"median": y}} for c, (x, y) in enumerate(pts)]}
    base = tmp_path / "base.json"
    new = tmp_path / "new.json"
    base.write_text(json.dumps(result("base", [(60, 100), (40, 200), (15, 400)])))
    new.write_text(json.dumps(result("new", [(60, 150), (40, 300), (25, 500)])))
    assert bench_serve.main(["--compare", str(base), str(new), "--at-interactivity", "40,60,20"]) == 0
    out = capsys.readouterr().out
    assert "40 tok/s/user" in out and "ratio 1.500" in out           # both measured exactly at 40 and 60
    assert "n/a (outside a measured range)" in out                    # 20 is beyond the new sweep
