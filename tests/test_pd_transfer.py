"""P/D KV through ``jax.experimental.transfer`` (``--kv-transport transfer``) against the HTTP body
(``--kv-transport http``), with real processes on loopback, tiny model, CPU.

One prefill process (both transports offered) and two decode processes, one per transport. The test plays
the router (hold request, then signed ``kv_transfer_params``, as ``dsflash/serve/router.py`` does). The
prefill process also serves ordinary requests exactly as an aggregated server does, so it gives the
single-server reference outputs.

* greedy output through prefill + decode over the transfer path (and over HTTP) equals the single server's;
* an offer whose uuid nobody offers: ``fail`` -> 502 ``kv_transfer_failed`` naming the timeout,
  ``recompute`` -> the single server's output;
* last: a dead prefill process gives both transports the same failure / recompute behaviour."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from test_pd_disagg import TRUST, _prompt, _start, pd_env

# the default (adaptive) speculation: with sequential verify (the CPU default) a row rounds the same whatever a
# call's draft length, so two servers agree token for token although their timings differ (docs/engine.md)
# every program compiled before a server reports healthy: with background compiles (the default) the three servers'
# drafting / tap-free compiles run beside the first pulls; in the full suite on a loaded 2-core machine a pull then ran
# past PULL_TIMEOUT once (a ReadTimeout 502, then a held KV left behind; the file alone passed)
ENGINE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--no-background-compile"]
PULL_TIMEOUT = "10"


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    procs = {}
    mp = pytest.MonkeyPatch()
    sec = pd_env(mp, tmp_path_factory)
    try:
        procs["p"] = _start("dsflash.serve", *ENGINE_ARGS, "--role", "prefill", "--pd-test-hooks",
                            "--kv-transport", "transfer", *sec, name="prefill").wait_healthy()
        peers = ("--pd-peers", f"127.0.0.1:{procs['p'].port}")
        procs["dt"] = _start("dsflash.serve", *ENGINE_ARGS, "--role", "decode", "--kv-transport", "transfer",
                             "--kv-pull-timeout", PULL_TIMEOUT, *sec, *peers, name="decode-transfer")
        procs["dh"] = _start("dsflash.serve", *ENGINE_ARGS, "--role", "decode", "--kv-transport", "http",
                             *sec, *peers, name="decode-http")
        for k in ("dt", "dh"):
            procs[k].wait_healthy()
        yield procs
    finally:
        mp.undo()
        for p in procs.values():
            p.close()


def _hold(p: str, body: dict) -> dict:
    """The router's first leg: prefill with one output token, KV held; returns the signed kv_transfer_params."""
    raw = json.dumps({**body, "max_tokens": 1, "stream": False,
                      "kv_transfer_params": {"do_remote_decode": True}}).encode()
    r = httpx.post(p + "/v1/completions", content=raw, timeout=120,
                   headers={"content-type": "application/json", **TRUST.peer_headers("POST", "/v1/completions", raw)})
    assert r.status_code == 200, r.text
    return TRUST.sign_params(r.json()["kv_transfer_params"], p)


def _decode(d: str, body: dict, kvp: dict, policy: str) -> httpx.Response:
    return httpx.post(d + "/v1/completions", timeout=120,
                      json={**body, "kv_transfer_params": kvp, "kv_load_failure_policy": policy})


def _release(p: str, kvp: dict):
    """What the router does after a failed decode: the held KV (and its slot) is freed at once, not after the TTL."""
    path = f"/pd/release/{kvp['remote_request_id']}"
    assert httpx.post(p + path, headers=TRUST.peer_headers("POST", path)).json()["released"]


def _body(seed: int, n: int) -> dict:
    return {"prompt": _prompt(seed, n), "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_transport_is_logged_and_advertised(pd):
    assert "P/D KV transport transfer (asked for)" in pd["dt"].output()
    assert "P/D KV transport http (asked for)" in pd["dh"].output()
    assert httpx.get(pd["p"].base + "/pd/info").json()["kv_transports"] == ["transfer", "http"]


@pytest.mark.parametrize("which", ["dt", "dh"])
def test_greedy_output_equals_single_server(pd, which):
    p, d = pd["p"].base, pd[which].base
    for i, n in enumerate((3, 70, 150)):
        body = _body(10 * i + (which == "dh"), n)
        ref = _text(httpx.post(p + "/v1/completions", json=body, timeout=120))
        r = _decode(d, body, _hold(p, body), "fail")
        assert _text(r) == ref, (which, n)
        assert r.headers["x-dsflash-kv-outcome"] == "transferred"
        assert r.headers["x-dsflash-kv-transport"] == ("transfer" if which == "dt" else "http")
    rec = httpx.get(d + "/pd/stats").json()["transfers"][-1]
    assert rec["transport"] == ("transfer" if which == "dt" else "http") and rec["prompt_tokens"] == 150
    assert httpx.get(p + "/pd/stats").json()["held"] == 0          # every pull released its KV


def test_unknown_uuid_fails_or_recomputes(pd):
    p, d = pd["p"].base, pd["dt"].base
    body = _body(77, 40)
    ref = _text(httpx.post(p + "/v1/completions", json=body, timeout=120))
    assert httpx.post(p + "/pd/test/offer_bad_uuid", json={"count": 1}).status_code == 200
    kvp = _hold(p, body)
    f = _decode(d, body, kvp, "fail")
    _release(p, kvp)
    assert f.status_code == 502, f.text
    err = f.json()["error"]
    assert err["code"] == "kv_transfer_failed" and "did not finish" in err["message"], err
    assert "[kv_load_failure_policy=fail]" in err["message"]
    assert httpx.post(p + "/pd/test/offer_bad_uuid", json={"count": 1}).status_code == 200
    kvp = _hold(p, body)
    r = _decode(d, body, kvp, "recompute")
    _release(p, kvp)
    assert _text(r) == ref and r.headers["x-dsflash-kv-outcome"] == "recomputed"
    assert httpx.get(p + "/pd/stats").json()["held"] == 0
    # the next pull (a new connection) works again
    r = _decode(d, body, _hold(p, body), "fail")
    assert _text(r) == ref and r.headers["x-dsflash-kv-outcome"] == "transferred"


def test_offer_needs_peer_auth(pd):
    p = pd["p"].base
    r = httpx.post(p + "/pd/offer/nope")
    assert r.status_code == 403 and r.json()["error"]["param"] == "x-dsflash-pd-auth"
    path = "/pd/offer/nope?skip_tokens=0"
    r = httpx.post(p + path, headers=TRUST.peer_headers("POST", path))
    assert r.status_code == 404 and r.json()["error"]["code"] == "kv_not_found"


def test_dead_prefill_same_policy_both_transports_last(pd):
    p = pd["p"].base
    bodies = {k: _body(90 + j, 50) for j, k in enumerate(("dt", "dh"))}
    refs = {k: _text(httpx.post(p + "/v1/completions", json=b, timeout=120)) for k, b in bodies.items()}
    held = {k: [_hold(p, b), _hold(p, b)] for k, b in bodies.items()}
    pd["p"].proc.send_signal(signal.SIGKILL)
    pd["p"].proc.wait(30)
    for k, b in bodies.items():
        f = _decode(pd[k].base, b, held[k][0], "fail")
        assert f.status_code == 502, (k, f.text)
        err = f.json()["error"]
        assert err["code"] == "kv_transfer_failed" and held[k][0]["remote_engine_id"] in err["message"], (k, err)
        r = _decode(pd[k].base, b, held[k][1], "recompute")
        assert _text(r) == refs[k] and r.headers["x-dsflash-kv-outcome"] == "recomputed", k
