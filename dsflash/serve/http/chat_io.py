"""Chat glue between the OpenAI request/response shapes and ``dsflash.chat``.

* :func:`to_chat_messages` — OpenAI messages (string or text-part content, ``developer`` role,
  assistant ``tool_calls`` with JSON-string arguments, ``tool`` results) -> the plain dicts
  ``encode_chat`` takes;
* :func:`resolve_thinking` — the several ways clients switch thinking on;
* :func:`response_format_instruction` — what we do with ``response_format`` (an instruction in the
  system prompt; no constrained decoding);
* :func:`openai_tool_calls` — ``parse_output``'s tool calls -> OpenAI ``tool_calls``;
* :class:`ChatStreamer` — text deltas -> OpenAI ``delta`` dicts via ``StreamingOutputParser``.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterable, Optional

from dsflash.serve.http.errors import APIError

_EFFORTS = ("none", "minimal", "low", "medium", "high", "max", "xhigh")


def chat_module():
    try:
        from dsflash import chat
    except ImportError as e:  # pragma: no cover - only before dsflash.chat exists
        raise APIError(503, f"chat encoding is not available in this build: {e}") from None
    return chat


# ---------------------------------------------------------------------- requests
def _content_text(content, idx: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, p in enumerate(content):
        if p.type != "text" or p.text is None:
            raise APIError(400, f"messages[{idx}].content[{j}]: only text content parts are supported "
                                f"(got type {p.type!r})", param=f"messages[{idx}].content")
        parts.append(p.text)
    return "".join(parts)


def _arguments_str(args) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False)


def to_chat_messages(messages) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": _content_text(m.content, i)}
        if m.name:
            d["name"] = m.name
        if role == "assistant":
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = []
                for k, tc in enumerate(m.tool_calls):
                    args = tc.function.arguments
                    if isinstance(args, str):
                        try:
                            json.loads(args or "{}")
                        except ValueError:
                            raise APIError(400, f"messages[{i}].tool_calls[{k}].function.arguments: "
                                                "must be a JSON object string",
                                           param=f"messages[{i}].tool_calls") from None
                    calls.append({"id": tc.id or f"call_{i}_{k}", "type": "function",
                                  "function": {"name": tc.function.name, "arguments": _arguments_str(args)}})
                d["tool_calls"] = calls
        if role == "tool":
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def resolve_thinking(req) -> tuple[bool, Optional[str]]:
    """(thinking, reasoning_effort). Thinking is on when any of these says so: ``thinking: true`` or
    ``{"type": "enabled"}``, ``chat_template_kwargs: {"thinking": true}`` (or ``enable_thinking``),
    or a ``reasoning_effort`` other than ``"none"``. An explicit off wins over an effort."""
    explicit = None
    t = req.thinking
    if isinstance(t, bool):
        explicit = t
    elif isinstance(t, dict):
        typ = t.get("type")
        if typ not in ("enabled", "disabled"):
            raise APIError(400, "thinking.type: must be 'enabled' or 'disabled'", param="thinking.type")
        explicit = typ == "enabled"
    kw = req.chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if key in kw:
            if not isinstance(kw[key], bool):
                raise APIError(400, f"chat_template_kwargs.{key}: must be a boolean",
                               param=f"chat_template_kwargs.{key}")
            explicit = kw[key] if explicit is None else explicit
    effort = req.reasoning_effort
    if effort is not None:
        effort = effort.lower()
        if effort not in _EFFORTS:
            raise APIError(400, f"reasoning_effort: must be one of {', '.join(_EFFORTS)}; got {req.reasoning_effort!r}",
                           param="reasoning_effort")
        if effort == "none":
            return (explicit is True), None
    thinking = explicit if explicit is not None else effort is not None
    if not thinking:
        effort = None
    return thinking, effort


def response_format_instruction(rf) -> Optional[str]:
    """``response_format`` is honoured by instruction only: the JSON requirement (and the schema) is
    added to the system prompt. There is no constrained decoding, so output is not guaranteed to parse."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return "Respond with a single valid JSON object and nothing else."
    spec = rf.json_schema
    if spec is None or spec.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema: required when type is 'json_schema'",
                       param="response_format.json_schema")
    name = f" named {spec.name!r}" if spec.name else ""
    return ("Respond with a single valid JSON value and nothing else. It must conform to this JSON "
            f"Schema{name}:\n" + json.dumps(spec.schema_, ensure_ascii=False))


def add_system_instruction(messages: list[dict], text: Optional[str]) -> list[dict]:
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first.get("content") or "") + ("\n\n" if first.get("content") else "") + text
        return [first] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def select_tools(req) -> tuple[Optional[list[dict]], bool]:
    """(tools to render, whether to parse tool calls out of the output)."""
    if not req.tools:
        if isinstance(req.tool_choice, str) and req.tool_choice == "required" or \
                (req.tool_choice is not None and not isinstance(req.tool_choice, str)):
            raise APIError(400, "tool_choice: requires 'tools'", param="tool_choice")
        return None, False
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
    choice = req.tool_choice
    if choice == "none":
        return None, False
    if choice is not None and not isinstance(choice, str):
        name = choice.function.name
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise APIError(400, f"tool_choice.function.name: no tool named {name!r} in 'tools'",
                           param="tool_choice")
    return tools, True


# ---------------------------------------------------------------------- responses
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _one_call(tc) -> dict:
    """A parsed tool call in any of the shapes ``parse_output`` may give -> OpenAI ``tool_call``."""
    if hasattr(tc, "__dict__") and not isinstance(tc, dict):
        tc = {k: v for k, v in vars(tc).items() if not k.startswith("_")}
    if "function" in tc and isinstance(tc["function"], dict):
        fn = tc["function"]
        name, args, cid = fn.get("name"), fn.get("arguments", {}), tc.get("id")
    else:
        name, args, cid = tc.get("name"), tc.get("arguments", tc.get("parameters", {})), tc.get("id")
    return {"id": cid or new_call_id(), "type": "function",
            "function": {"name": str(name), "arguments": _arguments_str(args if args is not None else {})}}


def openai_tool_calls(calls: Optional[Iterable]) -> list[dict]:
    return [_one_call(c) for c in (calls or [])]


def parse_full(text: str, thinking: bool, parse_tools: bool) -> dict:
    """Final assistant message fields from the whole generated text."""
    chat = chat_module()
    reasoning, content, calls = chat.parse_output(text, thinking)
    msg: dict[str, Any] = {"role": "assistant", "content": content if content else None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    tool_calls = openai_tool_calls(calls) if parse_tools else []
    if tool_calls:
        msg["tool_calls"] = tool_calls
    elif not parse_tools and calls:
        # tools were not offered (or tool_choice none): nothing to parse into; keep content as parsed
        pass
    if msg["content"] is None and not tool_calls:
        msg["content"] = ""
    return msg


class ChatStreamer:
    """Turns successive text deltas of one choice into OpenAI ``delta`` dicts.

    Uses ``dsflash.chat.StreamingOutputParser`` (which knows the V4.1 ``</think>`` and DSML
    envelopes and holds back partial tags). Its events are normalised from whatever shape they come
    in: objects or dicts with a kind (``reasoning`` / ``content`` / ``tool_call``) and a payload."""

    def __init__(self, thinking: bool, parse_tools: bool):
        chat = chat_module()
        self.parser = _make_parser(chat, thinking)
        self.parse_tools = parse_tools
        self.n_tool_calls = 0

    def feed(self, delta: str) -> list[dict]:
        return self._convert(self.parser.feed(delta)) if delta else []

    def finish(self) -> list[dict]:
        for name in ("finish", "flush", "close"):
            fn = getattr(self.parser, name, None)
            if fn is not None:
                return self._convert(fn())
        return []

    def _convert(self, events) -> list[dict]:
        out: list[dict] = []
        for ev in _iter_events(events):
            kind, payload = ev
            if kind == "reasoning" and payload:
                out.append({"reasoning_content": payload})
            elif kind == "content" and payload:
                out.append({"content": payload})
            elif kind == "tool_call" and payload is not None:
                call = _one_call(payload)
                if self.parse_tools:
                    call["index"] = self.n_tool_calls
                    self.n_tool_calls += 1
                    out.append({"tool_calls": [call]})
                else:  # not asked for tools: fall back to the raw text if the parser kept it
                    raw = payload.get("raw") if isinstance(payload, dict) else getattr(payload, "raw", None)
                    if raw:
                        out.append({"content": raw})
        return out


def _make_parser(chat, thinking: bool):
    cls = chat.StreamingOutputParser
    try:
        return cls(thinking=thinking)
    except TypeError:
        return cls(thinking)


def _iter_events(events):
    if events is None:
        return
    if isinstance(events, (dict, tuple)) or hasattr(events, "kind") or hasattr(events, "type"):
        events = [events]
    for ev in events:
        if isinstance(ev, tuple) and len(ev) == 2:
            yield _norm_kind(ev[0]), ev[1]
            continue
        get = ev.get if isinstance(ev, dict) else (lambda k, d=None, _e=ev: getattr(_e, k, d))
        kind = get("kind") or get("type")
        if kind is None:
            for k in ("reasoning_content", "reasoning", "content", "tool_call"):
                if get(k) is not None:
                    yield _norm_kind(k), get(k)
            continue
        kind = _norm_kind(kind)
        if kind == "tool_call":
            payload = get("tool_call") or get("call") or ev
        else:
            payload = get("text") or get("delta") or get(kind) or get("content") or ""
        yield kind, payload


def _norm_kind(k) -> str:
    k = str(getattr(k, "value", k)).lower()
    if k.startswith("reason") or k == "thinking":
        return "reasoning"
    if "tool" in k:
        return "tool_call"
    return "content"
