"""P/D pieces without processes or a model: the wire format, the router's prefix hashes and choices."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.serve.pd.transfer import TransferSize, pack, prompt_digest, unpack
from dsflash.serve.router import Router, conversation_text, prefix_hashes


def _arrays():
    r = np.random.default_rng(0)
    return [("main_kv/2/q", r.integers(0, 255, (5, 64), dtype=np.uint8), {"kind": "global", "ratio": 2, "first": 0}),
            ("main_kv/2/s", np.asarray(r.normal(size=(5, 8)), jnp.float8_e4m3fn),
             {"kind": "global", "ratio": 2, "first": 0}),
            ("swa/0/x", np.asarray(r.normal(size=(16, 32)), jnp.bfloat16), {"kind": "ring", "first": 3}),
            ("engram_hist", np.arange(2, dtype=np.int32), {"kind": "ring", "first": 17})]


def test_wire_round_trip_keeps_bytes_and_dtypes():
    arrays = _arrays()
    meta = {"num_tokens": 19, "prompt_digest": prompt_digest(range(19)), "skip_tokens": 0}
    body = pack(meta, arrays)
    m2, a2 = unpack(body)
    assert m2["num_tokens"] == 19 and m2["prompt_digest"] == prompt_digest(list(range(19)))
    for (n1, x1, i1), (n2, x2, i2) in zip(arrays, a2):
        assert n1 == n2 and x1.dtype == x2.dtype and x1.shape == x2.shape and i1 == i2
        assert x1.tobytes() == x2.tobytes()
    sz = TransferSize.of(m2, a2, len(body))
    assert sz.global_bytes == 5 * 64 + 5 * 8 and sz.window_bytes == 16 * 32 * 2 + 8
    assert len(body) - (sz.global_bytes + sz.window_bytes) < 2048      # header only


@pytest.mark.parametrize("cut", [3, 20, 200, -1])
def test_truncated_or_corrupt_body_is_an_error(cut):
    body = pack({"num_tokens": 19}, _arrays())
    with pytest.raises(ValueError, match="payload"):
        unpack(body[:cut])
    with pytest.raises(ValueError, match="magic"):
        unpack(b"XXXX" + body[4:])
    with pytest.raises(ValueError, match="trailing"):
        unpack(body + b"\0")


def test_prompt_digest_distinguishes_prompts():
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4]) != prompt_digest([1, 2])


def test_prefix_hashes_chain_and_conversation_text():
    a = prefix_hashes("x" * 100, 32)
    b = prefix_hashes("x" * 64 + "y" * 40, 32)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    t1 = conversation_text("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    t2 = conversation_text("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "yo"}]})
    assert t2.startswith(t1)
    assert conversation_text("/v1/completions", {"prompt": [1, 2, 3]}) == "[1, 2, 3]"


def test_router_needs_a_decode_instance_and_spreads_new_sessions():
    with pytest.raises(ValueError):
        Router(["http://p"], [])
    r = Router([], ["http://a", "http://b"], affinity_block=8)
    seen = set()
    for i in range(4):
        inst, how = r.pick_decode("/v1/completions", {"prompt": f"session {i} " * 4})
        assert how == "miss"
        inst.in_flight += 1
        seen.add(inst.url)
    assert seen == {"http://a", "http://b"} and [i.in_flight for i in r.decode] == [2, 2]


def test_shared_system_prompt_alone_is_not_affinity():
    r = Router([], ["http://a", "http://b"], affinity_block=16, affinity_threshold=0.5)
    system = {"role": "system", "content": "You are a helpful assistant. " * 4}
    a, _ = r.pick_decode("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "q" * 20}]})
    a.in_flight += 1
    b, how = r.pick_decode("/v1/chat/completions",
                           {"messages": [system, {"role": "user", "content": "a different question " * 8}]})
    assert how == "miss" and b is not a


# ---------------------------------------------------------------------- the trust boundary (docs/pd.md)
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from dsflash.serve.pd.trust import MAC_HEADER, PDTrust, TrustError, load_secret, parse_peers, peer_key  # noqa: E402

KEY = b"unit-test-secret-0123456789"
PEER = "http://127.0.0.1:8100"


def _kvp(**over):
    kv = {"do_remote_prefill": True, "remote_engine_id": "prefill-abc", "remote_request_id": "cmpl-1",
          "remote_url": "http://0.0.0.0:8100", "remote_host": "0.0.0.0", "remote_port": 8100, "remote_num_tokens": 19,
          "remote_prompt_digest": prompt_digest(range(19)), "first_token": 42, "page_size": 64}
    return {**kv, **over}


def test_signed_params_verify_and_point_at_the_routers_url():
    t = PDTrust(KEY, [PEER])
    s = t.sign_params(_kvp(), PEER)
    assert s["remote_url"] == PEER and s["remote_host"] == "127.0.0.1" and s["remote_port"] == 8100
    v = PDTrust(KEY, ["127.0.0.1:8100"]).verify_params(json.loads(json.dumps(s)))   # survives the JSON trip
    assert v["remote_url"] == PEER and v["remote_num_tokens"] == 19
    with pytest.raises(TrustError, match="already used"):
        t.verify_params(s) and t.verify_params(s)


@pytest.mark.parametrize("field,value", [("remote_url", "http://127.0.0.1:9999"), ("remote_request_id", "cmpl-2"),
                                         ("remote_num_tokens", 20), ("remote_num_tokens", 19.0),
                                         ("remote_prompt_digest", prompt_digest(range(18))), ("first_token", 43),
                                         ("remote_engine_id", "prefill-x"), ("pd_sig", "0" * 64)])
def test_any_change_to_signed_params_is_refused(field, value):
    t = PDTrust(KEY, [PEER, "127.0.0.1:9999"])
    s = {**t.sign_params(_kvp(), PEER), field: value}
    with pytest.raises(TrustError) as e:
        t.verify_params(s)
    assert e.value.param.startswith("kv_transfer_params.")


def test_unsigned_wrong_key_expired_or_off_list_params_are_refused():
    t = PDTrust(KEY, [PEER])
    with pytest.raises(TrustError) as e:
        t.verify_params(_kvp(remote_url=PEER))
    assert e.value.param == "kv_transfer_params.pd_expires"            # unsigned: no signed fields at all
    with pytest.raises(TrustError) as e:
        t.verify_params(PDTrust(b"another-secret-0123456789", [PEER]).sign_params(_kvp(), PEER))
    assert e.value.param == "kv_transfer_params.pd_sig"
    with pytest.raises(TrustError) as e:
        t.verify_params(t.sign_params(_kvp(), PEER, now=time.time() - 1000))
    assert e.value.param == "kv_transfer_params.pd_expires"
    with pytest.raises(TrustError) as e:
        t.verify_params(t.sign_params(_kvp(), "http://127.0.0.1:8101"))
    assert e.value.param == "kv_transfer_params.remote_url" and "--pd-peers" in str(e.value)
    with pytest.raises(ValueError):
        t.sign_params(_kvp(remote_prompt_digest=None), PEER)          # a prefill answer without the digest


def test_peer_requests_and_kv_body_mac():
    t = PDTrust(KEY)
    h = t.peer_headers("GET", "/pd/kv/cmpl-1?skip_tokens=0")
    t.verify_peer("GET", "/pd/kv/cmpl-1?skip_tokens=0", h["x-dsflash-pd-auth"])
    for method, path, hdr in [("GET", "/pd/kv/cmpl-1?skip_tokens=64", h["x-dsflash-pd-auth"]),
                              ("POST", "/pd/kv/cmpl-1?skip_tokens=0", h["x-dsflash-pd-auth"]),
                              ("GET", "/pd/kv/cmpl-1?skip_tokens=0", None), ("GET", "/pd/kv/cmpl-1?skip_tokens=0", "1.x")]:
        with pytest.raises(TrustError):
            t.verify_peer(method, path, hdr)
    body = pack({"num_tokens": 19}, _arrays())
    kw = dict(request_id="cmpl-1", engine_id="prefill-abc", num_tokens=19, prompt_digest=prompt_digest(range(19)))
    mac = t.body_mac(body=body, **kw)
    t.verify_body(mac, body=body, **kw)
    flipped = body[:-1] + bytes([body[-1] ^ 1])
    for bad in [dict(kw, body=flipped), dict(kw, body=body, prompt_digest=prompt_digest(range(18))),
                dict(kw, body=body, request_id="cmpl-2"), dict(kw, body=body, num_tokens=20)]:
        with pytest.raises(TrustError, match=MAC_HEADER):
            t.verify_body(mac, **bad)


def test_secret_and_peer_parsing(tmp_path):
    assert load_secret(env={}) is None
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short", env={})
    f = tmp_path / "k"
    f.write_text("  " + KEY.decode() + "\n")
    assert load_secret(secret_file=str(f), env={}) == KEY
    assert load_secret(env={"DSFLASH_PD_SECRET": KEY.decode()}) == KEY
    assert parse_peers("127.0.0.1:8100, http://LOCALHOST:8200/") == {"127.0.0.1:8100", "localhost:8200"}
    assert peer_key("http://[::1]:81") == "[::1]:81"
    for bad in ("http://u:p@h:1", "http://h:1/path", "ftp://h:1"):
        with pytest.raises(ValueError):
            peer_key(bad)


def test_unpack_refuses_inconsistent_array_sizes():
    body = bytearray(pack({"num_tokens": 19}, _arrays()))
    i = body.index(b'"nbytes":320')
    body[i:i + 12] = b'"nbytes":319'
    with pytest.raises(ValueError, match="bytes for"):
        unpack(bytes(body))


def test_router_drops_client_kv_transfer_params():
    """A client's kv_transfer_params never reach an instance through the router (direct path, no prefill)."""
    import asyncio

    import httpx

    from dsflash.serve.router import Router
    seen = []

    def handler(request: httpx.Request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "x", "finish_reason": "length"}]})

    r = Router([], ["http://d0"])
    r._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    body = {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_prefill": True,
                                                                    "remote_url": "http://evil:1"}}
    resp = asyncio.run(r.handle("/v1/completions", json.dumps(body).encode()))
    assert resp.status_code == 200 and seen and "kv_transfer_params" not in seen[0]
    with pytest.raises(ValueError, match="secret"):
        Router(["http://p"], ["http://d"])


@pytest.mark.parametrize("argv,needs", [
    (["-m", "dsflash.serve", "--role", "decode", "--port", "0"], "--pd-secret"),
    (["-m", "dsflash.serve", "--role", "prefill", "--port", "0"], "--pd-secret"),
    (["-m", "dsflash.serve", "--role", "decode", "--port", "0", "--pd-secret", KEY.decode()], "--pd-peers"),
    (["-m", "dsflash.serve.router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
      "--port", "0"], "--pd-secret")])
def test_pd_processes_refuse_to_start_without_the_secret(argv, needs):
    import os
    env = {k: v for k, v in os.environ.items() if k != "DSFLASH_PD_SECRET"}
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-500:])
    assert needs in p.stderr and "error:" in p.stderr


def test_pd_state_reaches_the_engine_on_the_envelope_only_with_a_live_ticket():
    """The P/D async engine finds a request's verified P/D state through the ticket the middleware put into the
    envelope's kv_transfer_params (no context variable); a client's guessed or stale ticket finds nothing."""
    from dsflash.serve.pd.server import TICKET, PDRequest, PDState
    from dsflash.serve.pd.trust import PDTrust

    pd = PDState(object(), "decode", trust=PDTrust(KEY, [PEER]))
    req = PDRequest({"do_remote_prefill": True}, "fail")
    pd.tickets["t" * 32] = req
    assert pd.request_of({"do_remote_prefill": True, TICKET: "t" * 32}) is req
    for forged in ({TICKET: "u" * 32}, {TICKET: 7}, {}, None, {"do_remote_prefill": True}):
        assert pd.request_of(forged) is None


def test_device_fingerprint_sees_values_order_and_dtypes():
    import jax

    from dsflash.serve.pd.device_transfer import fingerprint
    arrays = [(n, jax.device_put(x), i) for n, x, i in _arrays()]
    fp = fingerprint(arrays)
    assert fp == fingerprint([(n, jax.device_put(np.array(x)), i) for n, x, i in arrays])
    q = np.asarray(arrays[0][1]).copy()
    q[1, 2] ^= 1                                       # one bit
    assert fingerprint([(arrays[0][0], jax.device_put(q), {})])[arrays[0][0]] != fp[arrays[0][0]]
    swapped = np.asarray(arrays[0][1])[::-1].copy()   # same words, other order
    assert fingerprint([(arrays[0][0], jax.device_put(swapped), {})])[arrays[0][0]] != fp[arrays[0][0]]


def test_kv_transport_choice(monkeypatch):
    from dsflash.serve.pd import device_transfer as dt
    assert dt.choose_transport("http") == ("http", "asked for")
    assert dt.choose_transport("auto")[0] == ("transfer" if dt.available() is None else "http")
    monkeypatch.setattr(dt, "available", lambda: "import jax.experimental.transfer failed: ImportError: x")
    assert dt.choose_transport("auto")[0] == "http" and "unavailable" in dt.choose_transport(None)[1]
    with pytest.raises(ValueError, match="--kv-transport http"):
        dt.choose_transport("transfer")
