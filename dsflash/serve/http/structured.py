"""Structured-output request fields -> ``SamplingParams.guided`` (docs/server.md "Structured output").

Sources, at most one per request: ``response_format`` json_object / json_schema (chat and completions), vLLM's
``structured_outputs`` {json, regex, choice, grammar, json_object} and the older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and ``tool_choice`` ``"required"`` / a named
function (chat with tools: the DSML tool-call grammar). The constraint is compiled here once, so a bad
schema / regex / grammar is a 400 naming its field before anything reaches the engine.
"""
from __future__ import annotations

from typing import Optional

from dsflash.serve.http.errors import APIError
from dsflash.serve.types import GuidedDecoding, SamplingParams

_GUIDED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _sources(req, tools) -> list[GuidedDecoding]:
    out = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        out.append(GuidedDecoding(json_object=True, field="response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema: required when type is 'json_schema'",
                           param="response_format.json_schema")
        out.append(GuidedDecoding(json=rf.json_schema.schema_, field="response_format.json_schema.schema"))
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.items() if k in _GUIDED_KEYS and v not in (None, False)}
        for k in so:
            if k not in _GUIDED_KEYS and so[k] is not None and not k.startswith("disable_") \
                    and k not in ("backend", "whitespace_pattern"):
                raise APIError(400, f"structured_outputs.{k}: not supported (one of {', '.join(_GUIDED_KEYS)})",
                               param=f"structured_outputs.{k}")
        for k, v in given.items():
            if k == "json_object":
                out.append(GuidedDecoding(json_object=True, field="structured_outputs.json_object"))
            else:
                out.append(GuidedDecoding(**{k: v}, field=f"structured_outputs.{k}"))
    for k in ("json", "regex", "choice", "grammar"):
        v = getattr(req, f"guided_{k}", None)
        if v is not None:
            out.append(GuidedDecoding(**{k: v}, field=f"guided_{k}"))
    choice = getattr(req, "tool_choice", None)
    if tools and (choice == "required" or (choice is not None and not isinstance(choice, str))):
        from dsflash.serve.engine.guided import tool_call_grammar
        out.append(GuidedDecoding(grammar=tool_call_grammar(tools, parallel=req.parallel_tool_calls is not False),
                                  field="tool_choice"))
    return out


def guided_of(req, *, thinking: bool = False, tools: Optional[list[dict]] = None) -> Optional[GuidedDecoding]:
    """The request's one constraint (None: unconstrained); 400 naming the field when it does not compile or
    when two are given. ``thinking``: the constraint starts after ``</think>``. ``tools``: the tools rendered
    for a chat request (the ones ``tool_choice`` may force)."""
    src = _sources(req, tools)
    if not src:
        return None
    if len(src) > 1:
        raise APIError(400, f"{src[1].field}: only one structured-output constraint per request "
                            f"(also given: {src[0].field})", param=src[1].field)
    spec = src[0]
    spec.after_think = bool(thinking)
    from dsflash.serve.engine import guided
    try:
        guided.validate(spec)
    except ValueError as e:
        raise APIError(400, str(e), param=spec.field) from None
    return spec


def attach(params: SamplingParams, req, *, thinking: bool = False, tools=None) -> SamplingParams:
    spec = guided_of(req, thinking=thinking, tools=tools)
    return params if spec is None else params.replace(guided=spec)
