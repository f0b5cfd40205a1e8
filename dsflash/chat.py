"""DeepSeek-V4.1 chat encoding (SPEC_V41 §14) and output parsing for the server.

Prompt format (the V4.1 reference encoder's rules, re-implemented):

* ``<｜begin▁of▁sentence｜>`` once, then the messages in order;
* a leading ``<｜System｜>`` segment when the first message is a system message or a reasoning-effort
  prefix is rendered (thinking mode only, default ``high``): ``Reasoning Effort: {b} (range 1-100,
  ...)\\n\\n`` with low/high/max = 50/75/100 or an int in [1, 100];
* tools are rendered into the first system message (one is inserted at the front if there is none)
  as ``\\n\\n## Tools ...`` with one JSON schema per line and the DSML call format;
* user turns ``<｜User｜>{content}``; ``tool`` messages are merged into the following user turn as
  ``<tool_result>…</tool_result>`` blocks (joined by blank lines, in the order of the calls);
* the assistant header ``<｜Assistant｜>`` follows a user turn (or a mid-conversation system
  message) that is last or followed by an assistant turn, with ``<think>`` (thinking mode, at or
  after the last user turn) or ``</think>`` (otherwise);
* assistant turns ``{reasoning</think> if kept}{content}{\\n\\n<DSML tool calls>}<｜end▁of▁sentence｜>``;
  reasoning is kept only after the last user turn unless tools are present (then always kept).

DSML tool calls (V4.1 tag names carry a leading space)::

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

Output side: :class:`StreamingOutputParser` turns generated text (fed in arbitrary pieces) into
reasoning / content / OpenAI tool-call deltas and never lets a partial tag reach the content;
:func:`parse_output` runs the same machine over a whole completion, so streamed and complete
parsing agree by construction.
"""
from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .tokenizer import (ASSISTANT, BOS, EOS, IMAGE, LATEST_REMINDER, SYSTEM, TASK_TOKENS, THINK_END,
                        THINK_START, USER)

DSML = "｜DSML｜"
CALLS_TAG = " calls"
INVOKE_TAG = " invoke"
PARAMETER_TAG = " parameter"
CALLS_OPEN = f"<{DSML}{CALLS_TAG}>"
CALLS_CLOSE = f"</{DSML}{CALLS_TAG}>"

REASONING_EFFORT_LEVELS: dict[str, int] = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
REASONING_EFFORT_TEMPLATE = ("Reasoning Effort: {budget} (range 1-100, the higher the value, "
                             "the more thorough the reasoning)\n\n")
TOOL_RESULT_TEMPLATE = "<tool_result>{content}</tool_result>"
RESPONSE_FORMAT_TEMPLATE = ("## Response Format:\n\n"
                            "You MUST strictly adhere to the following schema to reply:\n{schema}")

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{calls_open}" block like the following:

{calls_open}
<{dsml}{invoke} name="$TOOL_NAME">
<{dsml}{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}{param}>
...
</{dsml}{invoke}>
<{dsml}{invoke} name="$TOOL_NAME2">
...
</{dsml}{invoke}>
{calls_close}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
_IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def _to_json(v: Any) -> str:
    try:
        return json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(v, ensure_ascii=True, default=str)


# ============================================================================ input validation
def _flatten_content(content: Any, where: str, c: Callable[[str], str] = str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}[{j}]: content parts must be objects, got {type(part).__name__}")
            t = part.get("type")
            if t in _TEXT_PART_TYPES:
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise ValueError(f"{where}[{j}].text: must be a string")
                parts.append(text)
            elif t in _IMAGE_PART_TYPES:
                parts.append(c(IMAGE))
            else:
                raise ValueError(f"{where}[{j}].type: unsupported content part type {t!r} "
                                 "(text and image parts only)")
        return "\n\n".join(parts)
    raise ValueError(f"{where}: must be a string, a list of content parts or null, "
                     f"got {type(content).__name__}")


def _check_tool_calls(tcs: Any, where: str) -> list[dict]:
    if not isinstance(tcs, (list, tuple)):
        raise ValueError(f"{where}: must be a list")
    out = []
    for j, tc in enumerate(tcs):
        w = f"{where}[{j}]"
        if not isinstance(tc, Mapping):
            raise ValueError(f"{w}: must be an object")
        fn = tc.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{w}.function: must be an object with 'name' and 'arguments'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{w}.function.name: must be a non-empty string")
        args = fn.get("arguments", "{}")
        if args is None:
            args = "{}"
        if not isinstance(args, (str, Mapping)):
            raise ValueError(f"{w}.function.arguments: must be a JSON string or an object")
        out.append({"id": tc.get("id"), "name": name, "arguments": args})
    return out


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, (list, tuple)):
        raise ValueError("tools: must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ValueError(f"tools[{i}]: must be an object")
        if t.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type: only 'function' tools are supported, got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"tools[{i}].function: must be an object")
        if not isinstance(fn.get("name"), str) or not fn.get("name"):
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        out.append(dict(fn))
    return out


def _normalize(messages: Any, c: Callable[[str], str] = str) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: must be a non-empty list")
    result = []
    for i, m in enumerate(messages):
        w = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{w}: must be an object with a 'role'")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{w}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if role == "developer":  # application instructions are system messages in V4.1
            role = "system"
        msg: dict[str, Any] = {"role": role, "content": _flatten_content(m.get("content"), f"{w}.content", c)}
        if role == "assistant":
            rc = m.get("reasoning_content", m.get("reasoning"))
            if rc is not None and not isinstance(rc, str):
                raise ValueError(f"{w}.reasoning_content: must be a string")
            msg["reasoning_content"] = rc or ""
            if m.get("tool_calls"):
                msg["tool_calls"] = _check_tool_calls(m["tool_calls"], f"{w}.tool_calls")
        elif m.get("tool_calls"):
            raise ValueError(f"{w}.tool_calls: only assistant messages carry tool calls")
        if role == "tool":
            tid = m.get("tool_call_id", "")
            if tid is not None and not isinstance(tid, str):
                raise ValueError(f"{w}.tool_call_id: must be a string")
            msg["tool_call_id"] = tid or ""
        task = m.get("task")
        if task is not None:
            if task not in TASK_TOKENS:
                raise ValueError(f"{w}.task: unknown task {task!r} (expected one of {', '.join(TASK_TOKENS)})")
            msg["task"] = task
        result.append(msg)
    return result


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """No tool role in V4.1: tool results become ``tool_result`` blocks of a user message; a user
    message that follows joins the same turn (the reference's merge rule)."""
    merged: list[dict] = []
    for msg in messages:
        role = msg["role"]
        if role == "tool":
            block = {"type": "tool_result", "id": msg["tool_call_id"], "content": msg["content"]}
            if merged and merged[-1]["role"] == "user" and "blocks" in merged[-1]:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            blocks = [{"type": "text", "text": msg["content"]}]
            if merged and merged[-1]["role"] == "user" and "blocks" in merged[-1] \
                    and merged[-1].get("task") is None:
                merged[-1]["blocks"].extend(blocks)  # (the reference drops a task set here too)
            else:
                new = dict(msg)
                new["blocks"] = blocks
                merged.append(new)
        else:
            merged.append(msg)
    # order tool results like the calls of the preceding assistant turn
    order: dict[str, int] = {}
    for msg in merged:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {tc["id"]: k for k, tc in enumerate(msg["tool_calls"]) if tc.get("id")}
        elif msg["role"] == "user" and "blocks" in msg:
            tr = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(tr) > 1 and order:
                it = iter(sorted(tr, key=lambda b: order.get(b["id"], 0)))
                msg["blocks"] = [next(it) if b["type"] == "tool_result" else b for b in msg["blocks"]]
    return merged


def resolve_reasoning_effort(effort: Any) -> int:
    """``low``/``high``/``max`` -> 50/75/100; an int in [1, 100] as is; None -> default (high)."""
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    if type(effort) is int:
        if 1 <= effort <= 100:
            return effort
        raise ValueError(f"reasoning_effort: integer {effort} outside [1, 100]")
    if isinstance(effort, str) and effort in REASONING_EFFORT_LEVELS:
        return REASONING_EFFORT_LEVELS[effort]
    raise ValueError(f"reasoning_effort: {effort!r} is not one of {', '.join(REASONING_EFFORT_LEVELS)} "
                     "or an integer in [1, 100]")


# ============================================================================ rendering
def render_tools(tools: Sequence[Mapping], c: Callable[[str], str] = str) -> str:
    """The ``## Tools`` section for function schemas (``tool['function']`` dicts); ``c`` marks the
    template's control tokens (see ``encode_chat``'s ``mark_control``)."""
    return TOOLS_TEMPLATE.format(
        calls_open=CALLS_OPEN, calls_close=CALLS_CLOSE, dsml=DSML, invoke=INVOKE_TAG, param=PARAMETER_TAG,
        think_start=c(THINK_START), think_end=c(THINK_END), schemas="\n".join(_to_json(t) for t in tools))


def _arguments_dict(args: Any) -> dict:
    if isinstance(args, Mapping):
        return dict(args)
    val: Any = args
    for _ in range(2):  # tolerate double-encoded JSON strings
        if not isinstance(val, str):
            break
        try:
            val = json.loads(val)
        except ValueError:
            break
    return dict(val) if isinstance(val, Mapping) else {"arguments": args}


def render_tool_calls(tool_calls: Sequence[Mapping]) -> str:
    """A DSML ``calls`` block for ``[{name, arguments}]`` (arguments: dict or JSON string)."""
    invokes = []
    for tc in tool_calls:
        params = []
        for k, v in _arguments_dict(tc["arguments"]).items():
            is_str = isinstance(v, str)
            params.append(f'<{DSML}{PARAMETER_TAG} name="{k}" string="{"true" if is_str else "false"}">'
                          f'{v if is_str else _to_json(v)}</{DSML}{PARAMETER_TAG}>')
        invokes.append(f'<{DSML}{INVOKE_TAG} name="{tc["name"]}">\n' + "\n".join(params)
                       + f"\n</{DSML}{INVOKE_TAG}>")
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def _last_user_index(msgs: list[dict]) -> int:
    for i in range(len(msgs) - 1, -1, -1):
        r = msgs[i]["role"]
        if r == "user" or (r == "system" and i > 0):
            return i
    return -1


def encode_chat(messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, thinking: bool = False,
                reasoning_effort: str | int | None = None, add_generation_prompt: bool = True,
                drop_thinking: bool = True, response_format: Mapping | None = None,
                add_bos: bool = True, mark_control: str | None = None) -> str:
    """Render an OpenAI-style conversation into the V4.1 prompt string.

    ``messages``: dicts with ``role`` in system / developer (= system) / user / assistant / tool /
    latest_reminder; ``content`` a string, a list of text/image parts, or null; assistant
    ``reasoning_content`` (alias ``reasoning``) and OpenAI ``tool_calls``; tool ``tool_call_id``.
    ``tools``: OpenAI function tools. ``thinking``: thinking mode (``<think>`` after the header).
    ``reasoning_effort``: low / high / max / int 1..100 (thinking mode only; default high), or
    ``"none"`` to switch thinking off. ``add_generation_prompt=False`` omits the final assistant
    header. Bad input raises ValueError naming the field.

    ``mark_control``: a string (unguessable, absent from the input) put on both sides of every control
    token the template itself emits, so that ``encode_chat_ids_content_as_text`` can tell them from
    control-token text that came in with the messages or tools.
    """
    def c(tok: str) -> str:
        return f"{mark_control}{tok}{mark_control}" if mark_control else tok

    if reasoning_effort == "none":
        thinking, reasoning_effort = False, None
    effort = resolve_reasoning_effort(reasoning_effort)
    msgs = _normalize(messages, c)
    fn_tools = _check_tools(tools) if tools else []
    if response_format is not None and not isinstance(response_format, Mapping):
        raise ValueError("response_format: must be an object")
    if fn_tools or response_format is not None:
        sys_msg = next((m for m in msgs if m["role"] == "system"), None)
        if sys_msg is None:
            sys_msg = {"role": "system", "content": ""}
            msgs.insert(0, sys_msg)
        if fn_tools:
            sys_msg["tools"] = fn_tools
        if response_format is not None:
            sys_msg["response_format"] = dict(response_format)
    msgs = _merge_tool_messages(msgs)
    # with tools present the reasoning of earlier turns is kept (the reference rule)
    drop = drop_thinking and not fn_tools
    last_user = _last_user_index(msgs)

    out = [c(BOS)] if add_bos else []
    n = len(msgs)
    for i, msg in enumerate(msgs):
        role = msg["role"]
        effort_prefix = REASONING_EFFORT_TEMPLATE.format(budget=effort) if i == 0 and thinking else ""
        p = c(SYSTEM) if i == 0 and (effort_prefix or role == "system") else ""
        p += effort_prefix
        if role == "system":
            if i > 0:
                p += c(SYSTEM)
            p += msg["content"]
            if msg.get("tools"):
                p += "\n\n" + render_tools(msg["tools"], c)
            if msg.get("response_format") is not None:
                p += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_to_json(msg["response_format"]))
        elif role == "user":
            parts = []
            for b in msg["blocks"]:
                if b["type"] == "text":
                    parts.append(b["text"])
                else:
                    parts.append(TOOL_RESULT_TEMPLATE.format(content=b["content"]))
            p += c(USER) + "\n\n".join(parts)
        elif role == "latest_reminder":
            p += c(LATEST_REMINDER) + msg["content"]
        else:  # assistant
            prev_task = i > 0 and msgs[i - 1].get("task") is not None
            think = ""
            if thinking and not prev_task and (not drop or i > last_user):
                think = msg.get("reasoning_content", "") + c(THINK_END)
            calls = "\n\n" + render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
            p += think + msg["content"] + calls + c(EOS)

        # the transition after this message
        nxt = msgs[i + 1]["role"] if i + 1 < n else None
        if nxt is not None and nxt not in ("assistant", "latest_reminder"):
            out.append(p)
            continue
        if nxt is None and not add_generation_prompt:
            out.append(p)
            continue
        task = msg.get("task")
        if task is not None:
            if task != "action":
                p += c(TASK_TOKENS[task])
            else:
                p += c(ASSISTANT) + (c(THINK_START) if thinking else c(THINK_END)) + c(TASK_TOKENS[task])
        elif role == "user" or (role == "system" and i > 0):
            p += c(ASSISTANT)
            if thinking and (not drop or i >= last_user):
                p += c(THINK_START)
            else:
                p += c(THINK_END)
        out.append(p)
    return "".join(out)


def encode_chat_ids(tokenizer, messages: Sequence[Mapping], **kw) -> list[int]:
    """``encode_chat`` then tokenize (special-token text maps to single ids; no extra BOS)."""
    return tokenizer.encode(encode_chat(messages, **kw), add_special_tokens=False)


def encode_chat_ids_content_as_text(tokenizer, messages: Sequence[Mapping], **kw) -> list[int]:
    """Like ``encode_chat_ids``, but only the template's own control tokens become control ids: control-token
    text anywhere in the messages, tools or response format (``<｜end▁of▁sentence｜>``, ``<｜Assistant｜>``,
    ``</think>``, ...) is tokenised as plain text, so it can neither close a turn nor open one. Without such
    text the ids equal ``encode_chat_ids``'s (the tokenizer splits at control tokens either way)."""
    import secrets
    mark = f"\ufdd0{secrets.token_hex(16)}\ufdd1"      # a Unicode noncharacter + 128 random bits
    parts = encode_chat(messages, mark_control=mark, **kw).split(mark)
    texts, controls = parts[0::2], parts[1::2]         # text, control, text, ..., text
    out: list[int] = []
    for k, ids in enumerate(tokenizer.encode_batch_as_text(texts)):
        out += ids
        if k < len(controls):
            tid = tokenizer.token_to_id(controls[k])
            out += [tid] if tid is not None else tokenizer.encode(controls[k])
    return out


# ============================================================================ output parsing
@dataclass
class OutputDelta:
    """One step of streamed output. ``tool_calls`` holds the calls completed in this step, each a
    whole OpenAI streaming tool-call delta ``{"index", "id", "type": "function", "function":
    {"name", "arguments": <JSON object string>}}`` (a call is announced once, when its
    ``invoke`` element closes). Iterating yields ``(kind, payload)`` events: ``("reasoning", str)``,
    ``("content", str)``, ``("tool_call", dict)``."""
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)

    def __iter__(self):
        if self.reasoning_content:
            yield "reasoning", self.reasoning_content
        if self.content:
            yield "content", self.content
        for tc in self.tool_calls:
            yield "tool_call", tc

    def extend(self, other: "OutputDelta") -> None:
        self.reasoning_content += other.reasoning_content
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def default_tool_call_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# Tag dialects accepted inside model output: V4.1 (canonical), V4 and V3.2 spellings.
_OPENERS = {
    f"<{DSML} calls>": (f"</{DSML} calls>", " invoke", " parameter"),
    f"<{DSML}tool_calls>": (f"</{DSML}tool_calls>", "invoke", "parameter"),
    f"<{DSML}function_calls>": (f"</{DSML}function_calls>", "invoke", "parameter"),
}
_ATTR = re.compile(r'\s*([A-Za-z_][\w-]*)\s*=\s*"([^"]*)"')

_REASONING, _CONTENT, _CALLS, _INVOKE, _DONE = range(5)


def _prefix_hold(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class StreamingOutputParser:
    """Feed generated text in any pieces; get :class:`OutputDelta` s back.

    ``thinking=True`` means the prompt ended with ``<think>``: text up to ``</think>`` is reasoning.
    Content is released as soon as it cannot be the start of a DSML ``calls`` tag (or of the
    whitespace that separates content from a calls block); a tool call is emitted whole when its
    ``invoke`` element closes (``string="false"`` values parsed as JSON, invalid JSON kept as a
    string). ``<｜end▁of▁sentence｜>`` in the text ends parsing. Truncated output: ``finish()``
    emits an open call with the parameters completed so far.

    ``incremental=True`` (the server's streaming): a call is announced as soon as its ``invoke`` tag is
    complete (``{index, id, type, function: {name, arguments: ""}}``) and its arguments follow as
    ``{index, function: {arguments: fragment}}`` deltas, one per completed parameter and a last one at the
    close; the fragments of a call concatenate to exactly its final ``arguments``. ``result()`` is the same
    in both modes.
    """

    def __init__(self, thinking: bool, make_id: Callable[[int], str] = default_tool_call_id,
                 incremental: bool = False):
        self.thinking = thinking
        self.incremental = incremental
        self.make_id = make_id
        self._state = _REASONING if thinking else _CONTENT
        self._buf = ""
        self._at_start = True
        self._dialect: tuple[str, str, str] | None = None
        self._cur: dict | None = None     # the call being parsed: id, name, args
        self._ws_hold = ""              # whitespace held before a possible calls block
        self.reasoning_content = ""
        self.content = ""
        self.tool_calls: list[dict] = []  # aggregated OpenAI tool calls
        self.finished = False

    # -- public
    def feed(self, text: str) -> OutputDelta:
        if self.finished:
            raise ValueError("StreamingOutputParser.feed: parser already finished")
        self._buf += text
        return self._run(final=False)

    def finish(self) -> OutputDelta:
        if self.finished:
            return OutputDelta()
        d = self._run(final=True)
        if self._state == _INVOKE:  # truncated inside a call: emit what was completed
            self._close_call(d)
            self._state = _CALLS
        if self._state == _CONTENT and self._ws_hold:
            self._emit_content(d, self._ws_hold)
            self._ws_hold = ""
        self.finished = True
        return d

    def result(self) -> tuple[str | None, str | None, list[dict]]:
        """``(reasoning_content, content, tool_calls)`` so far; content is None when empty and
        tool calls exist; reasoning_content is None outside thinking mode."""
        content: str | None = self.content
        if not content and self.tool_calls:
            content = None
        return (self.reasoning_content if self.thinking else None), content, copy.deepcopy(self.tool_calls)

    # -- emitters
    def _emit_reasoning(self, d: OutputDelta, s: str) -> None:
        if s:
            d.reasoning_content += s
            self.reasoning_content += s

    def _emit_content(self, d: OutputDelta, s: str) -> None:
        if s:
            d.content += s
            self.content += s

    def _close_call(self, d: OutputDelta) -> None:
        cur, self._cur = self._cur, None
        call = {"id": cur["id"], "type": "function",
                "function": {"name": cur["name"], "arguments": _to_json(cur["args"])}}
        self.tool_calls.append(call)
        if not self.incremental:
            d.tool_calls.append({"index": len(self.tool_calls) - 1, **copy.deepcopy(call)})
            return
        full, sent = call["function"]["arguments"], cur["sent"]
        # a repeated parameter that changed an earlier value breaks the prefix: nothing correct can follow
        if full.startswith(sent) and len(full) > len(sent):
            self._fragment(d, full[len(sent):])

    def _fragment(self, d: OutputDelta, text: str) -> None:
        self._cur_sent(text)
        d.tool_calls.append({"index": len(self.tool_calls) - (0 if self._cur is not None else 1),
                             "function": {"arguments": text}})

    def _cur_sent(self, text: str) -> None:
        if self._cur is not None:
            self._cur["sent"] += text

    def _param_done(self, d: OutputDelta, key: str, value: Any) -> None:
        """A parameter completed inside an open call: record it; incremental mode streams its fragment."""
        args = self._cur["args"]
        fresh = key not in args
        args[key] = value
        if self.incremental and fresh:
            sep = "{" if not self._cur["sent"] else ", "
            self._fragment(d, sep + _to_json(key) + ": " + _to_json(value))

    # -- the machine
    def _run(self, final: bool) -> OutputDelta:
        d = OutputDelta()
        while True:
            progressed = False
            if self._state == _REASONING:
                progressed = self._step_reasoning(d, final)
            elif self._state == _CONTENT:
                progressed = self._step_content(d, final)
            elif self._state == _CALLS:
                progressed = self._step_calls(d, final)
            elif self._state == _INVOKE:
                progressed = self._step_invoke(d, final)
            else:  # _DONE: ignore anything after EOS
                self._buf = ""
            if not progressed:
                return d

    def _step_reasoning(self, d: OutputDelta, final: bool) -> bool:
        buf = self._buf
        if self._at_start:
            if len(buf) < len(THINK_START) and THINK_START.startswith(buf) and not final:
                return False
            if buf.startswith(THINK_START):  # a repeated <think> at the very start
                buf = buf[len(THINK_START):]
            self._at_start = False
        ends = [(buf.find(m), m) for m in (THINK_END, EOS) if m in buf]
        if ends:
            i, m = min(ends)
            self._emit_reasoning(d, buf[:i])
            self._buf = buf[i + len(m):]
            self._state = _CONTENT if m == THINK_END else _DONE
            return True
        hold = 0 if final else _prefix_hold(buf, (THINK_END, EOS))
        self._emit_reasoning(d, buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _step_content(self, d: OutputDelta, final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        hits = [(buf.find(m), m) for m in (*_OPENERS, EOS) if m in buf]
        if hits:
            i, m = min(hits)
            head = buf[:i]
            if m == EOS:
                self._emit_content(d, self._ws_hold + head)
                self._ws_hold = ""
                self._buf = ""
                self._state = _DONE
                return True
            # content before a calls block loses its separating whitespace
            stripped = head.rstrip()
            if stripped:
                self._emit_content(d, self._ws_hold + stripped)
            self._ws_hold = ""
            self._dialect = _OPENERS[m]
            self._buf = buf[i + len(m):]
            self._state = _CALLS
            return True
        hold = 0 if final else _prefix_hold(buf, (*_OPENERS, EOS))
        body, tail = buf[: len(buf) - hold], buf[len(buf) - hold:]
        # trailing whitespace may be the separator before a calls block: hold it too
        core = body.rstrip()
        ws = body[len(core):]
        if core:
            self._emit_content(d, self._ws_hold + core)
            self._ws_hold = ""
        self._ws_hold += ws
        self._buf = tail
        return False

    def _skip_stray(self, buf: str, final: bool, *tags: str) -> bool:
        """``buf`` (inside a calls or invoke block) starts with none of ``tags``: wait while it may still
        become one of them, else skip the stray text to the next tag."""
        if not final and any(t.startswith(buf) for t in tags):
            return False  # a tag still arriving
        j = buf.find("<", 1)
        if j < 0:
            self._buf = ""         # nothing here can still become a tag (that case returned above)
            return False
        self._buf = buf[j:]
        return True

    def _step_calls(self, d: OutputDelta, final: bool) -> bool:
        close, invoke, _ = self._dialect
        buf = self._buf = self._buf.lstrip()
        if not buf:
            return False
        if buf.startswith(close):
            self._buf = buf[len(close):]
            self._state = _CONTENT
            return True
        inv = f"<{DSML}{invoke}"
        if buf.startswith(inv):
            j = buf.find(">")
            if j < 0:
                return False
            attrs = dict(_ATTR.findall(buf[len(inv):j]))
            self._buf = buf[j + 1:]
            self._cur = {"id": self.make_id(len(self.tool_calls)), "name": attrs.get("name", ""), "args": {},
                         "sent": ""}
            if self.incremental:
                d.tool_calls.append({"index": len(self.tool_calls), "id": self._cur["id"], "type": "function",
                                     "function": {"name": self._cur["name"], "arguments": ""}})
            self._state = _INVOKE
            return True
        return self._skip_stray(buf, final, inv, close)

    def _step_invoke(self, d: OutputDelta, final: bool) -> bool:
        _, invoke, param = self._dialect
        buf = self._buf = self._buf.lstrip()
        if not buf:
            return False
        inv_close = f"</{DSML}{invoke}>"
        if buf.startswith(inv_close):
            self._close_call(d)
            self._buf = buf[len(inv_close):]
            self._state = _CALLS
            return True
        p_open = f"<{DSML}{param}"
        p_close = f"</{DSML}{param}>"
        if buf.startswith(p_open):
            j = buf.find(">")
            if j < 0:
                return False
            k = buf.find(p_close, j + 1)
            if k < 0:
                return False  # wait for the whole value
            attrs = dict(_ATTR.findall(buf[len(p_open):j]))
            key = attrs.get("name", "")
            raw = buf[j + 1:k]
            value: Any = raw
            if attrs.get("string", "true") == "false":
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = raw
            self._param_done(d, key, value)
            self._buf = buf[k + len(p_close):]
            return True
        return self._skip_stray(buf, final, p_open, inv_close)


def parse_output(text: str, thinking: bool, make_id: Callable[[int], str] = default_tool_call_id
                 ) -> tuple[str | None, str | None, list[dict]]:
    """Parse a complete completion into ``(reasoning_content, content, tool_calls)``; tool calls in
    OpenAI format ``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``."""
    if not isinstance(text, str):
        raise ValueError(f"parse_output: text must be str, got {type(text).__name__}")
    p = StreamingOutputParser(thinking, make_id=make_id)
    p.feed(text)
    p.finish()
    return p.result()
