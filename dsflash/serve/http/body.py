"""Request bodies before anything trusts them: a size limit enforced while reading (413), a JSON nesting limit
checked before any recursive parser runs, and lone UTF-16 surrogates (valid JSON, ``"\\ud800"``, but not
encodable text) refused with a 400 naming the field instead of crashing the tokenizer.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

import numpy as np

from dsflash.serve.http.errors import APIError

DEFAULT_MAX_BODY_BYTES = 32 << 20      # V4.1's 1M-token context is ~4 MB of text, ~8 MB as token-id JSON
MAX_JSON_DEPTH = 64                    # deepest legitimate body (a JSON schema in tools) is far below this

# A JSON string, unrolled so that the regex engine never backtracks or recurses on a long string.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than this server's limit of {limit} bytes "
                              f"(--max-request-body-bytes)", code="request_too_large")


def json_depth(raw: bytes) -> int:
    """Deepest ``[``/``{`` nesting of ``raw`` outside strings (C regexes plus one numpy scan; no recursion)."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", raw))
    if not brackets:
        return 0
    a = np.frombuffer(brackets, np.uint8)
    step = np.where((a == ord("[")) | (a == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(step).max())


def _surrogate_path(obj: Any, path: str) -> Optional[str]:
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = _surrogate_path(k, path) or _surrogate_path(v, f"{path}.{k}" if path else str(k))
            if p:
                return p
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            p = _surrogate_path(v, f"{path}[{i}]")
            if p:
                return p
    return None


def parse_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """``raw`` -> a dict, or an ``APIError`` 400 (empty, malformed, too deep, not an object, lone surrogate)."""
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    depth = json_depth(raw)
    if depth > max_depth:
        raise APIError(400, f"request body: JSON nested {depth} levels deep; the limit is {max_depth}",
                       code="invalid_json")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"Malformed JSON in request body: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):          # only a \u escape can carry one (the bytes themselves are UTF-8)
        where = _surrogate_path(obj, "")
        if where:
            raise APIError(400, f"{where}: contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                f"escape), which is not valid text", param=where, code="invalid_value")
    return obj


async def read_limited(receive, limit: int) -> tuple[bytes, Optional[dict]]:
    """Read an ASGI request body, stopping as soon as it exceeds ``limit`` bytes (raises ``BodyTooLarge``).
    Returns the body and the non-body message that ended it early (a disconnect), if any."""
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(chunks), msg
        part = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(part)
        if not msg.get("more_body", False):
            return b"".join(chunks), None
