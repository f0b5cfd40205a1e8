"""The FastAPI application: OpenAI-compatible endpoints over an :class:`AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` SSE),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. See ``docs/server.md``.
"""
from __future__ import annotations

import asyncio
import contextlib
import concurrent.futures
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from dsflash.serve.async_engine import (AsyncEngine, EngineDeadError, EngineDrainingError, RequestAbortedError,
                                       RequestStream)
from dsflash.serve.http import chat_io, structured
from dsflash.serve.http.body import DEFAULT_MAX_BODY_BYTES, BodyTooLarge, parse_json_object, read_limited
from dsflash.serve.http.encode import encode_chat_prompt, encode_prompts
from dsflash.serve.http.extras import install_extras
from dsflash.serve.http.errors import (APIError, error_body, install_error_handlers, validation_error_to_api,
                                        value_error_to_api)
from dsflash.serve.http.metrics import RequestTimer, ServerMetrics
from dsflash.serve.http.protocol import ChatCompletionRequest, CompletionRequest
from dsflash.serve.types import EngineRequest, RequestOutput, SamplingParams

log = logging.getLogger("dsflash.serve.http")

_GEN_PATHS = ("/v1/completions", "/v1/chat/completions")


class ServerState:
    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: Optional[str],
                 disconnect_poll_s: float = 0.25, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 tokenizer_threads: int = 2, special_tokens_in_content: str = "control"):
        self.engine = engine
        self.special_tokens_in_content = special_tokens_in_content
        tok = getattr(engine, "tokenizer", None)
        if special_tokens_in_content == "text" and hasattr(tok, "encode_batch_as_text"):
            tok.encode_batch_as_text([""])       # build the as-text twin now, not in the first chat request
        self.model = served_model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.metrics, served_model_name)
        self.disconnect_poll_s = disconnect_poll_s
        self.max_body_bytes = int(max_body_bytes)
        # tokenising / chat rendering run here, not on the event loop: a huge prompt must not stall other
        # streams or /health (the tokenizer's batch call releases the GIL)
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, tokenizer_threads), thread_name_prefix="dsflash-tok")
        # echo + logprobs: prompt scoring, one at a time (a forward of its own; see prompt_logprobs.py)
        self.score_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsflash-score")

    async def offload(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def build_app(engine: AsyncEngine, served_model_name: str, api_key: Optional[str] = None, *,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tokenizer_threads: int = 2,
              special_tokens_in_content: str = "control") -> FastAPI:
    app = FastAPI(title="dsflash", version="0.1.0",
                  description="OpenAI-compatible server for DeepSeek-V4.1-Flash (dsflash)")
    st = ServerState(engine, served_model_name, api_key, max_body_bytes=max_body_bytes,
                     tokenizer_threads=tokenizer_threads, special_tokens_in_content=special_tokens_in_content)
    app.state.server = st
    install_error_handlers(app)

    app.add_middleware(_AuthAndCount, st=st)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not st.engine.is_running:
            return JSONResponse({"status": "error", "error": repr(st.engine.error)}, status_code=503)
        if st.engine.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "model": st.model}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        st.metrics.engine_in_flight.set(st.engine.num_in_flight)
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [_model_card(st)]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != st.model:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return _model_card(st)

    # Bodies are parsed here rather than by FastAPI so that JSON is accepted whatever the
    # Content-Type and every parse/validation failure becomes the same OpenAI-style 400.
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await _completions(st, await _parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await _chat(st, await _parse_body(request, ChatCompletionRequest), request)

    install_extras(app, st)        # /ping, /version, /tokenize, /detokenize, /tokenizer_info
    return app


_OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")      # probes and scrapers: no API key
_KNOWN_PATHS = _GEN_PATHS + ("/v1/models",) + _OPEN_PATHS + ("/tokenize", "/detokenize", "/tokenizer_info")
REQUEST_ID_HEADER = "x-request-id"


def _endpoint_label(path: str) -> str:
    if path in _KNOWN_PATHS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


def _request_id(scope) -> bytes:
    """The client's ``x-request-id`` if it is a short printable token (echoed only, never an engine id), else new."""
    for k, v in scope.get("headers", []):
        if k == REQUEST_ID_HEADER.encode() and 0 < len(v) <= 128 and all(0x21 <= c <= 0x7E for c in v):
            return bytes(v)
    return uuid.uuid4().hex.encode()


class _AuthAndCount:
    """Pure ASGI middleware, outermost (keeps disconnect detection and stream cancellation intact), in this
    order: the bearer-token check when an API key is set (401 before any validation of the request), the body
    read with the size limit (413 as soon as it is exceeded; a body under it is buffered once and replayed), the ``x-request-id`` response
    header, and request counting by endpoint and status."""

    def __init__(self, app, st: ServerState):
        self.app = app
        self.st = st

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.st
        path = scope.get("path", "")
        label = _endpoint_label(path)
        rid = _request_id(scope)
        status = {"code": 500}

        async def send_counting(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": list(message.get("headers", [])) + [(REQUEST_ID_HEADER.encode(), rid)]}
            await send(message)

        async def refuse(err: APIError):
            await err.response()(scope, receive, send_counting)

        try:
            if st.api_key and path not in _OPEN_PATHS and not path.startswith("/pd/"):
                auth = ""
                for k, v in scope.get("headers", []):
                    if k == b"authorization":
                        auth = v.decode("latin-1")
                token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
                if not token or not hmac.compare_digest(token.encode(), st.api_key.encode()):
                    msg = ("Missing API key (send 'Authorization: Bearer <key>')" if not token
                           else "Incorrect API key provided")
                    return await refuse(APIError(401, msg, code="invalid_api_key"))
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                clen = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
                if clen is not None and clen.strip().isdigit() and int(clen) > st.max_body_bytes:
                    return await refuse(BodyTooLarge(st.max_body_bytes))
                try:
                    body, early = await read_limited(receive, st.max_body_bytes)
                except BodyTooLarge as e:
                    return await refuse(e)
                receive = _replay(body, early, receive)
            await self.app(scope, receive, send_counting)
        finally:
            st.metrics.requests.labels(endpoint=label, status=str(status["code"])).inc()


def _replay(body: bytes, early, receive):
    """An ASGI ``receive`` that returns the already-read body once, then defers to the real one."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            if early is not None:
                return early
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again


class _GuardedStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine requests however it ends (finished, client gone before
    the first chunk, cancellation): the body generator alone cannot promise that, since a generator
    that never started runs no ``finally``."""

    def __init__(self, gen, streams: list[RequestStream]):
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
            with contextlib.suppress(BaseException):
                await self._gen.aclose()


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _parse_body(request: Request, model):
    obj = parse_json_object(await request.body())      # size-limited by the middleware; depth-limited here
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error_to_api(list(e.errors())) from None


def _model_card(st: ServerState) -> dict:
    return {"id": st.model, "object": "model", "created": st.created, "owned_by": "dsflash",
            "root": st.model, "max_model_len": st.max_model_len}


# ====================================================================== shared helpers
def _check_model(st: ServerState, model: Optional[str]) -> None:
    if model is not None and model != st.model:
        raise APIError(404, f"The model '{model}' does not exist (this server serves '{st.model}')",
                       param="model", code="model_not_found")


def _warn_unknown(req) -> None:
    extra = req.unknown_fields()
    if extra:
        log.info("ignoring unknown request fields: %s", ", ".join(extra))


# request fields that map one-to-one onto SamplingParams; one the request leaves out (None) keeps the
# SamplingParams default (the one home of sampling defaults)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "include_stop_str_in_output", "skip_special_tokens")


def _sampling_params(req, max_tokens: int, logprobs: Optional[int], vocab_size: int = 0) -> SamplingParams:
    if req.logit_bias:
        raise APIError(400, "logit_bias: not supported by this server", param="logit_bias")
    if req.min_tokens:
        raise APIError(400, "min_tokens: not supported by this server", param="min_tokens")
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    kw: dict[str, Any] = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
    kw.update(max_tokens=max_tokens, n=1, logprobs=logprobs, stop=list(stop or []),
              stop_token_ids=list(req.stop_token_ids or []))
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:   # the sampler keys on 64 bits: no silent wrap
        raise APIError(400, f"seed: must be an integer in [0, 2**63), got {req.seed}", param="seed")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
    if req.n is None or not 1 <= req.n <= 128:
        raise APIError(400, f"n: must be an integer in [1, 128], got {req.n!r}", param="n")
    if vocab_size and kw.get("top_k", 0) >= vocab_size:     # >= vocab size is the same as off
        kw["top_k"] = 0
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise value_error_to_api(e) from None


def _max_tokens(st: ServerState, requested: Optional[int], prompt_len: int, param: str, what: str) -> int:
    mml = st.max_model_len
    if prompt_len == 0:
        raise APIError(400, f"{what}: the prompt is empty", param=what)
    if prompt_len >= mml:
        verb = "have" if what == "messages" else "has"     # "your messages have", "your prompt has"
        raise APIError(400, f"This model's maximum context length is {mml} tokens. However, your {what} "
                            f"{verb} {prompt_len} tokens, leaving no room for a completion.",
                       param=what, code="context_length_exceeded")
    if requested is None:
        return mml - prompt_len
    if requested < 1:
        raise APIError(400, f"{param}: must be an integer >= 1, got {requested}", param=param)
    if prompt_len + requested > mml:
        raise APIError(400, f"This model's maximum context length is {mml} tokens. However, you requested "
                            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the "
                            f"completion). Please reduce the length of the {what} or {param}.",
                       param=param, code="context_length_exceeded")
    return requested


SEED_LIMIT = 1 << 63
COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions (also when "max_tokens": null)


DP_RANK_HEADER = "X-data-parallel-rank"


def _dp_rank(st: ServerState, request: Request) -> Optional[int]:
    """SERVING §3 pinning: the ``X-data-parallel-rank`` header -> the engine's ``dp_rank`` (None: the
    engine's load balancer picks). Not an integer in ``[0, DP size)``: 400 naming the header."""
    raw = request.headers.get(DP_RANK_HEADER)
    if raw is None:
        return None
    D = int(getattr(getattr(st.engine, "engine", None), "dp", 1) or 1)
    try:
        r = int(raw.strip())
    except ValueError:
        r = None
    if r is None or not 0 <= r < D:
        raise APIError(400, f"{DP_RANK_HEADER}: must be an integer DP rank in [0, {D}), got {raw!r}",
                       param=DP_RANK_HEADER)
    return r


async def _submit(st: ServerState, base_id: str, prompts: list[list[int]], params: SamplingParams,
                  n: int, arrival: Optional[float] = None, dp_rank: Optional[int] = None,
                  kv_transfer_params: Optional[dict] = None) -> list[RequestStream]:
    """n engine requests per prompt (seeds seed+i), submitted together as request envelopes. All or nothing.
    ``dp_rank`` pins them to a DP rank."""
    items = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            sp = params if n == 1 or params.seed is None else params.replace(seed=params.seed + i)
            items.append(EngineRequest(f"{base_id}-{p}-{i}", list(ids), sp, dp_rank=dp_rank,
                                       kv_transfer_params=kv_transfer_params))
    try:
        streams = await st.engine.add_requests(items, arrival_time=arrival)
    except ValueError as e:
        raise value_error_to_api(e, default_param="prompt") from None
    except EngineDrainingError as e:
        raise APIError(503, str(e), code="server_shutting_down") from None
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from None
    st.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    return streams


async def _merge(st: ServerState, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come: ``(index, cumulative output)``. Leaving early
    (client gone, cancellation) aborts every unfinished request."""
    timers = [RequestTimer(st.metrics, s.arrival) for s in streams]
    tasks = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
    st.metrics.in_flight.inc()
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=lambda t: tasks[t]):
                i = tasks.pop(t)
                out = t.result()
                timers[i].update(out)
                if not out.finished:
                    tasks[asyncio.ensure_future(streams[i].get())] = i
                yield i, out
    finally:
        st.metrics.in_flight.dec()
        for t in tasks:
            t.cancel()
        for s in streams:
            if not s.finished:
                st.metrics.aborted.inc()
                s.abort()


async def _collect(st: ServerState, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream to finish; if the client disconnects first, abort them all."""
    finals: list[Optional[RequestOutput]] = [None] * len(streams)

    async def run():
        async with contextlib.aclosing(_merge(st, streams)) as it:
            async for i, out in it:
                finals[i] = out

    task = asyncio.ensure_future(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=st.disconnect_poll_s)
            if done:
                try:
                    task.result()
                except RequestAbortedError as e:     # the drain deadline passed (SIGTERM)
                    raise APIError(503, str(e), code="server_shutting_down") from None
                return finals  # type: ignore[return-value]
            if await request.is_disconnected():
                log.info("client disconnected; aborting %d request(s)", len(streams))
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise APIError(499, "client disconnected")
    except BaseException:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        raise


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, lasts=None, n: int = 1) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if lasts:
        # prefix-cache hits of each prompt, from its first copy (the prompt is counted once)
        cached = sum(int(getattr(o.metrics, "num_cached_tokens", 0) or 0)
                     for o in lasts[::n] if o is not None and o.metrics is not None)
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def _stream_error_event(e: BaseException) -> str:
    if isinstance(e, APIError):
        return _sse(e.body())
    return _sse(error_body(f"generation failed: {type(e).__name__}: {e}", "internal_server_error"))


def _streaming_response(gen, streams: list[RequestStream]) -> StreamingResponse:
    return _GuardedStreamingResponse(gen, streams)


async def _sse_stream(st: ServerState, streams: list[RequestStream], step, *, head=(), what: str, obj: str,
                      base: str, created: int, prompt_tokens: int, n: int, include_usage: bool):
    """The SSE body both streaming endpoints share: ``head`` (events before the first output), then
    ``step(idx, out)``'s events for each engine output, then the usage chunk (``include_usage``), an error
    event if generation failed, and always ``[DONE]``."""
    done_tokens = [0] * len(streams)
    lasts: list = [None] * len(streams)
    try:
        async with contextlib.aclosing(_merge(st, streams)) as it:
            for ev in head:
                yield ev
            async for idx, out in it:
                done_tokens[idx] = len(out.outputs[0].token_ids)
                lasts[idx] = out
                for ev in step(idx, out):
                    yield ev
        if include_usage:
            yield _sse({"id": base, "object": obj, "created": created, "model": st.model, "choices": [],
                        "usage": _usage(prompt_tokens, sum(done_tokens), lasts, n)})
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - never leave a stream hanging
        if isinstance(e, RequestAbortedError):
            log.warning("%s stream aborted: %s", what, e)
        else:
            log.exception("%s stream failed", what)
        # every unfinished choice gets its finish_reason, then the error event says why
        for idx, last in enumerate(lasts):
            if last is None or not last.finished:
                ch = ({"index": idx, "delta": {}, "logprobs": None, "finish_reason": "abort"} if obj.startswith("chat")
                      else {"index": idx, "text": "", "logprobs": None, "finish_reason": "abort"})
                yield _sse({"id": base, "object": obj, "created": created, "model": st.model, "choices": [ch]})
        yield _stream_error_event(e)
    yield "data: [DONE]\n\n"


def _stop_reason(v):
    """``stop_reason`` as JSON can carry it (a stop string, a stop token id, or None)."""
    return v if isinstance(v, (str, int, type(None))) else str(v)


def _tok_str(tok, tid: int) -> str:
    if tok is None:
        return f"<{tid}>"
    try:
        return tok.token_bytes(tid).decode("utf-8", errors="replace")
    except Exception:  # noqa: BLE001
        return tok.decode([tid])


def _decode(tok, ids) -> str:
    return tok.decode(ids) if tok is not None else ""


def _tok_bytes(tok, tid: int) -> list[int]:
    try:
        return list(tok.token_bytes(tid))
    except Exception:  # noqa: BLE001
        return list(_tok_str(tok, tid).encode("utf-8"))


# ====================================================================== /v1/completions
async def _completions(st: ServerState, req: CompletionRequest, request: Request):
    arrival = time.time()
    _check_model(st, req.model)
    dp_rank = _dp_rank(st, request)
    _warn_unknown(req)
    if req.suffix:
        raise APIError(400, "suffix: not supported by this model", param="suffix")
    n = req.n if req.n is not None else 1
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, f"logprobs: must be an integer in [0, 20], got {req.logprobs}", param="logprobs")
    tok = st.tokenizer
    with_ids = tok is None or bool(req.return_token_ids)     # without a tokenizer the ids are the only output
    # normalise prompts -> token ids (text prompts get BOS, as the DeepSeek tokenizer adds it)
    raw = req.prompt
    if isinstance(raw, str):
        raw_list: list = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        raw_list = [raw]
    else:
        raw_list = list(raw)
    if not raw_list:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    prompts: list = []
    texts: list[Optional[str]] = []
    for j, p in enumerate(raw_list):
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
            prompts.append(None)
            texts.append(p)
        else:
            V = tok.vocab_size if tok is not None else None
            bad = [t for t in p if t < 0 or (V is not None and t >= V)]
            if bad:
                raise APIError(400, f"prompt: token id {bad[0]} out of range [0, {V})", param="prompt")
            prompts.append(list(p))
            texts.append(None)
    todo = [t for t in texts if t is not None]
    if todo:
        encoded = iter(await st.offload(encode_prompts, tok, todo))
        prompts = [next(encoded) if p is None else p for p in prompts]
    requested = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS  # null = default
    max_toks = [_max_tokens(st, requested, len(p), "max_tokens", "prompt") for p in prompts]
    params0 = _sampling_params(req, max_toks[0], req.logprobs, tok.vocab_size if tok is not None else 0)
    params0 = structured.attach(params0, req)   # response_format / guided_* / structured_outputs (400 naming the field)
    prompt_lps = None
    if req.echo and req.logprobs is not None:     # the prompt tokens' logprobs too (log-likelihood evaluation)
        from dsflash.serve.http.prompt_logprobs import prompt_logprobs
        loop = asyncio.get_running_loop()
        try:
            prompt_lps = [await loop.run_in_executor(st.score_pool, prompt_logprobs, st.engine.engine, p,
                                                     req.logprobs) for p in prompts]
        except NotImplementedError as e:
            raise APIError(400, f"echo: with logprobs needs prompt logprobs, which {e}", param="echo") from None
    base = f"cmpl-{uuid.uuid4().hex}"
    if len(set(max_toks)) == 1:
        streams = await _submit(st, base, prompts, params0, n, arrival, dp_rank, req.kv_transfer_params)
    else:  # max_tokens omitted and prompts of different lengths: each gets the rest of its context
        streams = []
        try:
            for j, (p, mt) in enumerate(zip(prompts, max_toks)):
                streams += await _submit(st, f"{base}-{j}", [p], params0.replace(max_tokens=mt), n, arrival,
                                         dp_rank, req.kv_transfer_params)
        except BaseException:
            for s in streams:
                s.abort()
            raise
    created = int(time.time())
    echo_texts = [(t if t is not None else _decode(tok, p)) if req.echo else "" for t, p in zip(texts, prompts)]
    prompt_tokens = sum(len(p) for p in prompts)

    def logprob_lists(entries, ids, off: int) -> dict:
        toks, lps, tops, offs = [], [], [], []
        for tid, e in zip(ids, entries):
            s = _tok_str(tok, tid)
            toks.append(s)
            lps.append(None if e is None else e["logprob"])
            top = (e or {}).get("top") or {}
            tops.append({_tok_str(tok, t): lp for t, lp in sorted(top.items(), key=lambda kv: -kv[1])[:req.logprobs]}
                        if req.logprobs > 0 and e is not None else None)
            offs.append(off)
            off += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def choice_logprobs(out, start: int, text_offset0: int) -> Optional[dict]:
        c = out.outputs[0]
        if req.logprobs is None or c.logprobs is None:
            return None
        entries = c.logprobs[start:]
        return logprob_lists(entries, [e["token_id"] for e in entries], text_offset0)

    def echo_logprobs(idx: int, gen: Optional[dict] = None) -> Optional[dict]:
        """The prompt's entries (first None), then the generated ones' (``gen``), as one logprobs object."""
        if prompt_lps is None:
            return gen
        p = idx // n
        lp = logprob_lists(prompt_lps[p], prompts[p], 0)
        end = sum(len(t) for t in lp["tokens"])        # offsets run over the token strings (BOS included)
        for key in lp:
            lp[key] += (gen or {}).get(key, [])
        if gen:
            lp["text_offset"][len(prompts[p]):] = [o - len(echo_texts[p]) + end for o in gen["text_offset"]]
        return lp

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)

        sent_text = [0] * len(streams)
        sent_lp = [0] * len(streams)        # tokens of each choice already streamed (logprobs and token_ids)
        offsets = [0] * len(streams)

        def echo():
            if req.echo:
                for idx in range(len(streams)):
                    et = echo_texts[idx // n]
                    offsets[idx] = len(et)
                    if prompt_lps is not None:     # generated offsets follow the prompt's token strings
                        offsets[idx] = sum(len(_tok_str(tok, t)) for t in prompts[idx // n])
                    yield _sse({"id": base, "object": "text_completion", "created": created,
                                "model": st.model, "choices": [{"index": idx, "text": et,
                                                                "logprobs": echo_logprobs(idx),
                                                                "finish_reason": None}]})

        def step(idx, out):
            c = out.outputs[0]
            delta = c.text[sent_text[idx]:]
            lp = choice_logprobs(out, sent_lp[idx], offsets[idx])
            new_ids = list(c.token_ids[sent_lp[idx]:]) if with_ids else []
            sent_lp[idx] = len(c.token_ids)
            if not delta and not out.finished and not (lp and lp["tokens"]) and not new_ids:
                return
            sent_text[idx] = len(c.text)
            offsets[idx] += len(delta)
            choice = {"index": idx, "text": delta, "logprobs": lp,
                      "finish_reason": c.finish_reason if out.finished else None}
            if with_ids:
                choice["token_ids"] = new_ids
            chunk = {"id": base, "object": "text_completion", "created": created, "model": st.model,
                     "choices": [choice]}
            if include_usage:  # continuous_usage_stats: cumulative counts of this choice (as vLLM)
                chunk["usage"] = _usage(len(prompts[idx // n]), len(c.token_ids)) if continuous else None
            yield _sse(chunk)

        gen = _sse_stream(st, streams, step, head=echo(), what="completion", obj="text_completion", base=base,
                          created=created, prompt_tokens=prompt_tokens, n=n, include_usage=include_usage)
        return _streaming_response(gen, streams)

    finals = await _collect(st, request, streams)
    choices = []
    completion_tokens = 0
    for idx, out in enumerate(finals):
        c = out.outputs[0]
        completion_tokens += len(c.token_ids)
        et = echo_texts[idx // n]
        choices.append({"index": idx, "text": et + c.text,
                        "logprobs": echo_logprobs(idx, choice_logprobs(out, 0, len(et))),
                        "finish_reason": c.finish_reason, "stop_reason": _stop_reason(c.stop_reason)})
        if with_ids:
            choices[-1]["token_ids"] = list(c.token_ids)
    return {"id": base, "object": "text_completion", "created": created, "model": st.model,
            "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, finals, n)}


# ====================================================================== /v1/chat/completions
async def _chat(st: ServerState, req: ChatCompletionRequest, request: Request):
    arrival = time.time()
    _check_model(st, req.model)
    dp_rank = _dp_rank(st, request)
    _warn_unknown(req)
    chat = chat_io.chat_module()
    tok = st.tokenizer
    if tok is None:
        raise APIError(400, "messages: this model has no tokenizer, so chat is unavailable; use /v1/completions "
                            "with token ids", param="messages")
    n = req.n if req.n is not None else 1
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs: must be an integer in [0, 20], got {req.top_logprobs}",
                           param="top_logprobs")
        if not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    if req.continue_final_message:
        raise APIError(400, "continue_final_message: not supported", param="continue_final_message")
    thinking, effort = chat_io.resolve_thinking(req)
    tools, parse_tools = chat_io.select_tools(req)
    messages = chat_io.to_chat_messages(req.messages)

    def render() -> list[int]:      # in the pool: rendering and tokenising a huge conversation is slow
        return encode_chat_prompt(chat, tok, messages, st.special_tokens_in_content, tools=tools,
                                  thinking=thinking, reasoning_effort=effort,
                                  add_generation_prompt=req.add_generation_prompt is not False,
                                  response_format=chat_io.response_format_arg(req.response_format))
    try:
        ids = await st.offload(render)
    except ValueError as e:  # encode_chat names the field ("messages[2].content: ...")
        raise value_error_to_api(e, default_param="messages") from None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_toks = _max_tokens(st, requested, len(ids), param, "messages")
    params = _sampling_params(req, max_toks, (req.top_logprobs or 0) if req.logprobs else None, tok.vocab_size)
    params = structured.attach(params, req, thinking=thinking, tools=tools)   # response_format, tool_choice, ...
    base = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await _submit(st, base, [ids], params, n, arrival, dp_rank, req.kv_transfer_params)
    created = int(time.time())
    prompt_tokens = len(ids)

    def chat_logprobs(out, start: int) -> Optional[dict]:
        c = out.outputs[0]
        if not req.logprobs or c.logprobs is None:
            return None
        content = []
        k = req.top_logprobs or 0
        for e in c.logprobs[start:]:
            tid = e["token_id"]
            top = sorted((e.get("top") or {}).items(), key=lambda kv: -kv[1])[:k]
            content.append({"token": _tok_str(tok, tid), "logprob": e["logprob"], "bytes": _tok_bytes(tok, tid),
                            "top_logprobs": [{"token": _tok_str(tok, t), "logprob": lp, "bytes": _tok_bytes(tok, t)}
                                             for t, lp in top]})
        return {"content": content}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        streamers = [chat_io.ChatStreamer(thinking, parse_tools) for _ in streams]
        done = [0] * len(streams)    # completion tokens of each choice so far (continuous_usage_stats)

        def chunk(idx, delta, finish=None, logprobs=None):
            c = {"id": base, "object": "chat.completion.chunk", "created": created, "model": st.model,
                 "choices": [{"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:  # continuous_usage_stats: cumulative counts of this choice (as vLLM)
                c["usage"] = _usage(prompt_tokens, done[idx]) if continuous else None
            return _sse(c)

        sent_text = [0] * len(streams)
        sent_lp = [0] * len(streams)

        def step(idx, out):
            c = out.outputs[0]
            done[idx] = len(c.token_ids)
            text_delta = c.text[sent_text[idx]:]
            sent_text[idx] = len(c.text)
            lp = chat_logprobs(out, sent_lp[idx])
            sent_lp[idx] = len(c.token_ids)
            deltas = streamers[idx].feed(text_delta)
            if out.finished:
                deltas += streamers[idx].finish()
            first = True
            for d in deltas:
                yield chunk(idx, d, logprobs=lp if first else None)
                first = False
            if first and lp and lp["content"]:
                yield chunk(idx, {}, logprobs=lp)
            if out.finished:
                fr = c.finish_reason
                if fr == "stop" and streamers[idx].n_tool_calls:
                    fr = "tool_calls"
                yield chunk(idx, {}, finish=fr)

        roles = (chunk(idx, {"role": "assistant", "content": ""}) for idx in range(len(streams)))
        gen = _sse_stream(st, streams, step, head=roles, what="chat", obj="chat.completion.chunk", base=base,
                          created=created, prompt_tokens=prompt_tokens, n=n, include_usage=include_usage)
        return _streaming_response(gen, streams)

    finals = await _collect(st, request, streams)
    choices = []
    completion_tokens = 0
    for idx, out in enumerate(finals):
        c = out.outputs[0]
        completion_tokens += len(c.token_ids)
        msg = chat_io.parse_full(c.text, thinking, parse_tools)
        fr = c.finish_reason
        if fr == "stop" and msg.get("tool_calls"):
            fr = "tool_calls"
        choices.append({"index": idx, "message": msg, "logprobs": chat_logprobs(out, 0), "finish_reason": fr,
                        "stop_reason": _stop_reason(c.stop_reason)})
    return {"id": base, "object": "chat.completion", "created": created, "model": st.model,
            "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, finals, n)}
