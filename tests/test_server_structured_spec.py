"""Structured output under speculative decoding through the real server: drafts verified against the grammar.
Two servers (``--speculative-mode always`` and ``off``, both started here, fp32: at the serving precisions the
verify and plain programs may round a near-tie differently): greedy answers under a schema / regex are identical, and sampled ``json_schema`` answers on chat and completions validate over seeds,
streamed and not (test_server_structured.py covers the fields and errors on the default server)."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from test_server_structured import SCHEMA, _concurrently, _stream_chat
from test_server_util import ServerProcess, default_test_model

MODEL = default_test_model()
pytestmark = pytest.mark.skipif(MODEL == "dummy", reason="the dummy engine does not run grammars")
RF = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
MSG = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def servers():
    extra = [] if MODEL == "demo" else ["--model", MODEL]
    srv = {m: ServerProcess(*extra, "--speculative-mode", m, "--precision", "fp32", startup_timeout=None,
                            name=f"spec-{m}")
           for m in ("always", "off")}
    try:
        for s in srv.values():
            s.wait_healthy(600)
        yield {m: openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=300)
               for m, s in srv.items()}
    finally:
        for s in srv.values():
            rc = s.terminate()
            s.close()
            assert rc == 0


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
    spec, plain = _greedy(servers["always"]), _greedy(servers["off"])
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
