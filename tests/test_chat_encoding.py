"""V4.1 chat encoding: golden structure for the common conversation shapes."""
import json

import pytest

from dsflash.chat import (CALLS_CLOSE, CALLS_OPEN, encode_chat, encode_chat_ids, render_tool_calls,
                          render_tools, resolve_reasoning_effort)
from dsflash.config import preset
from dsflash.tokenizer import Tokenizer, write_synthetic_tokenizer

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, S = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
TS, TE = "<think>", "</think>"


def effort(b):
    return f"Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_plain_chat():
    assert encode_chat([{"role": "user", "content": "hi"}]) == f"{B}{U}hi{A}{TE}"


def test_plain_thinking_uses_default_effort():
    assert encode_chat([{"role": "user", "content": "hi"}], thinking=True) == f"{B}{S}{effort(75)}{U}hi{A}{TS}"


def test_system_and_multi_turn_chat():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "ignored in chat mode"},
            {"role": "user", "content": "2+2?"}]
    assert encode_chat(msgs) == f"{B}{S}Be brief.{U}hi{A}{TE}Hello!{E}{U}2+2?{A}{TE}"


def test_developer_is_system():
    msgs = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "q"}]
    assert encode_chat(msgs) == f"{B}{S}Rules.{U}q{A}{TE}"


@pytest.mark.parametrize("eff,budget", [("low", 50), ("high", 75), ("max", 100), (None, 75), (30, 30), (1, 1),
                                        (100, 100)])
def test_thinking_with_reasoning_effort_drops_old_reasoning(eff, budget):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "2+2?"}]
    got = encode_chat(msgs, thinking=True, reasoning_effort=eff)
    assert got == f"{B}{S}{effort(budget)}Be brief.{U}hi{A}{TE}Hello!{E}{U}2+2?{A}{TS}"
    assert "old thoughts" not in got


def test_thinking_keeps_reasoning_after_last_user_and_when_not_dropping():
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    got = encode_chat(msgs, thinking=True, reasoning_effort="low")
    assert got == f"{B}{S}{effort(50)}{U}q1{A}{TE}a1{E}{U}q2{A}{TS}r2{TE}a2{E}"
    kept = encode_chat(msgs, thinking=True, reasoning_effort="low", drop_thinking=False)
    assert kept == f"{B}{S}{effort(50)}{U}q1{A}{TS}r1{TE}a1{E}{U}q2{A}{TS}r2{TE}a2{E}"


def test_reasoning_effort_rejected_values():
    for bad in (0, 101, "medium", True, 2.5, "HIGH"):
        with pytest.raises(ValueError, match="reasoning_effort"):
            encode_chat([{"role": "user", "content": "x"}], thinking=True, reasoning_effort=bad)
    assert resolve_reasoning_effort(None) == 75
    # "none" switches thinking off
    assert encode_chat([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="none") == \
        f"{B}{U}x{A}{TE}"


def test_mid_conversation_system_message():
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "system", "content": "Now answer in French."}]
    assert encode_chat(msgs) == f"{B}{U}q1{A}{TE}a1{E}{S}Now answer in French.{A}{TE}"


def test_add_generation_prompt_false():
    assert encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == f"{B}{U}hi"
    # a finished assistant turn never gets a header after it
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert encode_chat(msgs) == f"{B}{U}hi{A}{TE}yo{E}"


def test_content_parts_and_images():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                          {"type": "image_url", "image_url": {"url": "x"}},
                                          {"type": "text", "text": "ok?"}]}]
    assert encode_chat(msgs) == f"{B}{U}look\n\n<｜deepseek_image｜>\n\nok?{A}{TE}"


def _tool_conversation():
    return [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "I need the tool.",
         "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        # results arrive out of order: they are rendered in call order
        {"role": "tool", "tool_call_id": "c2", "content": "Rome: sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "Paris: rain"},
    ]


def test_tools_and_tool_results_golden():
    got = encode_chat(_tool_conversation(), tools=[WEATHER, TIME], thinking=True, reasoning_effort="high")
    calls = (f'{CALLS_OPEN}\n'
             '<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n'
             '<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n'
             f'{CALLS_CLOSE}')
    tools_text = render_tools([WEATHER["function"], TIME["function"]])
    want = (f"{B}{S}{effort(75)}\n\n{tools_text}"
            f"{U}Weather in Paris and Rome?{A}{TS}"
            f"I need the tool.{TE}Let me check.\n\n{calls}{E}"
            f"{U}<tool_result>Paris: rain</tool_result>\n\n<tool_result>Rome: sunny</tool_result>{A}{TS}")
    assert got == want
    # the tool section carries one JSON schema per line and the V4.1 DSML format
    assert "## Tools" in tools_text and "### Available Tool Schemas" in tools_text
    assert json.dumps(WEATHER["function"], ensure_ascii=False) + "\n" + json.dumps(TIME["function"]) in tools_text
    assert '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">' in tools_text


def test_tools_keep_reasoning_of_earlier_turns():
    msgs = _tool_conversation() + [{"role": "assistant", "content": "Paris rain, Rome sun."},
                                   {"role": "user", "content": "Thanks"}]
    with_tools = encode_chat(msgs, tools=[WEATHER], thinking=True)
    assert "I need the tool.</think>" in with_tools
    without = encode_chat(msgs, thinking=True)
    assert "I need the tool." not in without


def test_tools_go_into_existing_system_message():
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}]
    got = encode_chat(msgs, tools=[WEATHER])
    assert got.startswith(f"{B}{S}You are helpful.\n\n## Tools\n\n")
    assert got.endswith(f"{U}hi{A}{TE}")


def test_tool_result_then_user_text_share_a_turn():
    msgs = _tool_conversation()[:3] + [{"role": "user", "content": "And tomorrow?"}]
    got = encode_chat(msgs)
    assert got.endswith(f"{E}{U}<tool_result>Rome: sunny</tool_result>\n\nAnd tomorrow?{A}{TE}")


def test_render_tool_calls_argument_types():
    s = render_tool_calls([{"name": "f", "arguments": {"s": "text", "n": 3, "b": False, "o": {"k": [1, None]},
                                                       "u": "naïve"}}])
    assert '<｜DSML｜ parameter name="s" string="true">text</｜DSML｜ parameter>' in s
    assert '<｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>' in s
    assert '<｜DSML｜ parameter name="b" string="false">false</｜DSML｜ parameter>' in s
    assert '<｜DSML｜ parameter name="o" string="false">{"k": [1, null]}</｜DSML｜ parameter>' in s
    assert '<｜DSML｜ parameter name="u" string="true">naïve</｜DSML｜ parameter>' in s
    # double-encoded JSON and non-object arguments are tolerated like the reference
    assert render_tool_calls([{"name": "f", "arguments": json.dumps(json.dumps({"a": 1}))}]) == \
        render_tool_calls([{"name": "f", "arguments": {"a": 1}}])
    assert 'name="arguments" string="true">[1, 2]<' in render_tool_calls([{"name": "f", "arguments": "[1, 2]"}])


@pytest.mark.parametrize("messages,field", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\]\.role"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    (["just text"], r"messages\[0\]"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"messages\[0\]\.content\[0\]\.type"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}], r"messages\[0\]\.tool_calls"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "reasoning_content": 3}],
     r"messages\[1\]\.reasoning_content"),
    ([{"role": "user", "content": "x", "task": "nope"}], r"messages\[0\]\.task"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(ValueError, match=field):
        encode_chat(messages)


@pytest.mark.parametrize("tools,field", [
    ({"type": "function"}, "tools"),
    ([{"type": "retrieval"}], r"tools\[0\]\.type"),
    (["x"], r"tools\[0\]"),
    ([{"type": "function", "function": {"description": "no name"}}], r"tools\[0\]\.function\.name"),
])
def test_bad_tools_name_the_field(tools, field):
    with pytest.raises(ValueError, match=field):
        encode_chat([{"role": "user", "content": "x"}], tools=tools)


def test_token_ids_on_synthetic_tokenizer(tmp_path):
    tok = Tokenizer.from_folder(write_synthetic_tokenizer(tmp_path, preset("tiny")))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    ids = encode_chat_ids(tok, msgs, thinking=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[1] == tok.system_id
    assert ids.count(tok.user_id) == 2 and ids.count(tok.assistant_id) == 2 and ids.count(tok.eos_id) == 1
    assert ids[-2:] == [tok.assistant_id, tok.think_start_id]
    assert tok.decode(ids) == encode_chat(msgs, thinking=True)


def test_latest_reminder_and_tasks():
    msgs = [{"role": "user", "content": "q"}, {"role": "latest_reminder", "content": "today is Monday"}]
    assert encode_chat(msgs) == f"{B}{U}q{A}{TE}<｜latest_reminder｜>today is Monday"
    assert encode_chat([{"role": "user", "content": "q", "task": "query"}]) == f"{B}{U}q<｜query｜>"
    assert encode_chat([{"role": "user", "content": "q", "task": "action"}]) == f"{B}{U}q{A}{TE}<｜action｜>"
    # an assistant turn answering a task carries no reasoning, even in thinking mode
    msgs = [{"role": "user", "content": "q", "task": "title"}, {"role": "assistant", "content": "Title"}]
    assert encode_chat(msgs, thinking=True, reasoning_effort=60) == f"{B}{S}{effort(60)}{U}q<｜title｜>Title{E}"
