"""Chat glue between the OpenAI request/response shapes and ``dsflash.chat``.

* :func:`to_chat_messages` — OpenAI messages (string or text-part content, assistant ``tool_calls``
  with JSON-string arguments, ``tool`` results) -> the dicts ``encode_chat`` takes;
* :func:`resolve_thinking` — the several ways clients switch thinking on, and ``reasoning_effort``;
* :func:`response_format_arg` — ``response_format`` as rendered by the V4.1 encoding (no
  constrained decoding);
* :func:`select_tools` — ``tools`` / ``tool_choice`` -> tools to render and whether to parse calls;
* :func:`parse_full` / :class:`ChatStreamer` — generated text -> assistant message / ``delta`` dicts.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from dsflash.serve.http.errors import APIError

# V4.1 tiers are low/high/max (= 50/75/100); OpenAI names map onto them (OpenAI's default, medium,
# onto V4.1's default, high).
_EFFORT_ALIASES = {"minimal": "low", "medium": "high", "xhigh": "max"}


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


def resolve_thinking(req) -> tuple[bool, Optional[object]]:
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
        if isinstance(effort, str):
            effort = _EFFORT_ALIASES.get(effort.lower(), effort.lower())
            if effort not in ("none", "low", "high", "max"):
                raise APIError(400, f"reasoning_effort: must be one of none, low, high, max (or OpenAI's minimal, "
                                    f"medium, xhigh), or an integer in [1, 100]; got {req.reasoning_effort!r}",
                               param="reasoning_effort")
        elif not 1 <= effort <= 100:
            raise APIError(400, f"reasoning_effort: integer must be in [1, 100], got {effort}",
                           param="reasoning_effort")
        if effort == "none":
            return (explicit is True), None
    thinking = explicit if explicit is not None else effort is not None
    if not thinking:
        effort = None
    return thinking, effort


def response_format_arg(rf) -> Optional[dict]:
    """``response_format`` for ``encode_chat``: json_object / json_schema are rendered into the
    system prompt by the V4.1 encoding ("## Response Format: You MUST strictly adhere to ...").
    There is no constrained decoding, so the output is requested, not guaranteed, to parse."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
        raise APIError(400, "response_format.json_schema.schema: required when type is 'json_schema'",
                       param="response_format.json_schema")
    return rf.model_dump(exclude_none=True, by_alias=True)


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
def parse_full(text: str, thinking: bool, parse_tools: bool) -> dict:
    """Final assistant message fields from the whole generated text."""
    msg: dict[str, Any] = {"role": "assistant"}
    if not thinking and not parse_tools:
        msg["content"] = text
        return msg
    chat = chat_module()
    reasoning, content, calls = chat.parse_output(text, thinking)
    msg["content"] = content if (content or not calls) else None
    if msg["content"] is None and not calls:
        msg["content"] = ""
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


class ChatStreamer:
    """Successive text deltas of one choice -> OpenAI ``delta`` dicts, via
    ``dsflash.chat.StreamingOutputParser`` (which splits ``</think>``, parses DSML tool calls into
    OpenAI streaming tool-call deltas, and never releases a partial tag as content). Without
    thinking and without tools the text passes through untouched."""

    def __init__(self, thinking: bool, parse_tools: bool):
        self.passthrough = not thinking and not parse_tools
        # incremental: calls announced at their invoke tag, arguments streamed per parameter (OpenAI deltas)
        self.parser = None if self.passthrough else chat_module().StreamingOutputParser(thinking, incremental=True)
        self.n_tool_calls = 0

    def feed(self, delta: str) -> list[dict]:
        if not delta:
            return []
        if self.passthrough:
            return [{"content": delta}]
        return self._convert(self.parser.feed(delta))

    def finish(self) -> list[dict]:
        if self.passthrough:
            return []
        return self._convert(self.parser.finish())

    def _convert(self, d) -> list[dict]:
        out: list[dict] = []
        if d.reasoning_content:
            out.append({"reasoning_content": d.reasoning_content})
        if d.content:
            out.append({"content": d.content})
        if d.tool_calls:
            self.n_tool_calls = max([self.n_tool_calls] + [tc["index"] + 1 for tc in d.tool_calls])
            out.append({"tool_calls": d.tool_calls})
        return out
