"""Structured output under speculative decoding through the real server: drafts verified against the grammar.
Two servers (``--speculative-mode always`` and ``off``, both started here, fp32: at the serving precisions the
verify and plain programs may round a near-tie differently): greedy answers under a schema / regex are identical, and sampled ``json_schema`` answers on chat and completions validate over seeds,
streamed and not; ``tool_choice`` required / named gives the same schema-valid calls streamed and not, greedy ones the
same as without speculation, and the speculative server's counters show those requests drafted and accepted
(test_server_structured.py covers the fields and errors on the default server)."""
from __future__ import annotations

import json
import re
import signal
import time

import httpx
import jsonschema
import openai
import pytest

from test_server_structured import MSG as TOOL_MSG
from test_server_structured import SCHEMA, TOOLS, _check_calls, _concurrently, _stream_chat
from test_server_util import ServerProcess, default_test_model

MODEL = default_test_model()
pytestmark = pytest.mark.skipif(MODEL == "dummy", reason="the dummy engine does not run grammars")
RF = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
MSG = [{"role": "user", "content": "Describe a thing as JSON."}]


def _wait_for_prefill(first, cache, timeout=600.0):
    """Until ``first`` has written its prefill program to the shared ``cache`` (or is up, or gone): a server started
    then loads it instead of compiling it too, while both compile their own decode programs at once."""
    t_end = time.time() + timeout
    while (time.time() < t_end and first.proc.poll() is None and not list(cache.glob("jit__prefill_impl-*"))
           and not _healthy(first)):
        time.sleep(0.5)


def _healthy(s):
    try:
        return httpx.get(s.base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    extra = [] if MODEL == "demo" else ["--model", MODEL]
    # one persistent compilation cache for both (conftest.py turns it off): the two share their prefill program
    cache = tmp_path_factory.mktemp("xla_cache")
    env = {"JAX_ENABLE_COMPILATION_CACHE": "true", "DSFLASH_CACHE_DIR": str(cache)}
    args = {m: (*extra, "--speculative-mode", m, "--precision", "fp32") for m in ("always", "off")}
    srv = {"always": ServerProcess(*args["always"], startup_timeout=None, name="spec-always", extra_env=env)}
    try:
        _wait_for_prefill(srv["always"], cache)
        srv["off"] = ServerProcess(*args["off"], startup_timeout=None, name="spec-off", extra_env=env)
        for s in srv.values():
            s.wait_healthy(600)
        yield {m: openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=300)
               for m, s in srv.items()}
    finally:
        for s in srv.values():                 # both drain at once
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        rcs = {m: s.terminate() for m, s in srv.items()}
        for s in srv.values():
            s.close()
        assert set(rcs.values()) == {0}, rcs


def _model(client):
    return client.models.list().data[0].id


def _greedy(client):
    m = _model(client)
    chat = client.chat.completions.create(model=m, messages=MSG, response_format=RF, max_tokens=96, temperature=0)
    comp = client.completions.create(model=m, prompt="A thing as JSON:", max_tokens=96, temperature=0,
                                     extra_body={"response_format": RF})
    rx = client.completions.create(model=m, prompt="The answer is", max_tokens=24, temperature=0,
                                   extra_body={"guided_regex": "[a-z]{2,6}( [a-z]{2,6}){0,3}"})
    return [chat.choices[0].message.content, comp.choices[0].text, rx.choices[0].text]


def test_greedy_constrained_output_is_the_same_with_and_without_speculation(servers):
    spec, plain = _concurrently(_greedy, [servers["always"], servers["off"]])     # each server's own in turn
    assert spec == plain
    for text in spec[:2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch("[a-z]{2,6}( [a-z]{2,6}){0,3}", spec[2]), spec[2]


@pytest.mark.parametrize("stream", [False, True])
def test_speculative_json_schema_answers_validate_over_seeds(servers, stream):
    client = servers["always"]
    m = _model(client)
    cases = [(ep, seed) for ep in ("chat", "completions") for seed in range(6)]

    def ask(case):
        ep, seed = case
        if ep == "chat":
            kw = dict(model=m, messages=MSG, response_format=RF, max_tokens=96, temperature=1.0, seed=seed)
            if stream:
                text, _, finish = _stream_chat(client, **kw)
                return text, finish
            c = client.chat.completions.create(**kw).choices[0]
            return c.message.content, c.finish_reason
        kw = dict(model=m, prompt=f"Thing {seed} as JSON:", max_tokens=96, temperature=1.0, seed=seed,
                  extra_body={"response_format": RF})
        if stream:
            text, finish = "", None
            for ch in client.completions.create(stream=True, **kw):
                if ch.choices:
                    text += ch.choices[0].text or ""
                    finish = ch.choices[0].finish_reason or finish
            return text, finish
        c = client.completions.create(**kw).choices[0]
        return c.text, c.finish_reason

    for case, (text, finish) in zip(cases, _concurrently(ask, cases), strict=True):
        assert finish == "stop", (case, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def _spec_counts(client):
    """The server's speculative-decoding counters (summed from each finished request's own metrics)."""
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    text = httpx.get(base + "/metrics", timeout=10).text
    names = ("num_drafts", "num_accepted_tokens")
    vals = dict(re.findall(r"^dsflash_spec_decode_(%s)_total (\S+)$" % "|".join(names), text, re.M))
    assert set(vals) == set(names), text[:2000]
    return {k: float(v) for k, v in vals.items()}


def _tool_ask(client, choice, stream, temperature, seed=None):
    kw = dict(model=_model(client), messages=TOOL_MSG, tools=TOOLS, tool_choice=choice, max_tokens=200,
              temperature=temperature, parallel_tool_calls=False, **({} if seed is None else {"seed": seed}))
    if stream:
        return _stream_chat(client, **kw)
    c = client.chat.completions.create(**kw).choices[0]
    calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
    return c.message.content or "", calls, c.finish_reason


def test_tool_choice_under_speculation(servers):
    """``tool_choice`` required / named on the speculative server (the DSML grammar verifying drafts): one
    schema-valid call of an allowed tool, ``finish_reason`` tool_calls, streamed the same as not; greedy, the
    same calls as the plain server; sampled (seeded), valid. The requests drafted and accepted drafts (a guided
    row that silently stopped drafting would pass the rest)."""
    choices = {"required": ("required", {"get_weather", "get_time"}),
               "named": ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})}
    cases = ([(srv, ch, stream, 0.0, None) for srv in ("always", "off") for ch in choices for stream in (False, True)]
             + [("always", ch, stream, 1.0, 0) for ch in choices for stream in (False, True)])
    before = {m: _spec_counts(c) for m, c in servers.items()}
    outs = _concurrently(lambda c: _tool_ask(servers[c[0]], choices[c[1]][0], *c[2:]), cases)
    after = {m: _spec_counts(c) for m, c in servers.items()}
    res = {}
    for (srv, ch, stream, temp, seed), (text, calls, finish) in zip(cases, outs, strict=True):
        assert finish == "tool_calls", (srv, ch, stream, temp, seed, text, calls)
        assert "DSML" not in text
        _check_calls(calls, choices[ch][1])
        assert len(calls) == 1
        res[srv, ch, stream, temp, seed] = (text, calls)
    for srv, ch, stream, temp, seed in res:
        if stream:                          # streamed == not (the seed fixes a sampled row's speculative sample)
            assert res[srv, ch, True, temp, seed] == res[srv, ch, False, temp, seed], (srv, ch, temp, seed)
        if srv == "always" and temp == 0:   # greedy: the same as without speculation
            assert res["always", ch, stream, 0.0, None] == res["off", ch, stream, 0.0, None], (ch, stream)
    assert after["always"]["num_drafts"] > before["always"]["num_drafts"], (before, after)
    assert after["always"]["num_accepted_tokens"] > before["always"]["num_accepted_tokens"], (before, after)
    assert after["off"] == before["off"], (before, after)
