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
