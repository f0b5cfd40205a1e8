"""vLLM-compatible utility endpoints: ``/ping``, ``/version``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``.

Shapes follow vLLM's server so that clients written for it (lm-eval's remote tokenizer probes
``/tokenizer_info`` and then tokenises through ``/tokenize``) work unchanged:
* ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
* ``POST /detokenize`` ``{"tokens": [int]}`` -> ``{"prompt": str}``.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import StrictBool, StrictInt, StrictStr, ValidationError

from dsflash.serve.http import chat_io
from dsflash.serve.http.errors import APIError, validation_error_to_api, value_error_to_api
from dsflash.serve.http.body import parse_json_object
from dsflash.serve.http.encode import encode_chat_prompt, encode_prompts, encode_text
from dsflash.serve.http.protocol import ChatMessage, ToolDef, _Base


class TokenizeRequest(_Base):
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[StrictBool] = None      # prompt: BOS (default true); chat: the template has it
    add_generation_prompt: Optional[StrictBool] = True
    return_token_strs: Optional[StrictBool] = False
    tools: Optional[list[ToolDef]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[Union[StrictStr, StrictInt]] = None
    thinking: Optional[Union[StrictBool, dict[str, Any]]] = None


class DetokenizeRequest(_Base):
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


def _version() -> str:
    """The installed distribution's version (the package face, ``dsflash.__version__``, is above this floor)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("dsflash")
    except PackageNotFoundError:
        return "unknown"


async def _parse(request: Request, model):
    obj = parse_json_object(await request.body())
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error_to_api(list(e.errors())) from None


def install_extras(app, st) -> None:
    def _check_model(st, model):
        if model is not None and model != st.model:
            raise APIError(404, f"The model '{model}' does not exist (this server serves '{st.model}')",
                           param="model", code="model_not_found")

    def need_tokenizer():
        if st.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="model")
        return st.tokenizer

    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])
    async def ping():
        ok = st.engine.is_running and not st.engine.is_draining
        return JSONResponse({} if ok else {"status": "unavailable"}, status_code=200 if ok else 503)

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version():
        return {"version": _version()}

    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def tokenizer_info():
        tok = need_tokenizer()

        def name(tid):
            return tok.id_to_token(tid) if tid is not None else None
        bos, eos, pad = tok.bos_id, tok.eos_id, tok.pad_id
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": st.max_model_len,
                "vocab_size": tok.vocab_size, "bos_token": name(bos), "bos_token_id": bos,
                "eos_token": name(eos), "eos_token_id": eos, "pad_token": name(pad), "pad_token_id": pad,
                "add_bos_token": True, "add_eos_token": False}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse(request, TokenizeRequest)
        _check_model(st, req.model)
        tok = need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: send exactly one of 'prompt' or 'messages'", param="prompt")
        if req.prompt is not None:
            bos = req.add_special_tokens is not False
            ids = (await st.offload(encode_prompts, tok, [req.prompt]))[0] if bos else \
                await st.offload(encode_text, tok, req.prompt)
        else:
            chat = chat_io.chat_module()
            thinking, effort = chat_io.resolve_thinking(req)
            messages = chat_io.to_chat_messages(req.messages)
            tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools] if req.tools else None

            def render():
                return encode_chat_prompt(chat, tok, messages, st.special_tokens_in_content, tools=tools,
                                          thinking=thinking, reasoning_effort=effort,
                                          add_generation_prompt=req.add_generation_prompt is not False)
            try:
                ids = await st.offload(render)
            except ValueError as e:
                raise value_error_to_api(e, default_param="messages") from None
        strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _parse(request, DetokenizeRequest)
        _check_model(st, req.model)
        tok = need_tokenizer()
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} out of range [0, {tok.vocab_size})", param="tokens")
        return {"prompt": await st.offload(tok.decode, req.tokens)}
