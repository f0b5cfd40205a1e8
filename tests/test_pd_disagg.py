"""P/D disaggregation end to end on loopback: real ``--role prefill``, ``--role decode`` and ``--role both``
(aggregated) server processes and the router process, tiny model, CPU.

* greedy outputs through the router (P then D, KV pulled over HTTP) equal the aggregated server's for
  concurrent completions and chats, streaming and not;
* bytes moved per prompt token are reported and bounded by the global-KV bytes/token plus the window;
* the prefill side frees held KV on the decode side's notification, and after the TTL when nobody pulls;
* failure policy per request (``fail``: HTTP 502 naming the prefill engine; ``recompute``: same output);
* conversation affinity and load balancing (router unit test, plus the real router's affinity header);
* the trust boundary (docs/pd.md "Deployment and trust"): a hostile client that sends ``kv_transfer_params``
  pointing at a listener of its own straight to the decode instance gets 403 and the decode instance never
  connects to it (nor registers anything); a KV body flipped on the wire in a correctly signed flow is
  rejected by its MAC and registers nothing;
* last: the prefill process is killed in the middle of a KV body; only the affected requests fail (or are
  recomputed, per policy), the requests already decoding complete with the aggregated server's output, and the
  decode instance stays healthy and serves the next request.

Each process starts once per module (model start-up dominates)."""
from __future__ import annotations

import asyncio
import http.server
import json
import math
import signal
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from test_server_util import ServerProcess

from dsflash.serve.pd.transfer import pack, prompt_digest
from dsflash.serve.pd.trust import PDTrust

SECRET = b"test-pd-secret-0123456789abcdef"
TRUST = PDTrust(SECRET)            # the test plays the router where it talks to instances directly

# the default (adaptive) speculation: with sequential verify (the CPU default) a row rounds the same whatever a
# call's draft length, so two servers agree token for token although their timings differ (docs/engine.md)
ENGINE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "8"]
TIMEOUT = 180


def _start(module: str, *args: str, name: str) -> ServerProcess:
    """Started, not yet waited for (``.wait_healthy()``): the prefill and decode processes start together."""
    return ServerProcess(*args, startup_timeout=None, module=module, name=name)


def pd_env(mp, tmp_path_factory) -> tuple:
    """The servers' environment and shared secret: conftest.py turns the persistent compilation cache off for the
    test process and the servers inherit that, so turn it back on for them in a fresh folder of the module's;
    returns the ``--pd-secret-file`` arguments."""
    mp.setenv("JAX_ENABLE_COMPILATION_CACHE", "true")
    mp.setenv("DSFLASH_CACHE_DIR", str(tmp_path_factory.mktemp("xla_cache")))
    key = tmp_path_factory.mktemp("pd") / "pd.key"
    key.write_bytes(SECRET + b"\n")
    return ("--pd-secret-file", str(key))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    procs = {}
    mp = pytest.MonkeyPatch()
    sec = pd_env(mp, tmp_path_factory)
    try:
        # the first process fills the persistent compilation cache; the others then start in seconds
        procs["agg"] = _start("dsflash.serve", *ENGINE_ARGS, "--role", "both", name="aggregated").wait_healthy()
        # the HTTP body transport (its test hooks stall / corrupt bodies); the transfer server's is test_pd_transfer.py
        procs["p"] = _start("dsflash.serve", *ENGINE_ARGS, "--role", "prefill", "--kv-ttl", "8", "--pd-test-hooks",
                            "--kv-transport", "http", *sec, name="prefill")
        procs["d"] = _start("dsflash.serve", *ENGINE_ARGS, "--role", "decode", "--kv-transport", "http", *sec,
                            "--pd-peers", f"127.0.0.1:{procs['p'].port}", name="decode")
        for k in ("p", "d"):
            procs[k].wait_healthy()
        procs["router"] = _start("dsflash.serve.router", "--prefill", procs["p"].base, "--decode", procs["d"].base,
                                 "--affinity-block", "32", *sec, name="router").wait_healthy(60)
        yield procs
    finally:
        mp.undo()
        for p in procs.values():
            p.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(1000 + seed).integers(4, 500, size=n)]


def _requests(tag: int):
    """(path, body) pairs: token-id completions of several lengths (1-3 pages), a text completion and chats,
    streaming and not. Distinct prompts (no prefix sharing, so no prefix-cache replay on either side)."""
    reqs = []
    for i, n in enumerate((3, 17, 64, 65, 100, 150)):
        reqs.append(("/v1/completions", {"prompt": _prompt(tag * 100 + i, n), "max_tokens": 24, "temperature": 0.0,
                                         "ignore_eos": True, "stream": i % 2 == 1}))
    reqs.append(("/v1/completions", {"prompt": f"Text prompt number {tag}: the quick brown fox", "max_tokens": 20,
                                     "temperature": 0.0, "logprobs": 2}))
    # seeded sampling: the prefill side samples token 0 with the request's key for index 0, decode goes on
    reqs.append(("/v1/completions", {"prompt": _prompt(tag * 100 + 50, 40), "max_tokens": 20, "temperature": 0.8,
                                     "top_p": 0.9, "seed": 1234, "ignore_eos": True}))
    for j in range(3):
        reqs.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": f"chat {tag}-{j}: hello there"}],
                                              "max_tokens": 20, "temperature": 0.0, "stream": j == 1}))
    return reqs


async def _call(ac: httpx.AsyncClient, base: str, path: str, body: dict, **extra):
    """Returns (status, text or error body, headers)."""
    body = {**body, **extra}
    if body.get("stream"):
        async with ac.stream("POST", base + path, json=body) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread()), r.headers
            text, err, fin = "", None, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = ev
                    continue
                for c in ev["choices"]:
                    text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    fin = c.get("finish_reason") or fin
            return (200 if err is None else 599), (err or (text, fin)), r.headers
    r = await ac.post(base + path, json=body)
    if r.status_code != 200:
        return r.status_code, r.json(), r.headers
    c = r.json()["choices"][0]
    text = c.get("text") if "text" in c else c["message"].get("content") or ""
    extra_out = c.get("logprobs", {}) and c["logprobs"].get("tokens") if "text" in c else None
    return 200, (text, c["finish_reason"], extra_out) if extra_out else (text, c["finish_reason"]), r.headers


def _run_all(base_pairs):
    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as ac:
            return await asyncio.gather(*(_call(ac, b, p, body, **kw) for b, p, body, kw in base_pairs))
    return asyncio.run(main())


def test_handshake_and_roles(cluster):
    pi = httpx.get(cluster["p"].base + "/pd/info").json()
    di = httpx.get(cluster["d"].base + "/pd/info").json()
    assert pi["role"] == "prefill" and di["role"] == "decode"
    assert pi["layout"] == di["layout"] and pi["engine_id"] != di["engine_id"]
    assert httpx.get(cluster["agg"].base + "/pd/info").status_code == 404      # --role both: today's server
    # a decode-only instance refuses a prefill-hold request, and vice versa
    r = httpx.post(cluster["d"].base + "/v1/completions",
                   json={"prompt": [5, 6], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "prefill" in r.json()["error"]["message"]


def test_outputs_identical_to_aggregated(cluster):
    """Greedy (and one seeded sampled) requests, concurrently, through the router vs the aggregated server."""
    reqs = _requests(1)
    runs = [(cluster["router"].base, p, b, {}) for p, b in reqs] + [(cluster["agg"].base, p, b, {}) for p, b in reqs]
    t0 = time.time()
    res = _run_all(runs)
    n = len(reqs)
    pd, agg = res[:n], res[n:]
    for (path, body), (s1, o1, h1), (s2, o2, _) in zip(reqs, pd, agg):
        assert s1 == 200 and s2 == 200, (path, o1, o2)
        assert o1 == o2, (path, body.get("stream"), o1, o2)
        assert h1.get("x-dsflash-kv-outcome") == "transferred", dict(h1)
        assert h1.get("x-dsflash-prefill") and h1.get("x-dsflash-decode")
    print(f"\n[pd] {n} concurrent requests via router + {n} on the aggregated server in {time.time() - t0:.1f}s; "
          f"all greedy outputs identical")


def test_bytes_per_prompt_token_bounded(cluster):
    st = httpx.get(cluster["d"].base + "/pd/stats").json()
    sizes = st["sizes"]
    g, win, entry = sizes["global_kv_bytes_per_token"], sizes["window_bytes"], sizes["entry_bytes"]
    recs = st["transfers"]
    assert len(recs) >= 10
    print(f"\n[pd] global KV {g:.1f} B/token, in-window state <= {win} B/request (per-slot total "
          f"{sizes['per_slot_bytes']:.0f} B)")
    print("[pd] prompt_tokens  global_B  window_B  wire_B  wire_B/token  bound_B(global*n + entry rounding + window)")
    for r in sorted(recs, key=lambda r: r["prompt_tokens"]):
        n = r["prompt_tokens"]
        bound = g * n + entry + win
        print(f"[pd] {n:13d} {r['global_bytes']:9d} {r['window_bytes']:9d} {r['wire_bytes']:7d} "
              f"{r['wire_bytes'] / n:12.1f} {bound:10.0f}")
        assert r["global_bytes"] <= g * n + entry          # only the prompt's entries, never the pool
        assert r["window_bytes"] <= win                     # only the in-window rows, never the whole history
        assert r["global_bytes"] + r["window_bytes"] <= bound
        assert r["wire_bytes"] <= bound + 16 + 64 * 1024    # + the JSON header
    # the prefill side freed every pulled request on the notification
    ps = httpx.get(cluster["p"].base + "/pd/stats").json()
    t_end = time.time() + 10
    while ps["held"] and time.time() < t_end:
        time.sleep(0.2)
        ps = httpx.get(cluster["p"].base + "/pd/stats").json()
    assert ps["held"] == 0 and ps["engine"]["released_notify"] >= len(recs), ps


def test_prefill_frees_after_ttl(cluster):
    p = cluster["p"].base
    before = httpx.get(p + "/pd/stats").json()["engine"]["released_ttl"]
    hold = json.dumps({"prompt": _prompt(7, 40), "max_tokens": 1, "temperature": 0.0,
                       "kv_transfer_params": {"do_remote_decode": True}}).encode()
    # only a holder of the P/D secret (the router) may make a prefill instance hold KV
    r = httpx.post(p + "/v1/completions", content=hold, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["param"] == "x-dsflash-pd-auth", r.text
    r = httpx.post(p + "/v1/completions", content=hold, timeout=60,
                   headers={"content-type": "application/json", **TRUST.peer_headers("POST", "/v1/completions", hold)})
    assert r.status_code == 200, r.text
    kv = r.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["remote_num_tokens"] == 40 and len(kv["remote_block_ids"]) == 1
    assert kv["remote_engine_id"].startswith("prefill-")
    assert httpx.get(p + "/pd/stats").json()["held"] >= 1
    t_end = time.time() + 30          # --kv-ttl 8
    while time.time() < t_end:
        st = httpx.get(p + "/pd/stats").json()
        if st["engine"]["released_ttl"] > before:
            break
        time.sleep(0.5)
    assert st["engine"]["released_ttl"] == before + 1, st
    # the KV routes are for peers only
    assert httpx.get(f"{p}/pd/kv/{kv['remote_request_id']}").status_code == 403
    assert httpx.post(f"{p}/pd/release/{kv['remote_request_id']}").status_code == 403
    # the decode side pulling it now gets a clear failure (policy fail) or recomputes (policy recompute)
    body = {"prompt": _prompt(7, 40), "max_tokens": 8, "temperature": 0.0,
            "kv_transfer_params": TRUST.sign_params(kv, p, ttl=100)}
    f = httpx.post(cluster["d"].base + "/v1/completions", json={**body, "kv_load_failure_policy": "fail"}, timeout=60)
    assert f.status_code == 502, f.text
    err = f.json()["error"]
    assert err["code"] == "kv_transfer_failed" and kv["remote_engine_id"] in err["message"]
    assert "404" in err["message"]
    # signed parameters are good for one use
    again = httpx.post(cluster["d"].base + "/v1/completions", json={**body, "kv_load_failure_policy": "recompute"},
                       timeout=60)
    assert again.status_code == 403 and "already used" in again.json()["error"]["message"], again.text
    body["kv_transfer_params"] = TRUST.sign_params(kv, p, ttl=101)
    rc = httpx.post(cluster["d"].base + "/v1/completions", json={**body, "kv_load_failure_policy": "recompute"},
                    timeout=60)
    ref = httpx.post(cluster["agg"].base + "/v1/completions",
                     json={k: v for k, v in body.items() if k != "kv_transfer_params"}, timeout=60)
    assert rc.status_code == 200 and rc.headers["x-dsflash-kv-outcome"] == "recomputed"
    assert rc.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_router_balances_and_keeps_affinity_unit():
    from dsflash.serve.router import Router
    r = Router([], ["http://d0", "http://d1", "http://d2"], affinity_block=16, affinity_slack=2)
    conv = [{"role": "system", "content": "you are a helpful assistant " * 3},
            {"role": "user", "content": "first question about something long enough"}]
    d1, how = r.pick_decode("/v1/chat/completions", {"messages": conv})
    assert how == "miss"
    d1.in_flight += 1                          # busy: a new conversation goes elsewhere
    other, how2 = r.pick_decode("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}]})
    assert other is not d1 and how2 == "miss"
    other.in_flight += 1
    turn2 = conv + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "follow-up"}]
    d2, how = r.pick_decode("/v1/chat/completions", {"messages": turn2})
    assert d2 is d1 and how == "hit"           # same conversation -> the instance holding its prefix
    d1.in_flight += 5                          # too busy: affinity gives way to load
    d3, how = r.pick_decode("/v1/chat/completions", {"messages": turn2 + [{"role": "user", "content": "more"}]})
    assert d3 is not d1 and how == "overridden"
    # least loaded otherwise
    for i, inst in enumerate(r.decode):
        inst.in_flight = [3, 0, 2][i]
    assert r.pick_decode("/v1/completions", {"prompt": "unrelated " * 10})[0] is r.decode[1]


def test_router_affinity_multi_turn(cluster):
    base = cluster["router"].base
    msgs = [{"role": "system", "content": "You are a storyteller. Keep every answer short, vivid and kind. " * 3},
            {"role": "user", "content": "Tell me a story about a robot and a very small cat, please."}]
    r1 = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0.0},
                    timeout=60)
    assert r1.status_code == 200
    answer = r1.json()["choices"][0]["message"].get("content") or ""
    msgs = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    r2 = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0.0},
                    timeout=60)
    assert r2.status_code == 200
    assert r2.headers["x-dsflash-affinity"] == "hit"
    assert r2.headers["x-dsflash-decode"] == r1.headers["x-dsflash-decode"]
    st = httpx.get(base + "/router/stats").json()
    assert st["counters"]["affinity_hits"] >= 1


def test_decode_prefix_cache_skips_pages(cluster):
    """A second turn extending a prompt the decode instance already holds pulls only the new pages (SGLang-style
    delta). Turn 2 is a prefix-cache hit on the prefill side too (bounded replay), whose result depends on what
    the replaying slot held before (docs/pd.md), so only turn 1 is compared with the aggregated server."""
    router, agg, d = cluster["router"].base, cluster["agg"].base, cluster["d"].base
    a = _prompt(900, 130)                     # two full 64-token pages
    ab = a + _prompt(901, 70)
    outs = []
    for prompt in (a, ab):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        outs.append(_run_all([(router, "/v1/completions", body, {}), (agg, "/v1/completions", body, {})]))
    (s1, o1, _), (s2, o2, _) = outs[0]
    assert s1 == s2 == 200 and o1 == o2
    assert outs[1][0][0] == 200 and outs[1][0][2]["x-dsflash-kv-outcome"] == "transferred"
    assert outs[1][0][2]["x-dsflash-affinity"] == "hit"
    rec = [r for r in httpx.get(d + "/pd/stats").json()["transfers"] if r["prompt_tokens"] == 200][-1]
    g = httpx.get(d + "/pd/info").json()["sizes"]["global_kv_bytes_per_token"]
    assert rec["skipped_tokens"] == 128 and rec["global_bytes"] <= g * (200 - 128) + 1024, rec
    print(f"\n[pd] turn 2 (200 tokens, 128 cached on decode): {rec['global_bytes']} B of global KV moved "
          f"instead of {g * 200:.0f}")


class _Listener:
    """What a hostile client runs on 127.0.0.1: ``/pd/info`` answers with the real prefill layout, ``/pd/kv/*``
    with random KV in the right shapes for ``prompt``. Records every request it gets."""

    def __init__(self, info: dict, prompt: list[int]):
        self.requests: list[str] = []
        lay, n = info["layout"], len(prompt)
        rng = np.random.default_rng(7)
        arrays = []
        for name, (shape, dtype) in sorted(lay["leaves"].items()):
            dt = np.dtype(jnp.dtype(dtype))
            if name in lay["ratios"]:
                r = lay["ratios"][name]
                rows, info_ = math.ceil(n / r), {"kind": "global", "ratio": r, "first": 0}
            else:
                need = {"swa": lay["window"], "comp": 2, "engram_hist": max(1, lay["ngram"] - 1)}[name.split("/")[0]]
                rows, info_ = need, {"kind": "ring", "first": n - need}
            cnt = rows * int(np.prod(shape, dtype=np.int64))
            if dt.kind in "iu":
                a = rng.integers(0, 400, cnt).astype(dt)
            else:
                a = rng.integers(0, 256, cnt * dt.itemsize, dtype=np.uint8).view(dt)
            arrays.append((name, a.reshape([rows, *shape]), info_))
        meta = {"engine_id": "prefill-evil", "request_id": "evil-1", "num_tokens": n,
                "prompt_digest": prompt_digest(prompt), "first_token": 7, "first_logprob": None, "floor": 0,
                "skip_tokens": 0, "page_size": info["page_size"]}
        body, infob, reqs = pack(meta, arrays), json.dumps(info).encode(), self.requests

        class H(http.server.BaseHTTPRequestHandler):
            def _send(self, data, ctype):
                self.send_response(200)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                reqs.append("GET " + self.path)
                self._send(infob if self.path.startswith("/pd/info") else body,
                           "application/json" if self.path.startswith("/pd/info") else "application/octet-stream")

            def do_POST(self):
                reqs.append("POST " + self.path)
                self._send(b'{"released": true}', "application/json")

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


def _cached_tokens(base: str, prompt: list[int]) -> int:
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0.0}, timeout=120)
    assert r.status_code == 200, r.text
    return int(((r.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_hostile_client_cannot_make_decode_pull(cluster):
    """Issue 21 item 1: a client that reaches the decode port directly with kv_transfer_params naming its own
    listener (real layout, random KV) must get a 4xx, the decode instance must never connect to the listener,
    and the same prompt afterwards must not be a prefix-cache hit."""
    d, router = cluster["d"].base, cluster["router"].base
    prompt = _prompt(4242, 200)
    lis = _Listener(httpx.get(cluster["p"].base + "/pd/info").json(), prompt)
    try:
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-evil",
              "remote_request_id": "evil-1", "remote_host": "127.0.0.1", "remote_port": lis.port,
              "remote_url": lis.url, "remote_block_ids": [0, 1, 2, 3], "remote_num_tokens": len(prompt),
              "remote_prompt_digest": prompt_digest(prompt), "first_token": 7, "tp_size": 1, "page_size": 64}
        forged = {**kv, "pd_expires": int(time.time()) + 60, "pd_sig": "0" * 64}
        # signed with the real secret but naming a peer outside the decode instance's --pd-peers
        off_list = TRUST.sign_params(kv, lis.url)
        cases = [("unsigned", kv, "kv_transfer_params.pd_expires"), ("forged", forged, "kv_transfer_params.pd_sig"),
                 ("not a peer", off_list, "kv_transfer_params.remote_url")]
        for what, params, field in cases:
            for policy in ("fail", "recompute"):
                r = httpx.post(d + "/v1/completions", timeout=60,
                               json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "kv_transfer_params": params,
                                     "kv_load_failure_policy": policy})
                assert 400 <= r.status_code < 500, (what, policy, r.status_code, r.text[:300])
                assert r.json()["error"]["param"] == field, (what, r.text)
                assert lis.requests == [], (what, lis.requests)
        # through the router, a client's kv_transfer_params are dropped (the router sets its own)
        r = httpx.post(router + "/v1/completions", timeout=120,
                       json={"prompt": _prompt(4244, 20), "max_tokens": 2, "kv_transfer_params": kv})
        assert r.status_code == 200 and r.headers["x-dsflash-kv-outcome"] == "transferred", r.text
        assert lis.requests == []
        assert _cached_tokens(d, prompt) == 0
    finally:
        lis.close()
    print(f"\n[pd] hostile kv_transfer_params: 403 x{2 * len(cases)}, listener untouched, no prefix-cache entry")


def test_tampered_kv_body_is_rejected(cluster):
    """A body flipped on the wire (after the prefill side's MAC) in a correctly signed router flow: the decode
    instance rejects it (policy fail -> 502 naming the MAC) and registers nothing from it."""
    router, p, d = cluster["router"].base, cluster["p"].base, cluster["d"].base
    prompt = _prompt(4343, 200)
    assert httpx.post(p + "/pd/test/kv_corrupt", json={"count": 1}).status_code == 200
    r = httpx.post(router + "/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "kv_load_failure_policy": "fail"})
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed" and "x-dsflash-kv-mac" in err["message"], err
    assert _cached_tokens(d, prompt) == 0
    print(f"\n[pd] tampered body: HTTP 502: {err['message'][:160]}")


def test_kill_prefill_mid_transfer_last(cluster):
    router, agg, p, d = cluster["router"].base, cluster["agg"].base, cluster["p"], cluster["d"].base
    survivors = [("/v1/completions", {"prompt": _prompt(500 + i, 30 + 20 * i), "max_tokens": 160,
                                      "temperature": 0.0, "ignore_eos": True, "stream": True}) for i in range(3)]
    victims = [("/v1/completions", {"prompt": _prompt(600 + i, 50), "max_tokens": 16, "temperature": 0.0,
                                    "ignore_eos": True, "stream": i == 0}) for i in range(2)]
    policies = ["fail", "recompute"]
    refs = _run_all([(agg, path, b, {}) for path, b in survivors + victims])

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as ac:
            first_chunk = [asyncio.Event() for _ in survivors]

            async def survivor(i, path, body):
                async with ac.stream("POST", router + path, json=body) as r:
                    assert r.status_code == 200
                    text = ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ev = json.loads(line[6:])
                            assert "error" not in ev, ev
                            text += ev["choices"][0]["text"]
                            if text:
                                first_chunk[i].set()
                    return 200, (text, "length"), r.headers

            tasks = [asyncio.ensure_future(survivor(i, pth, b)) for i, (pth, b) in enumerate(survivors)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk)), 120)   # all decoding on D
            s0 = (await ac.get(p.base + "/pd/stats")).json()
            await ac.post(p.base + "/pd/test/kv_delay", json={"seconds": 60})               # stall KV bodies
            vtasks = [asyncio.ensure_future(_call(ac, router, pth, b, kv_load_failure_policy=pol))
                      for (pth, b), pol in zip(victims, policies)]
            t_end = time.time() + 60
            while time.time() < t_end:                    # both victims' KV bodies are half sent
                st = (await ac.get(p.base + "/pd/stats")).json()
                if st["engine"]["extracts"] >= s0["engine"]["extracts"] + 2:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            p.proc.send_signal(signal.SIGKILL)           # the prefill process dies mid-transfer
            out_v = await asyncio.gather(*vtasks)
            out_s = await asyncio.gather(*tasks)
            after = await _call(ac, router, "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 4})
            return out_s, out_v, after

    out_s, out_v, after = asyncio.run(main())
    for (s, o, h), ref in zip(out_s, refs[:3]):
        assert s == 200 and o[0] == ref[1][0]                    # requests already decoding complete, same text
    (sf, of, hf), (sr, orc, hr) = out_v
    assert sf == 502 and of["error"]["code"] == "kv_transfer_failed", (sf, of)
    msg = of["error"]["message"]
    assert "KV transfer from prefill engine prefill-" in msg and "kv_load_failure_policy=fail" in msg
    print(f"\n[pd] policy fail -> HTTP {sf}: {msg}")
    assert sr == 200 and hr["x-dsflash-kv-outcome"] == "recomputed" and orc[0] == refs[4][1][0]
    # the prefill instance is gone: the router reports it, retries nothing
    assert after[0] == 502 and after[1]["error"]["code"] == "prefill_failed", after
    st = httpx.get(router + "/router/stats").json()
    assert st["counters"]["prefill_failures"] >= 1 and st["counters"]["failed_requests"] >= 2
    ds = httpx.get(d + "/pd/stats").json()["counters"]
    assert ds["pulls_failed"] >= 2 and ds["recomputed"] >= 1 and ds["failed_requests"] >= 1
    # the decode instance outlives its peer: healthy, and the next request (computed locally) is right
    assert httpx.get(d + "/health", timeout=10).json()["status"] == "ok"
    nxt = {"prompt": _prompt(700, 40), "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    (ref_s, ref_o, _), (dn_s, dn_o, _) = _run_all([(agg, "/v1/completions", nxt, {}), (d, "/v1/completions", nxt, {})])
    assert ref_s == dn_s == 200 and dn_o[0] == ref_o[0], (dn_s, dn_o)
