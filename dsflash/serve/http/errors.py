"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``, and the handlers
that turn every failure (bad JSON, wrong types, unknown routes, engine errors) into one."""
from __future__ import annotations

import logging
import re
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("dsflash.serve.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_FIELD_RE = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_][A-Za-z0-9_.\[\]]*)\s*:\s*(.*)$", re.S)


def value_error_to_api(e: Exception, default_param: Optional[str] = None, rename: Optional[dict] = None) -> APIError:
    """``ValueError("field: message")`` / ``"SamplingParams.field: message"`` -> 400 naming ``field``."""
    msg = str(e) or type(e).__name__
    m = _FIELD_RE.match(msg)
    param = default_param
    if m:
        param = m.group(1)
        if rename and param in rename:
            param = rename[param]
        msg = f"{param}: {m.group(2)}"
    code = "context_length_exceeded" if ("max_model_len" in msg or "context length" in msg) else None
    return APIError(400, msg, param=param, code=code)


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _loc_to_param(loc) -> Optional[str]:
    parts = [p for p in loc if p != "body"]
    # drop the tagged-union member names pydantic inserts (e.g. 'str', 'list[int]', 'function-after[...]')
    out = []
    for p in parts:
        if isinstance(p, int):
            out.append(f"[{p}]")
        elif isinstance(p, str) and p not in _UNION_TAGS and (p[:1].islower() or p[:1] == "_") \
                and not any(c in p for c in "[]-,"):
            out.append(("." if out else "") + p)
    s = "".join(out)
    return s or None


def validation_error_to_api(errors: list) -> APIError:
    if not errors:
        return APIError(400, "invalid request body")
    e = errors[0]
    if e.get("type") == "json_invalid":
        ctx = e.get("ctx") or {}
        return APIError(400, f"Malformed JSON in request body: {ctx.get('error', e.get('msg'))}",
                        code="invalid_json")
    param = _loc_to_param(e.get("loc", ()))
    msg = e.get("msg", "invalid value")
    if e.get("type") == "missing":
        msg = f"'{param}' is a required property" if param else "a required property is missing"
    elif param:
        got = e.get("input")
        shown = repr(got)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = f"{param}: {msg} (got {shown})"
    if e.get("type") in ("model_type", "dict_type") and not param:
        msg = "request body must be a JSON object"
    n = len(errors)
    if n > 1:
        msg += f" (and {n - 1} more problem{'s' if n > 2 else ''})"
    return APIError(400, msg, param=param, code="invalid_value" if e.get("type") != "missing" else "missing")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error_to_api(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _pyd_validation(request: Request, exc: ValidationError):
        return validation_error_to_api(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        if status == 404:
            msg = f"Unknown endpoint {request.method} {request.url.path}"
        elif status == 405:
            msg = f"Method {request.method} not allowed for {request.url.path}"
        else:
            msg = str(exc.detail)
        return APIError(status, msg).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
