"""Load check (issue 21): N concurrent streaming chat requests against the default CPU server.

Starts ``python -m dsflash.serve`` (no model argument: the built-in default model; or ``--url`` for a running
server), opens ``--streams`` streaming chat completions at once (httpx async, one connection each), polls
``/health`` every 0.25 s meanwhile, and writes a JSON report: failures (non-200, an error event, no
``[DONE]``, a transport error), TTFT p50/p99, end-to-end p50/p99, /health latency p50/p99/max.

    python scripts/load_streams.py --streams 256 --out benchmarks/results/load_256_streams_<date>_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pct(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], timeout: float) -> tuple[subprocess.Popen, str, float]:
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="dsflash-load-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.Popen([sys.executable, "-m", "dsflash.serve", "--port", str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base, t0 = f"http://127.0.0.1:{port}", time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); log {log.name}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base, time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"server not healthy after {timeout}s; log {log.name}")


async def run(base: str, streams: int, max_tokens: int) -> dict:
    ttft, e2e, failures, health = [], [], [], []
    done = asyncio.Event()
    tokens = [0]

    async def stream(ac, i):
        body = {"messages": [{"role": "user", "content": f"stream {i}: tell me something " * (1 + i % 4)}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.7, "seed": i}
        t0, first, saw_done = time.perf_counter(), None, False
        try:
            async with ac.stream("POST", base + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    failures.append({"i": i, "status": r.status_code, "body": (await r.aread()).decode()[:300]})
                    return
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        saw_done = True
                    elif line.startswith("data: "):
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            failures.append({"i": i, "error": ev["error"]})
                            return
                        if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                            tokens[0] += 1
                            if first is None:
                                first = time.perf_counter() - t0
        except httpx.HTTPError as e:
            failures.append({"i": i, "transport": f"{type(e).__name__}: {e}"})
            return
        if not saw_done:
            failures.append({"i": i, "error": "no [DONE]"})
            return
        ttft.append(first if first is not None else time.perf_counter() - t0)
        e2e.append(time.perf_counter() - t0)

    async def probe(ac):
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                ok = (await ac.get(base + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            health.append((time.perf_counter() - t0, ok))
            await asyncio.sleep(0.25)

    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=60), limits=limits) as ac, \
            httpx.AsyncClient(timeout=30) as hc:
        p = asyncio.ensure_future(probe(hc))
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(ac, i) for i in range(streams)))
        wall = time.perf_counter() - t0
        done.set()
        await p
    hl = [d for d, _ in health]
    return {"streams": streams, "max_tokens": max_tokens, "failures": len(failures), "failure_samples": failures[:10],
            "wall_s": round(wall, 2), "content_chunks": tokens[0], "chunks_per_s": round(tokens[0] / wall, 2),
            "ttft_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99), "max": _pct(ttft, 1.0)},
            "e2e_s": {"p50": _pct(e2e, 0.5), "p99": _pct(e2e, 0.99), "max": _pct(e2e, 1.0)},
            "health": {"probes": len(health), "failed": sum(not ok for _, ok in health),
                       "p50_s": _pct(hl, 0.5), "p99_s": _pct(hl, 0.99), "max_s": _pct(hl, 1.0)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--url", default=None, help="a running server (default: start the default CPU server)")
    ap.add_argument("--server-args", default="", help="extra server arguments (space separated)")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    proc, startup = None, None
    base = a.url
    if base is None:
        proc, base, startup = start_server(a.server_args.split(), a.startup_timeout)
    try:
        res = asyncio.run(run(base, a.streams, a.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    res.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=commit,
               machine=f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.platform()}",
               server=("python -m dsflash.serve " + (a.server_args or "(no arguments: the default CPU server, demo "
                                                               "model)")) if a.url is None else a.url,
               server_startup_s=round(startup, 1) if startup else None)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if res["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
