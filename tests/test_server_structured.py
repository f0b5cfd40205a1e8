"""Structured output through the real server (``python -m dsflash.serve``, the built-in demo model) and the
official ``openai`` client: ``response_format`` json_schema / json_object, vLLM's ``structured_outputs`` and
``guided_*`` fields, ``tool_choice`` required / named through the DSML grammar, streamed and not, over seeds;
bad constraints are 400s naming their field."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from test_server_util import default_test_model, error_of, start_server

MODEL = default_test_model()
pytestmark = pytest.mark.skipif(MODEL == "dummy", reason="the dummy engine does not run grammars")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
WEATHER = {"type": "object", "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "units": {"type": "string", "enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "maxLength": 8}}}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def server():
    # the default server of tests/test_server_openai.py (its compiled programs come from the run's shared persistent
    # cache when a module before this one started it: test_server_util.start_server)
    srv = start_server(*([] if MODEL == "demo" else ["--model", MODEL]))
    yield srv
    rc = srv.terminate()
    out = srv.output()
    srv.close()
    assert rc == 0, out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


def _stream_chat(client, **kw):
    text, calls, finish = "", {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                c["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


def _model(client):
    return client.models.list().data[0].id


def _concurrently(fn, cases):
    """``fn(case)`` for every case at once (one thread each) and the results in case order. The server decodes
    them in one continuous batch (its decode program is compiled for ``--max-num-seqs`` 16 rows, so one request
    costs a decode step as much as six): the same requests and checks as one after another, in about the time
    of the slowest; each request's seed fixes its own sampling whatever shares its batch
    (tests/test_engine_model.py::test_real_model_seed_independent_of_batch). An exception re-raises here."""
    with ThreadPoolExecutor(len(cases)) as ex:
        return list(ex.map(fn, cases))


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate_over_seeds(client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    m = _model(client)

    def ask(seed):
        kw = dict(model=m, messages=[{"role": "user", "content": "Describe a thing as JSON."}],
                  response_format=rf, max_tokens=96, temperature=1.0, seed=seed)
        if stream:
            text, _, finish = _stream_chat(client, **kw)
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        return text, finish

    for seed, (text, finish) in zip(SEEDS, _concurrently(ask, SEEDS), strict=True):
        assert finish == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_vllm_fields(client):
    m = _model(client)
    r = client.chat.completions.create(model=m, messages=MSG, response_format={"type": "json_object"},
                                       max_tokens=160, temperature=0)
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:                                   # a long object cut by max_tokens is still a JSON prefix
        assert c.finish_reason == "length" and c.message.content.startswith("{")
    r = client.chat.completions.create(model=m, messages=MSG, max_tokens=20, temperature=1.0, seed=5,
                                       extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert r.choices[0].message.content in ("sunny", "rainy", "cloudy")
    r = client.completions.create(model=m, prompt="The answer is", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{2,4}"}})
    assert re.fullmatch("[0-9]{2,4}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=m, prompt="x", max_tokens=30, temperature=0,
                                  extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=m, prompt="x", max_tokens=10, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")


def test_max_tokens_cut_is_length(client):
    r = client.chat.completions.create(model=_model(client), messages=MSG, max_tokens=3, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "t", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def _check_calls(calls, allowed):
    assert calls
    for c in calls:
        assert c["name"] in allowed
        args = json.loads(c["arguments"])
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == c["name"])
        jsonschema.validate(args, schema)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_are_enforced(client, stream):
    m = _model(client)
    cases = [(choice, allowed, seed)
             for choice, allowed in [("required", {"get_weather", "get_time"}),
                                     ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})]
             for seed in SEEDS[:3]]

    def ask(case):
        choice, _, seed = case
        kw = dict(model=m, messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=1.0,
                  seed=seed, parallel_tool_calls=False)
        if stream:
            return _stream_chat(client, **kw)
        r = client.chat.completions.create(**kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in msg.tool_calls or []]
        return msg.content or "", calls, finish

    for (choice, allowed, seed), (text, calls, finish) in zip(cases, _concurrently(ask, cases), strict=True):
        assert finish == "tool_calls", (choice, seed, text, calls)
        assert "DSML" not in text
        _check_calls(calls, allowed)
        assert len(calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions_response_format_over_seeds(client, stream):
    """``response_format`` on /v1/completions is enforced too (a raw prompt: nothing is rendered into it)."""
    m = _model(client)
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}

    def ask(seed):
        kw = dict(model=m, prompt=f"Item {seed}:", max_tokens=96, temperature=1.0, seed=seed,
                  extra_body={"response_format": rf})
        if not stream:
            c = client.completions.create(**kw).choices[0]
            return c.text, c.finish_reason
        text, finish = "", None
        for ch in client.completions.create(stream=True, **kw):
            if ch.choices:
                text, finish = text + (ch.choices[0].text or ""), ch.choices[0].finish_reason or finish
        return text, finish

    for seed, (text, finish) in zip(SEEDS, _concurrently(ask, SEEDS), strict=True):
        assert finish == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    r = client.completions.create(model=m, prompt="x", max_tokens=120, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    c = r.choices[0]
    assert isinstance(json.loads(c.text), dict) if c.finish_reason == "stop" else c.text.startswith("{")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_completions_bad_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs.bogus"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param
