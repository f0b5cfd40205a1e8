"""Malformed / edge-case request bodies generated from the server's pydantic request models (issue 21's
schema fuzz). Each field gets values chosen from its annotation (wrong types, huge and negative numbers,
empty and huge strings, bad unicode, nested junk) plus random multi-field mutations, dropped required
fields, unknown fields and non-object bodies. Deterministic for a seed.

A case is ``(path, body_bytes, label)``; bodies are JSON text (``NaN`` and lone-surrogate escapes included on
purpose), so some are invalid JSON by design."""
from __future__ import annotations

import json
import random
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

# lengths the fuzz must not turn into long generations: ints in this range become 2
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "logprobs", "top_logprobs")

JUNK: list[Any] = [
    None, True, False, 0, -1, 1, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -(2 ** 63) - 1, 10 ** 400, 1e308, -1e308, 0.5,
    -0.0, float("nan"), float("inf"), "", " ", "x" * 5000, "\u0000", "\ud800", "\udfff lone", "😀\u202e\ufeff",
    "<｜end▁of▁sentence｜>", [], [None], [[[]]], {}, {"a": [1, {"b": None}]}, {"": ""}, [1, "a", None, {}],
]
INTS = [0, -1, 1, 2, -(2 ** 31), 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 64), 10 ** 30]
FLOATS = [0.0, -1.0, 1e-300, 1e308, -1e308, 2.5, -0.0, float("nan"), float("inf"), float("-inf")]
STRS = ["", " ", "a", "x" * 20000, "\u0000\u0001", "\ud800", "\udc00x", "é😀", "<｜User｜>", "null", "{}", "[", "\\"]


def _strip_optional(ann):
    if get_origin(ann) in (Union, types.UnionType):
        args = [a for a in get_args(ann) if a is not type(None)]
        return args
    return [ann]


def _base(a):
    """Plain type behind pydantic's Strict* aliases (Annotated[int, Strict()])."""
    if get_origin(a) is typing.Annotated:
        return get_args(a)[0]
    return a


def valid_value(ann, rng: random.Random, depth: int = 0) -> Any:
    alts = _strip_optional(ann)
    a = _base(rng.choice(alts))
    o = get_origin(a)
    if o is Literal:
        return rng.choice(get_args(a))
    if o is list:
        return [valid_value(get_args(a)[0], rng, depth + 1)] if depth < 4 else []
    if o is dict:
        return {"k": "v"}
    if isinstance(a, type) and issubclass(a, BaseModel):
        return valid_object(a, rng, depth + 1)
    return {int: 1, float: 0.5, str: "hi", bool: True}.get(a, "x") if a is not Any else "any"


def valid_object(model: type[BaseModel], rng: random.Random, depth: int = 0) -> dict:
    out = {}
    for name, f in model.model_fields.items():
        if f.is_required():
            out[f.alias or name] = valid_value(f.annotation, rng, depth)
    if model.__name__ == "ChatMessage":
        out["content"] = "hi"
    return out


def junk_value(ann, rng: random.Random, depth: int = 0) -> Any:
    """An edge-case value for a field of annotation ``ann``: mostly type-aware, sometimes anything."""
    if rng.random() < 0.3:
        return rng.choice(JUNK)
    a = _base(rng.choice(_strip_optional(ann)))
    o = get_origin(a)
    if o is Literal:
        return rng.choice([*get_args(a), "", "FUNCTION", 1, None, [get_args(a)[0]]])
    if o is list:
        inner = get_args(a)[0]
        return rng.choice([[], [junk_value(inner, rng, depth + 1)],
                           [valid_value(inner, rng, depth + 1), junk_value(inner, rng, depth + 1)],
                           [valid_value(inner, rng, depth + 1)] * rng.choice([2, 50, 300]), {"0": 1}])
    if o is dict:
        return rng.choice([{}, {"": None}, {"x" * 300: [[]]}, {"k": junk_value(Any, rng, depth + 1)}, [], "{}"])
    if isinstance(a, type) and issubclass(a, BaseModel):
        if depth > 3:
            return rng.choice(JUNK)
        obj = valid_object(a, rng, depth + 1)
        fields = list(a.model_fields.items())
        if fields:
            name, f = rng.choice(fields)
            obj[f.alias or name] = junk_value(f.annotation, rng, depth + 1)
        if rng.random() < 0.2:
            obj[rng.choice(["zzz", "", "__proto__"])] = rng.choice(JUNK)
        return obj
    if a is bool:
        return rng.choice([0, 1, "true", "false", None, "yes"])
    if a is int:
        return rng.choice(INTS + [1.0, "1", True, 1.5])
    if a is float:
        return rng.choice(FLOATS + [1, "0.5", True, 10 ** 400])
    if a is str:
        return rng.choice(STRS + [1, True, ["a"], {"text": "a"}])
    return rng.choice(JUNK)


def _tame(body: dict, path: str, max_model_len: int) -> dict:
    """Keep generations short: lengths in [3, max_model_len] become 2; a chat without a length gets one."""
    for k in LENGTH_FIELDS:
        v = body.get(k)
        if type(v) is int and 3 <= v <= max_model_len:
            body[k] = 2
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 2
    return body


def _dump(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()      # ensure_ascii: lone surrogates travel as \\udXXX escapes


RAW_BODIES = [b"", b"null", b"[]", b"1", b'"x"', b"{", b'{"a":}', b"\xff\xfe", b'{"prompt": "\xff"}',
              b'{"messages": [' * 3000, b"{}" * 3, b'{"prompt": "a", "prompt": 1}', b'{"prompt": 1e999999}']


def generate(endpoints: dict[str, tuple[type[BaseModel], dict]], seed: int = 21, per_field: int = 3,
             random_cases: int = 40, max_model_len: int = 2048) -> list[tuple[str, bytes, str]]:
    """``endpoints``: path -> (request model, a valid base body). Returns the cases, deterministic for ``seed``."""
    rng = random.Random(seed)
    cases = []
    for path, (model, base) in endpoints.items():
        fields = list(model.model_fields.items())
        for name, f in fields:                                    # one field at a time
            key = f.alias or name
            for _ in range(per_field):
                body = dict(base)
                body[key] = junk_value(f.annotation, rng)
                cases.append((path, _dump(_tame(body, path, max_model_len)), f"{key}"))
            if key in base and f.is_required():                    # a required field missing
                cases.append((path, _dump({k: v for k, v in base.items() if k != key}), f"missing {key}"))
        for i in range(random_cases):                              # several fields at once, unknown fields
            body = dict(base)
            for name, f in rng.sample(fields, k=min(len(fields), rng.randint(2, 6))):
                body[f.alias or name] = junk_value(f.annotation, rng)
            if rng.random() < 0.3:
                body[rng.choice(["unknown_field", "x" * 100, "", "ÿ"])] = rng.choice(JUNK)
            cases.append((path, _dump(_tame(body, path, max_model_len)), f"random {i}"))
        for raw in RAW_BODIES:
            cases.append((path, raw, f"raw {raw[:20]!r}"))
    return cases
