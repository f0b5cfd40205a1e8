"""Output parsing: reasoning / content / DSML tool calls, complete and streamed."""
import json
import random

import pytest

from dsflash.chat import OutputDelta, StreamingOutputParser, encode_chat, parse_output, render_tool_calls

DSML = "｜DSML｜"
E = "<｜end▁of▁sentence｜>"


def ids(i):
    return f"call_{i}"


def call(name, **params):
    """One V4.1 invoke element; params given as (value, is_string)."""
    lines = [f'<{DSML} invoke name="{name}">']
    for k, (v, is_str) in params.items():
        lines.append(f'<{DSML} parameter name="{k}" string="{"true" if is_str else "false"}">{v}</{DSML} parameter>')
    lines.append(f"</{DSML} invoke>")
    return "\n".join(lines)


def block(*invokes):
    return f"<{DSML} calls>\n" + "\n".join(invokes) + f"\n</{DSML} calls>"


WEATHER_OUT = ("The user wants weather.</think>Let me check.\n\n"
               + block(call("get_weather", city=("Paris", True), days=("3", False)),
                       call("get_time", tz=("Europe/Paris", True)))
               + E)

CASES = [
    # (text, thinking, expected (reasoning, content, [(name, args dict)]))
    ("Hello there!", False, (None, "Hello there!", [])),
    ("Hello there!" + E, False, (None, "Hello there!", [])),
    ("Let me think. 2+2=4.</think>The answer is 4.", True, ("Let me think. 2+2=4.", "The answer is 4.", [])),
    ("<think>dup tag</think>ok", True, ("dup tag", "ok", [])),
    ("still thinking when cut off", True, ("still thinking when cut off", "", [])),
    ("a < b and c <｜ d, \n\n not a tag <｜DSML｜ nope", False,
     (None, "a < b and c <｜ d, \n\n not a tag <｜DSML｜ nope", [])),
    (WEATHER_OUT, True, ("The user wants weather.", "Let me check.",
                         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "Europe/Paris"})])),
    ("\n\n" + block(call("noargs")) + E, False, (None, None, [("noargs", {})])),
    (block(call("f", a=('{"x": [1, 2.5, null, true]}', False), b=("not json", False), c=("123", True),
                d=("false", False), e=("line1\nline2 <b>bold</b>", True))), False,
     (None, None, [("f", {"a": {"x": [1, 2.5, None, True]}, "b": "not json", "c": "123", "d": False,
                          "e": "line1\nline2 <b>bold</b>"})])),
    # text after the block is content; a second block is parsed too
    ("A" + block(call("f", x=("1", False))) + " then B" + block(call("g")), False,
     (None, "A then B", [("f", {"x": 1}), ("g", {})])),
    # V4-style tag spelling is accepted
    ("pre\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"k\" string=\"true\">v"
     "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>", False, (None, "pre", [("f", {"k": "v"})])),
    # everything after EOS is ignored
    ("done" + E + "garbage" + block(call("f")), False, (None, "done", [])),
]


def _check(result, expected):
    reasoning, content, calls = result
    er, ec, ecalls = expected
    assert reasoning == er
    assert content == ec
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == ecalls
    for i, c in enumerate(calls):
        assert c["id"] == f"call_{i}" and c["type"] == "function"
        assert isinstance(c["function"]["arguments"], str)


@pytest.mark.parametrize("text,thinking,expected", CASES)
def test_parse_complete(text, thinking, expected):
    _check(parse_output(text, thinking, make_id=ids), expected)


def _stream(text, thinking, chunks):
    p = StreamingOutputParser(thinking, make_id=ids)
    deltas = [p.feed(c) for c in chunks]
    deltas.append(p.finish())
    return p, deltas


def _aggregate(deltas, thinking):
    agg = OutputDelta()
    for d in deltas:
        agg.extend(d)
    calls = [{k: v for k, v in tc.items() if k != "index"} for tc in agg.tool_calls]
    assert [tc["index"] for tc in agg.tool_calls] == list(range(len(calls)))
    content = agg.content if (agg.content or not calls) else None
    return (agg.reasoning_content if thinking else None), content, calls


@pytest.mark.parametrize("text,thinking,expected", CASES)
def test_streamed_char_by_char_equals_complete(text, thinking, expected):
    p, deltas = _stream(text, thinking, list(text))
    complete = parse_output(text, thinking, make_id=ids)
    assert p.result() == complete
    assert _aggregate(deltas, thinking) == complete
    # no content delta ever carries (part of) a DSML tag of a real block
    if expected[2]:
        for d in deltas:
            assert DSML not in d.content and "<｜" not in d.content


@pytest.mark.parametrize("seed", range(20))
def test_streamed_random_chunks_equals_complete(seed):
    rng = random.Random(seed)
    text, thinking, _ = CASES[rng.randrange(len(CASES))]
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        chunks.append(text[i:i + n])
        i += n
    p, deltas = _stream(text, thinking, chunks)
    assert p.result() == parse_output(text, thinking, make_id=ids)
    assert _aggregate(deltas, thinking) == p.result()


def test_stream_releases_content_promptly():
    p = StreamingOutputParser(False)
    assert p.feed("Hello").content == "Hello"
    assert p.feed(" <").content == ""          # could be the start of a calls tag
    assert p.feed("b>").content == " <b>"      # it was not
    assert p.feed("\n\n").content == ""        # may be the separator before a calls block
    assert p.feed("more").content == "\n\nmore"
    d = p.feed(f"\n\n<{DSML} cal")
    assert d.content == "" and not d.tool_calls
    d = p.feed(f'ls>\n<{DSML} invoke name="f">\n')
    assert not d and not p.tool_calls
    d = p.feed(f'<{DSML} parameter name="x" string="false">7</{DSML} parameter>\n</{DSML} invoke>')
    assert [(c["function"]["name"], c["function"]["arguments"], c["index"]) for c in d.tool_calls] == \
        [("f", '{"x": 7}', 0)]
    assert list(d) == [("tool_call", d.tool_calls[0])]
    p.feed(f"\n</{DSML} calls>")
    assert p.finish().content == ""
    assert p.result()[1] == "Hello <b>\n\nmore"


def test_reasoning_stream_holds_partial_end_tag():
    p = StreamingOutputParser(True)
    assert p.feed("thinking </th").reasoning_content == "thinking "
    d = p.feed("ink>answer")
    assert d.reasoning_content == "" and d.content == "answer"
    assert list(d) == [("content", "answer")]


def test_truncated_inside_a_call_keeps_completed_parameters():
    text = "ok\n\n" + block(call("f", a=("1", False), b=("two", True)))
    cut = text[: text.index('name="b"') + 12]  # stops inside the second parameter
    r, c, calls = parse_output(cut, False, make_id=ids)
    assert c == "ok" and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    _, deltas = _stream(cut, False, list(cut))
    assert _aggregate(deltas, False) == (None, "ok", calls)


def test_round_trip_with_encoder():
    """What the encoder writes for an assistant turn parses back to the same calls."""
    tcs = [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "opts": {"metric": True}}},
           {"name": "ping", "arguments": {}}]
    text = "Sure.\n\n" + render_tool_calls(tcs) + E
    r, c, calls = parse_output(text, False, make_id=ids)
    assert c == "Sure."
    assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == \
        [(t["name"], t["arguments"]) for t in tcs]
    # and an assistant message built from the parse re-encodes to the same text
    msg = {"role": "assistant", "content": c, "tool_calls": calls}
    prompt = encode_chat([{"role": "user", "content": "q"}, msg])
    assert prompt.endswith("</think>" + text)


def test_parser_misuse():
    p = StreamingOutputParser(False)
    p.finish()
    with pytest.raises(ValueError):
        p.feed("x")
    assert not p.finish()
    with pytest.raises(ValueError):
        parse_output(None, False)  # type: ignore[arg-type]


def _merge_incremental(deltas):
    """OpenAI-style tool-call deltas (announce, then argument fragments) -> whole calls by index."""
    calls = {}
    for d in deltas:
        for tc in d.tool_calls:
            c = calls.setdefault(tc["index"], {"id": None, "type": None, "function": {"name": None, "arguments": ""}})
            for k in ("id", "type"):
                if k in tc:
                    assert c[k] is None, "announced twice"
                    c[k] = tc[k]
            fn = tc.get("function", {})
            if "name" in fn:
                c["function"]["name"] = fn["name"]
            c["function"]["arguments"] += fn.get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(12))
def test_incremental_tool_call_deltas_concatenate_to_the_whole_calls(seed):
    rng = random.Random(seed)
    for text, thinking, expected in CASES:
        chunks, i = [], 0
        while i < len(text):
            n = 1 if seed == 0 else rng.randint(1, 9)
            chunks.append(text[i:i + n])
            i += n
        p = StreamingOutputParser(thinking, make_id=ids, incremental=True)
        deltas = [p.feed(c) for c in chunks] + [p.finish()]
        assert p.result() == parse_output(text, thinking, make_id=ids)
        assert _merge_incremental(deltas) == p.result()[2]
        for d in deltas:
            assert not expected[2] or DSML not in d.content


def test_incremental_announces_before_the_call_closes():
    p = StreamingOutputParser(False, incremental=True)
    d = p.feed(f'<{DSML} calls>\n<{DSML} invoke name="f">\n')
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in d.tool_calls] == [(0, "f", "")]
    d = p.feed(f'<{DSML} parameter name="x" string="false">7</{DSML} parameter>\n')
    assert d.tool_calls == [{"index": 0, "function": {"arguments": '{"x": 7'}}]
    d = p.feed(f'<{DSML} parameter name="y" string="true">a"b</{DSML} parameter>\n</{DSML} invoke>')
    assert [c["function"]["arguments"] for c in d.tool_calls] == [', "y": "a\\"b"', "}"]
    assert p.tool_calls[0]["function"]["arguments"] == '{"x": 7, "y": "a\\"b"}'
