"""P/D KV data plane: ``--kv-transport http`` (host-staged body) against ``transfer`` (jax.experimental.transfer),
between two processes on this machine, for a few prompt lengths.

A child process plays the prefill side: it holds a KV payload on its device shaped like V4.1-Flash's (global
KV ``--global-bytes-per-token`` per prompt token in one uint8 leaf padded to the power-of-two bucket the
server uses, plus ``--rings`` in-window rings of ``--window`` rows x ``--ring-row-bytes``) and serves both
data planes the way ``dsflash/serve/pd/server.py`` does: ``GET /kv`` = device_get + ``pack`` + body MAC;
``POST /offer`` = fingerprint + ``await_pull`` + a MAC'd JSON header. The parent plays decode: HTTP = GET +
MAC check + ``unpack`` + host-to-device copy; transfer = POST + MAC check + pull + fingerprint check. Both
end with the arrays on the decode device, which is where the engine's install starts.

Timed per request (median of ``--reps`` after one warm-up per length): ``pull_s`` (what a decode request
waits for its KV: the latency the transport adds), and ``payload_bytes / pull_s``. The HTTP side here is a
stdlib HTTP server, not uvicorn (the same for both: the transfer path's offer is HTTP too).

    PYTHONPATH=$PWD python3 scripts/bench_pd_transport.py --lens 1024,8192,32768 \\
        --json benchmarks/results/pd_transport_20261202_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SECRET = b"bench-pd-transport-secret-0123"


def payload(n, gbt, rings, window, ring_row):
    """``[(name, shape, dtype, info)]`` of one request's KV for an ``n``-token prompt (global part padded)."""
    from dsflash.serve.pd.transfer import _bucket
    out = [("main_kv/all", (_bucket(n), gbt), "uint8", {"kind": "global", "ratio": 1, "first": 0, "rows": n})]
    for i in range(rings):
        out.append((f"swa/{i}", (min(window, n), ring_row), "uint8", {"kind": "ring", "first": max(0, n - window)}))
    return out


def child(a):
    """The prefill side: serve /kv and /offer for every length until stdin closes."""
    import http.server
    import threading

    import jax
    import numpy as np

    from dsflash.serve.pd.device_transfer import DeviceTransfer, fingerprint
    from dsflash.serve.pd.transfer import pack
    from dsflash.serve.pd.trust import MAC_HEADER, PDTrust
    trust, xfer = PDTrust(SECRET), DeviceTransfer("127.0.0.1")
    held = {}
    rng = np.random.default_rng(0)
    for n in a.lens:
        held[n] = [(name, jax.device_put(rng.integers(0, 255, size=shape, dtype=np.uint8)), info)
                   for name, shape, _, info in payload(n, a.global_bytes_per_token, a.rings, a.window, a.ring_row_bytes)]
    jax.block_until_ready([x for v in held.values() for _, x, _ in v])

    def meta(n):
        return {"engine_id": "bench", "request_id": f"r{n}", "num_tokens": n, "prompt_digest": "0" * 64,
                "first_token": 1, "skip_tokens": 0}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True    # else a small answer waits for the delayed ACK (~40 ms)

        def _send(self, body, ctype, mac):
            self.send_response(200)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.send_header(MAC_HEADER, mac)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):                 # /kv/<n>: the HTTP body path
            n = int(self.path.rsplit("/", 1)[1])
            arrays = [(name, np.asarray(jax.device_get(x)), {k: v for k, v in info.items() if k != "rows"})
                      for name, x, info in held[n]]
            arrays = [(nm, x[:info.get("rows", len(x))] if info["kind"] == "global" else x, i)
                      for (nm, x, i), info in zip(arrays, [h[2] for h in held[n]])]
            body = pack(meta(n), arrays)
            self._send(body, "application/octet-stream", trust.body_mac(
                request_id=f"r{n}", engine_id="bench", num_tokens=n, prompt_digest="0" * 64, body=body))

        def do_POST(self):                # /offer/<n>: the transfer-server path
            self.rfile.read(int(self.headers.get("content-length") or 0))
            n = int(self.path.rsplit("/", 1)[1])
            arrays = held[n]
            fp = fingerprint(arrays)
            uuid = xfer.offer(arrays, 60.0)
            specs = [{"name": nm, "dtype": str(x.dtype), "shape": list(x.shape), **info} for nm, x, info in arrays]
            body = json.dumps({**meta(n), "arrays": specs, "uuid": uuid, "transfer_port": xfer.port(),
                               "fingerprint": fp}).encode()
            self._send(body, "application/json", trust.body_mac(
                request_id=f"r{n}", engine_id="bench", num_tokens=n, prompt_digest="0" * 64, body=body))

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(json.dumps({"port": srv.server_address[1]}), flush=True)
    sys.stdin.read()


def parent(a):
    import httpx
    import jax
    import jax.numpy as jnp

    from dsflash.serve.pd.device_transfer import DeviceTransfer, fingerprint
    from dsflash.serve.pd.transfer import unpack
    from dsflash.serve.pd.trust import MAC_HEADER, PDTrust
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, __file__, "--child", *sys.argv[1:]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    port = json.loads(p.stdout.readline())["port"]
    base = f"http://127.0.0.1:{port}"
    trust, xfer, cl = PDTrust(SECRET), DeviceTransfer("127.0.0.1"), httpx.Client(timeout=120)

    def mac_ok(r, n):
        trust.verify_body(r.headers.get(MAC_HEADER), request_id=f"r{n}", engine_id="bench", num_tokens=n,
                          prompt_digest="0" * 64, body=r.content)

    def via_http(n):
        r = cl.get(f"{base}/kv/{n}")
        mac_ok(r, n)
        _, arrays = unpack(r.content)
        dev = jax.block_until_ready([jnp.asarray(x) for _, x, _ in arrays])
        return sum(int(x.nbytes) for x in dev), len(r.content)

    parts = {}

    def via_transfer(n):
        t0 = time.perf_counter()
        r = cl.post(f"{base}/offer/{n}")      # includes the prefill side's fingerprint and await_pull
        mac_ok(r, n)
        head = json.loads(r.content)
        specs = xfer.specs(head["arrays"])
        t1 = time.perf_counter()
        got = xfer.pull(f"127.0.0.1:{head['transfer_port']}", head["uuid"], specs)
        t2 = time.perf_counter()
        names = [s["name"] for s in head["arrays"]]
        infos = [{k: v for k, v in s.items() if k not in ("name", "dtype", "shape")} for s in head["arrays"]]
        if fingerprint(list(zip(names, got, infos))) != head["fingerprint"]:
            raise RuntimeError("fingerprint mismatch")
        for k, v in (("offer_s", t1 - t0), ("pull_only_s", t2 - t1), ("fingerprint_check_s", time.perf_counter() - t2)):
            parts.setdefault(k, []).append(v)
        valid = sum(int(x.nbytes) // x.shape[0] * int(i.get("rows", x.shape[0])) for x, i in zip(got, infos))
        return valid, len(r.content) + sum(int(x.nbytes) for x in got)

    rows = []
    try:
        for n in a.lens:
            for name, fn in (("http", via_http), ("transfer", via_transfer)):
                fn(n)                                              # warm-up: compiles, connections
                ts, nb = [], None
                parts.clear()
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    nb = fn(n)
                    ts.append(time.perf_counter() - t0)
                med = statistics.median(ts)
                rows.append({"prompt_tokens": n, "transport": name, "payload_bytes": nb[0], "moved_bytes": nb[1],
                             "pull_s_median": med, "pull_s_min": min(ts), "pull_s_max": max(ts),
                             "payload_bytes_per_s": nb[0] / med, "reps": a.reps,
                             **{k + "_median": statistics.median(v) for k, v in parts.items()}})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        p.stdin.close()
        p.wait(30)
    res = {"what": "P/D KV data plane, http body vs jax.experimental.transfer, two processes on one host",
           "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {platform.machine()}, "
           f"{os.cpu_count()} CPUs (shared), JAX CPU", "jax": jax.__version__, "device": jax.devices()[0].device_kind,
           "payload_model": {"global_bytes_per_token": a.global_bytes_per_token, "rings": a.rings,
                             "window": a.window, "ring_row_bytes": a.ring_row_bytes},
           "commit": _commit(), "command": " ".join(["python3", "scripts/bench_pd_transport.py", *sys.argv[1:]]),
           "rows": rows}
    for n in a.lens:
        h = next(r for r in rows if r["prompt_tokens"] == n and r["transport"] == "http")
        t = next(r for r in rows if r["prompt_tokens"] == n and r["transport"] == "transfer")
        res.setdefault("transfer_vs_http", []).append({"prompt_tokens": n, "speedup": h["pull_s_median"] /
                                                       t["pull_s_median"]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="1024,8192,32768", help="prompt lengths")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--global-bytes-per-token", type=int, default=890, help="V4.1-Flash: 890 (docs/pd.md)")
    ap.add_argument("--rings", type=int, default=43, help="V4.1-Flash: 43 SWA rings")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--ring-row-bytes", type=int, default=528)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.lens = [int(x) for x in a.lens.split(",")]
    return child(a) if a.child else parent(a)


if __name__ == "__main__":
    sys.exit(main())
