"""Schema fuzz of every POST endpoint (issue 21): a few hundred generated malformed / edge-case bodies
(``tests/fuzz_requests.py``, from the request models' fields, fixed seed) against the real server process with
the built-in default model. No response may be 5xx (or a dropped connection); every 4xx has the OpenAI error
shape; the server is healthy afterwards. Generations are kept to 2 tokens."""
from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest

from fuzz_requests import generate
from test_server_util import default_test_model, start_server

from dsflash.serve.http.extras import DetokenizeRequest, TokenizeRequest
from dsflash.serve.http.protocol import ChatCompletionRequest, CompletionRequest, _Base

MODEL = default_test_model()
MSG = [{"role": "user", "content": "hi"}]
ENDPOINTS = {
    "/v1/completions": (CompletionRequest, {"prompt": "hello", "max_tokens": 2}),
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": MSG, "max_tokens": 2}),
    "/tokenize": (TokenizeRequest, {"prompt": "hello"}),
    "/detokenize": (DetokenizeRequest, {"tokens": [5, 6]}),
    "/ping": (_Base, {}),
}


@pytest.fixture(scope="module")
def server():
    srv = start_server(*([] if MODEL == "demo" else ["--model", MODEL]))
    yield srv
    srv.close()


def _is_openai_error(r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict)
            and set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
            and bool(err["message"]) and isinstance(err["type"], str))


def test_schema_fuzz_no_5xx(server):
    cases = generate(ENDPOINTS, seed=21)
    assert len(cases) >= 300
    bad, statuses = [], collections.Counter()

    async def one(ac, sem, path, body, label):
        async with sem:
            try:
                async with ac.stream("POST", server.base + path, content=body,
                                     headers={"content-type": "application/json"}) as r:
                    await r.aread()                      # streams too: read to the end
            except httpx.HTTPError as e:
                bad.append((path, label, f"{type(e).__name__}: {e}", body[:300]))
                return
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                bad.append((path, label, f"{r.status_code} {r.text[:300]}", body[:300]))
            elif r.status_code >= 400 and not _is_openai_error(r):
                bad.append((path, label, f"{r.status_code} not an OpenAI error: {r.text[:300]}", body[:300]))

    async def main():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=60) as ac:
            await asyncio.gather(*(one(ac, sem, *c) for c in cases))

    t0 = time.time()
    asyncio.run(main())
    print(f"\n[fuzz] {len(cases)} requests in {time.time() - t0:.1f}s: {dict(sorted(statuses.items()))}")
    assert not bad, "\n".join(map(str, bad[:20])) + f"\n({len(bad)} bad of {len(cases)})"
    assert statuses[200] >= 20                    # the fuzz also ran real generations
    assert httpx.get(server.base + "/health", timeout=10).json()["status"] == "ok"
