"""Exact prefix caching through the real server (``python -m dsflash.serve``, tiny preset, random weights): the
same temperature-0 and seeded prompts sent three times give identical tokens with ``cached_tokens > 0`` on the
repeats, /metrics counts snapshot hits and replay fallbacks, and ``--no-prefix-caching`` reports no cached
tokens. Two small servers (the second reuses the first one's compiled programs from the persistent cache)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from test_server_util import ServerProcess

ARGS = ["--model", "tiny", "--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
        "--page-size", "16"]


def _complete(base, prompt, **kw):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1, **kw}
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    cached = int(((j.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    c = j["choices"][0]
    return (c["text"], c["logprobs"]["tokens"]), cached


def _prompt(seed, n=53):
    return [int(x) for x in np.random.default_rng(seed).integers(4, 500, size=n)]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """One persistent compilation cache for the module's servers (conftest.py turns it off and the servers inherit
    that): the second loads the programs the first compiled."""
    return {"JAX_ENABLE_COMPILATION_CACHE": "true", "DSFLASH_CACHE_DIR": str(tmp_path_factory.mktemp("xla_cache"))}


@pytest.fixture(scope="module")
def server(cache_env):
    srv = ServerProcess(*ARGS, extra_env=cache_env)
    yield srv
    srv.terminate()
    srv.close()


@pytest.mark.parametrize("kw", [{}, {"temperature": 1.0, "seed": 77}], ids=["greedy", "seeded"])
def test_three_times_identical_with_cached_tokens(server, kw):
    p = _prompt(1 if not kw else 2)
    got = [_complete(server.base, p, **kw) for _ in range(3)]
    assert [c for _, c in got] == [0, 48, 48]
    assert got[1][0] == got[0][0] and got[2][0] == got[0][0]
    # engine gauges come from a snapshot refreshed every 0.5 s: wait, don't read once
    server.wait_metric("dsflash_engine_prefix_snapshot_hits", lambda v: v >= 2, timeout=10)
    assert "dsflash_prefix_cache_replay_fallbacks" in server.metrics()


def test_no_prefix_caching_reports_no_cached_tokens(cache_env):
    srv = ServerProcess(*ARGS, "--no-prefix-caching", extra_env=cache_env)
    try:
        p = _prompt(3)
        got = [_complete(srv.base, p) for _ in range(2)]
        assert [c for _, c in got] == [0, 0] and got[0][0] == got[1][0]
        assert srv.metrics()["dsflash_engine_prefix_snapshots_capacity"] == 0
    finally:
        srv.terminate()
        srv.close()
