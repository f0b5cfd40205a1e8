"""The server's ``X-data-parallel-rank`` header (SERVING §3 pinning) reaches the engine's ``dp_rank``.

A real server process on ``--mesh dep=2`` (two faked CPU devices through ``JAX_NUM_CPU_DEVICES``; the
test helper drops the test process's ``XLA_FLAGS``), tiny model. A request pinned to rank 1 leaves rank 0
on dummy rows in every device call (``dsflash_engine_dp_ranks_0_dummy_calls`` grows, rank 1's does not);
a bad header value is an OpenAI-style 400 naming the header."""
from __future__ import annotations

import time

import httpx
import pytest

from test_server_util import error_of, start_server

HEADER = "X-data-parallel-rank"


@pytest.fixture(scope="module")
def server():
    mp = pytest.MonkeyPatch()
    mp.setenv("JAX_NUM_CPU_DEVICES", "2")
    try:
        srv = start_server("--model", "tiny", "--mesh", "dep=2", "--max-num-seqs", "4", "--max-model-len", "128",
                           "--page-size", "16", "--max-num-batched-tokens", "64")
    finally:
        mp.undo()
    yield srv
    srv.terminate()
    srv.close()


def _complete(server, headers=None, prompt=(5, 6, 7, 8, 9)):
    return httpx.post(server.base + "/v1/completions", timeout=120, headers=headers or {},
                      json={"model": _model(server), "prompt": list(prompt), "max_tokens": 4, "temperature": 0})


def _model(server):
    return httpx.get(server.base + "/v1/models").json()["data"][0]["id"]


def _dummy_calls(server):
    text = httpx.get(server.base + "/metrics").text
    out = {}
    for r in (0, 1):
        name = f"dsflash_engine_dp_ranks_{r}_dummy_calls"
        vals = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
        out[r] = vals[0] if vals else None
    return out


def _settled(server, before, t_wait=10.0):
    """Dummy-call counts once the engine's metrics snapshot has caught up with a finished request."""
    t_end = time.time() + t_wait
    while True:
        now = _dummy_calls(server)
        if now != before or time.time() > t_end:
            return now
        time.sleep(0.3)


def _stable(server, quiet=1.0, t_wait=20.0):
    """Dummy-call counts once they stopped changing for ``quiet`` seconds (metrics snapshots lag a request)."""
    t_end = time.time() + t_wait
    last, since = _dummy_calls(server), time.time()
    while time.time() < t_end:
        time.sleep(0.2)
        now = _dummy_calls(server)
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet:
            break
    return last


def test_pinned_rank_runs_alone(server):
    assert _complete(server).status_code == 200          # warm; the balancer picks
    base = _stable(server)                                # the warm request's own dummy calls counted
    assert base[0] is not None and base[1] is not None, "per-rank gauges missing"
    r = _complete(server, {HEADER: "1"}, prompt=(9, 8, 7, 6, 5, 4))
    assert r.status_code == 200, r.text
    _settled(server, base)
    after = _stable(server)
    assert after[0] > base[0] and after[1] == base[1], (base, after)
    base = after
    r = _complete(server, {HEADER: "0"}, prompt=(3, 4, 5, 6, 7, 8, 9))
    assert r.status_code == 200, r.text
    _settled(server, base)
    after = _stable(server)
    assert after[1] > base[1] and after[0] == base[0], (base, after)


@pytest.mark.parametrize("value", ["2", "-1", "abc", "1.0"])
def test_bad_rank_is_400_naming_the_header(server, value):
    r = _complete(server, {HEADER: value})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert HEADER in err["message"] and err["param"] == HEADER, err
    r = httpx.post(server.base + "/v1/chat/completions", timeout=120, headers={HEADER: value},
                   json={"model": _model(server), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and HEADER in error_of(r)["message"]
