"""The router (issue 21 items 5 and 6) as real processes on loopback, with the model-free ``dummy`` server as
its decode instance: ``kv_load_failure_policy: "recompute"`` with the prefill instance dead is answered by the
decode instance (no 502); its own ``--api-key`` and the key it sends the instances (``--backend-api-key``)."""
from __future__ import annotations

import httpx
import pytest

from test_server_util import ServerProcess, error_of, free_port

SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def stack():
    dec = ServerProcess("--model", "dummy", "--api-key", "backend-key", name="decode")
    dead = f"http://127.0.0.1:{free_port()}"          # nothing listens here: the prefill instance is gone
    router = ServerProcess("--prefill", dead, "--decode", dec.base, "--pd-secret", SECRET,
                           "--api-key", "router-key", "--backend-api-key", "backend-key",
                           module="dsflash.serve.router", name="router", startup_timeout=None)
    try:
        import time
        t_end = time.time() + 60
        while True:             # the router's /health is 503 (prefill down), so wait for its port instead
            try:
                httpx.get(router.base + "/router/stats", timeout=2)
                break
            except httpx.HTTPError:
                if time.time() > t_end or router.proc.poll() is not None:
                    raise RuntimeError(router.output())
                time.sleep(0.3)
        yield dec, router
    finally:
        router.close()
        dec.close()


RK = {"Authorization": "Bearer router-key"}


def test_recompute_when_prefill_is_dead(stack):
    dec, router = stack
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(router.base + "/v1/completions", json=body, headers=RK, timeout=60)
    assert r.status_code == 502 and error_of(r)["code"] == "prefill_failed", r.text      # policy fail (default)
    r = httpx.post(router.base + "/v1/completions", json={**body, "kv_load_failure_policy": "recompute"},
                   headers=RK, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert r.headers["x-dsflash-kv-outcome"] == "recomputed"
    with httpx.stream("POST", router.base + "/v1/chat/completions", headers=RK, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                            "kv_load_failure_policy": "recompute"}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert s.status_code == 200 and lines[-1] == "data: [DONE]"
    st = httpx.get(router.base + "/router/stats").json()["counters"]
    assert st["kv_recomputed"] >= 2 and st["prefill_failures"] >= 3


def test_router_api_key(stack):
    dec, router = stack
    body = {"prompt": "hello", "max_tokens": 2, "kv_load_failure_policy": "recompute"}
    for h in ({}, {"Authorization": "Bearer backend-key"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(router.base + "/v1/completions", json=body, headers=h, timeout=30)
        assert r.status_code == 401, r.text
        assert error_of(r)["code"] == "invalid_api_key"
        assert httpx.get(router.base + "/v1/models", headers=h).status_code == 401
    m = httpx.get(router.base + "/v1/models", headers=RK)
    assert m.status_code == 200 and m.json()["data"][0]["id"] == "dummy"      # the backend key went upstream
    r = httpx.post(router.base + "/v1/completions", content=b'{"prompt": ' + b"[" * 5000, headers=RK, timeout=30)
    assert r.status_code == 400, r.text
