"""Guided decoding (structured output) with the real grammar engine (llguidance): grammars and their errors,
the DSML tool-call grammar against the chat parser, the device mask and the no-draft verifier, and the engine
on the built-in demo model (JSON schema over seeds, regex, choice, a mixed batch, max_tokens, speculative)."""
from __future__ import annotations

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from dsflash import chat
from dsflash.serve.engine import guided as G
from dsflash.serve.engine import sampling as S
from dsflash.serve.types import GuidedDecoding, SamplingParams
from dsflash.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7},
                   "units": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "noargs"}}]


@pytest.fixture(scope="module")
def tok():
    from dsflash.api import SHIPPED   # the built-in demo model's folder
    return Tokenizer.from_folder(SHIPPED["demo"])


def _walk(guide, ids, V):
    """Feed ``ids`` through ``guide``, checking each is allowed by the mask before it."""
    row = np.zeros((G.mask_words(V),), np.int32)
    for t in ids:
        guide.fill(row)
        assert (row[t // 32] >> (t % 32)) & 1, t
        guide.accept(t)


@pytest.mark.parametrize("spec,msg", [
    (GuidedDecoding(regex="a(", field="guided_regex"), "guided_regex: "),
    (GuidedDecoding(json={"type": "nope"}, field="response_format.json_schema.schema"), "response_format"),
    (GuidedDecoding(json="{not json", field="guided_json"), "guided_json: not valid JSON"),
    (GuidedDecoding(grammar="start: foo", field="guided_grammar"), "guided_grammar: "),
    (GuidedDecoding(choice=[], field="guided_choice"), "guided_choice: must be"),
])
def test_bad_constraints_name_their_field(spec, msg):
    with pytest.raises(ValueError, match="^" + msg.replace("(", r"\(")):
        G.validate(spec)


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(guided=GuidedDecoding(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(guided=GuidedDecoding())


def test_gbnf_and_lark_grammars(tok):
    for g in ['root ::= "yes" | "no"', 'start: "yes" | "no"']:
        gd = G.Guide(GuidedDecoding(grammar=g), tok, len(tok))
        _walk(gd, tok.encode("no"), len(tok))
        assert gd.done


def test_tool_grammar_admits_rendered_calls_and_args_validate(tok):
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
             {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1, "units": "c"}},
             {"name": "noargs", "arguments": {}}]
    text = chat.render_tool_calls(calls)
    gd = G.Guide(GuidedDecoding(grammar=G.tool_call_grammar(TOOLS)), tok, len(tok))
    _walk(gd, tok.encode(text), len(tok))
    assert gd.done
    _, content, parsed = chat.parse_output(text, thinking=False)
    assert [json.loads(c["function"]["arguments"]) for c in parsed] == [c["arguments"] for c in calls]
    # one invoke only without parallel calls; a string property may not contain '<'
    one = G.Guide(GuidedDecoding(grammar=G.tool_call_grammar(TOOLS[:1], parallel=False)), tok, len(tok))
    _walk(one, tok.encode(chat.render_tool_calls(calls[:1])), len(tok))
    assert one.done
    bad = G.Guide(GuidedDecoding(grammar=G.tool_call_grammar(TOOLS[:1])), tok, len(tok))
    assert bad.matcher.try_consume_tokens(tok.encode(chat.render_tool_calls(
        [{"name": "get_weather", "arguments": {"city": "a<b", "days": 3}}]))) < len(tok.encode(text))
    with pytest.raises(AssertionError):
        _walk(G.Guide(GuidedDecoding(grammar=G.tool_call_grammar(TOOLS[:1])), tok, len(tok)),
              tok.encode(chat.render_tool_calls([{"name": "get_weather", "arguments": {"city": "x", "days": 9}}])),
              len(tok))


def test_guide_waits_for_the_thinking_block(tok):
    gd = G.Guide(GuidedDecoding(choice=["yes", "no"], after_think=True), tok, len(tok))
    row = np.zeros((G.mask_words(len(tok)),), np.int32)
    for t in tok.encode("free thought"):
        gd.fill(row)
        assert (row == -1).all()            # dormant: everything allowed
        gd.accept(t)
    gd.accept(tok.think_end_id)
    _walk(gd, tok.encode("yes"), len(tok))
    assert gd.done


def test_device_mask_only_touches_guided_rows():
    V, B = 70, 3
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((B, 2, V)).astype(np.float32)
    allowed = rng.random((B, V)) < 0.3
    mask = np.zeros((B, G.mask_words(V)), np.uint32)
    for b, v in zip(*np.nonzero(allowed)):
        mask[b, v // 32] |= np.uint32(1 << (v % 32))
    guided = np.array([True, False, True])
    out = np.asarray(S.apply_token_mask(jnp.asarray(logits), jnp.asarray(mask.view(np.int32)), jnp.asarray(guided)))
    exp = np.where(allowed[:, None, :] | ~guided[:, None, None], logits, -np.inf)
    np.testing.assert_array_equal(out, exp)
    none = S.apply_token_mask(jnp.asarray(logits), jnp.asarray(mask.view(np.int32)), jnp.zeros((B,), bool))
    np.testing.assert_array_equal(np.asarray(none), logits)


def test_no_draft_rows_emit_one_target_token():
    import jax
    B, k, V = 2, 3, 11
    rng = np.random.default_rng(1)
    tl = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((B, k + 1, V)), jnp.float32))
    drafts = jnp.argmax(tl[:, :k], axis=-1).astype(jnp.int32)            # drafts the greedy target accepts
    q = jnp.where(jnp.arange(V) == drafts[..., None], 0.0, -jnp.inf)
    keys = S.request_keys(jnp.arange(B)[:, None], 0, jnp.arange(k + 1)[None])
    for greedy in (True, False):
        g = jnp.full((B,), greedy)
        toks, n = S.rejection_sample(tl, tl, q, drafts, g, S.purpose(keys, S.ACCEPT), S.purpose(keys, S.SAMPLE),
                                     no_draft=jnp.array([True, False]))
        assert int(n[0]) == 1
        if greedy:
            assert int(n[1]) == k + 1 and int(toks[0, 0]) == int(jnp.argmax(tl[0, 0]))


def _allowed(row, t):
    return bool((row[t // 32] >> (t % 32)) & 1)


def test_fill_block_masks_each_draft_position_and_rolls_back(tok):
    V = len(tok)
    ids = tok.encode('{"name":"ab","ok":true,"n":7}')
    gd = G.Guide(GuidedDecoding(json=SCHEMA), tok, V)
    ref = G.Guide(GuidedDecoding(json=SCHEMA), tok, V)
    rows = np.zeros((len(ids) + 1, G.mask_words(V)), np.int32)
    assert gd.fill_block(rows, ids) == ids                     # valid drafts are kept
    one = np.zeros((G.mask_words(V),), np.int32)
    for j, t in enumerate(ids):                                # row j = the mask after ids[:j]
        ref.fill(one)
        np.testing.assert_array_equal(rows[j], one)
        ref.accept(t)
    _walk(gd, ids, V)                                          # the matcher was rolled back: the walk is valid
    assert gd.done


def test_fill_block_repairs_or_ends_at_a_rejected_draft(tok):
    V = len(tok)
    gd = G.Guide(GuidedDecoding(json=SCHEMA), tok, V)
    bad = tok.encode("xyz")
    rows = np.zeros((len(bad) + 1, G.mask_words(V)), np.int32)
    out = gd.fill_block(rows, bad)                 # '{"name":"' is forced: the grammar's tokens replace them
    assert out != bad and tok.decode(out).startswith('{"')
    gd2 = G.Guide(GuidedDecoding(choice=["yes", "yellow"]), tok, V)
    first = tok.encode("ye")[:1]
    rows = np.zeros((3, G.mask_words(V)), np.int32)
    out = gd2.fill_block(rows, first + [tok.eos_id, tok.eos_id])
    assert not _allowed(rows[1], tok.eos_id)       # EOS is rejected and nothing is forced: the block ends there
    assert out[1] == tok.eos_id and (rows[2] == rows[1]).all()
    _walk(gd2, tok.encode("yes"), V)               # untouched by the look-ahead
    assert gd2.done
    think = G.Guide(GuidedDecoding(choice=["yes"], after_think=True), tok, V)    # dormant until </think>
    d = tok.encode("ab") + [tok.think_end_id] + tok.encode("zz")
    rows = np.zeros((len(d) + 1, G.mask_words(V)), np.int32)
    out = think.fill_block(rows, d)
    k = d.index(tok.think_end_id)
    assert (rows[:k + 1] == -1).all() and tok.decode(out[k + 1:]).startswith("y")   # then the grammar, repaired
    assert not think.active


def test_device_mask_per_position():
    V, B, P = 40, 2, 3
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((B, P, V)).astype(np.float32)
    allowed = rng.random((B, P, V)) < 0.4
    mask = np.zeros((B, P, G.mask_words(V)), np.uint32)
    for b, p, v in zip(*np.nonzero(allowed)):
        mask[b, p, v // 32] |= np.uint32(1 << (v % 32))
    guided = np.array([True, False])
    out = np.asarray(S.apply_token_mask(jnp.asarray(logits), jnp.asarray(mask.view(np.int32)), jnp.asarray(guided)))
    np.testing.assert_array_equal(out, np.where(allowed | ~guided[:, None, None], logits, -np.inf))


# ---------------------------------------------------------------------------------------------- the engine
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Give me a JSON object.<｜Assistant｜></think>"


@pytest.fixture(scope="module")
def eng():
    from dsflash.serve.engine.engine import LLMEngine
    return LLMEngine("demo", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128)


def _run(eng, reqs):
    for rid, (p, sp) in reqs.items():
        eng.add_request(rid, p, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return outs


def test_engine_json_schema_over_seeds(eng):
    assert eng.speculative          # the guided rows run beside a drafting engine
    reqs = {"greedy": (PROMPT, SamplingParams(max_tokens=96, temperature=0, guided=GuidedDecoding(json=SCHEMA)))}
    reqs.update({f"s{i}": (PROMPT, SamplingParams(max_tokens=96, temperature=1.0, seed=i,
                                                  guided=GuidedDecoding(json=SCHEMA))) for i in range(6)})
    outs = _run(eng, reqs)
    for rid, c in outs.items():
        assert c.finish_reason == "stop", (rid, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert eng.compiles_after_warmup == 0


def test_engine_regex_choice_json_object(eng):
    outs = _run(eng, {
        "re": (PROMPT, SamplingParams(max_tokens=40, temperature=0.8, seed=3, guided=GuidedDecoding(regex=r"[a-z]{3,8}"))),
        "ch": (PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=4,
                                      guided=GuidedDecoding(choice=["red", "green", "blue"]))),
        "obj": (PROMPT, SamplingParams(max_tokens=200, temperature=0, guided=GuidedDecoding(json_object=True)))})
    import re
    assert re.fullmatch(r"[a-z]{3,8}", outs["re"].text), outs["re"].text
    assert outs["ch"].text in ("red", "green", "blue")
    if outs["obj"].finish_reason == "stop":
        assert isinstance(json.loads(outs["obj"].text), dict)
    else:
        assert outs["obj"].finish_reason == "length" and outs["obj"].text.startswith("{")


def test_engine_mixed_batch_leaves_unconstrained_rows_alone(eng):
    alone = _run(eng, {"u": (PROMPT, SamplingParams(max_tokens=40, temperature=0))})["u"]
    mixed = _run(eng, {"u": (PROMPT, SamplingParams(max_tokens=40, temperature=0)),
                       "g": (PROMPT, SamplingParams(max_tokens=60, temperature=0, guided=GuidedDecoding(json=SCHEMA))),
                       "c": (PROMPT, SamplingParams(max_tokens=10, temperature=0.7, seed=1,
                                                    guided=GuidedDecoding(choice=["yes", "no"])))})
    assert mixed["u"].token_ids == alone.token_ids
    assert mixed["c"].text in ("yes", "no")
    jsonschema.validate(json.loads(mixed["g"].text), SCHEMA)


def test_the_all_zero_mask_stays_on_the_device_and_a_guided_mask_travels(eng, monkeypatch):
    """A call without guided rows sends no token mask (it is most of a call's input bytes): the program gets the
    same device array of zeros call after call, outside the packed buffer; a call with a guided row sends its own
    mask, and the constrained answer still validates, with no compile after warm-up."""
    import jax

    from dsflash.serve.engine.packed import Packed
    sent, place = [], eng.runner.place

    def spy(inp):
        p = place(inp)
        sent.append((bool(np.any(inp["guided"])), np.array(inp["mask"]), p))
        return p
    monkeypatch.setattr(eng.runner, "place", spy)
    outs = _run(eng, {"u": (PROMPT, SamplingParams(max_tokens=12, temperature=0))})
    _run(eng, {"u2": (PROMPT, SamplingParams(max_tokens=12, temperature=0))})
    outs.update(_run(eng, {"g": (PROMPT, SamplingParams(max_tokens=60, temperature=0,
                                                        guided=GuidedDecoding(json=SCHEMA)))}))
    jsonschema.validate(json.loads(outs["g"].text), SCHEMA)
    assert eng.compiles_after_warmup == 0
    zeros = {}
    for guided, mask, p in sent:
        assert isinstance(p, Packed) and set(p.device) == {"mask"}
        keys = jax.tree.unflatten(p.layout[0], [0] * p.layout[0].num_leaves)
        assert "mask" not in keys and "guided" in keys             # the buffer holds the rest, not the mask
        dev = p.device["mask"]
        assert isinstance(dev, jax.Array) and np.array_equal(np.asarray(dev), mask)
        if not guided:
            assert zeros.setdefault(mask.shape, dev) is dev         # one device array per shape, reused
    assert sum(not g for g, _, _ in sent) > len(zeros) and any(g and m.any() for g, m, _ in sent)


def test_engine_max_tokens_cuts_a_constrained_answer(eng):
    c = _run(eng, {"cut": (PROMPT, SamplingParams(max_tokens=4, temperature=0, guided=GuidedDecoding(json=SCHEMA)))})
    assert c["cut"].finish_reason == "length" and len(c["cut"].token_ids) == 4
    assert c["cut"].text.startswith('{"')


def test_engine_rejects_a_bad_grammar_naming_the_field(eng):
    with pytest.raises(ValueError, match="^guided_regex: "):
        eng.add_request("bad", PROMPT, SamplingParams(guided=GuidedDecoding(regex="(", field="guided_regex")))


def test_engine_async_scheduling_keeps_guided_rows_exact(eng_always):
    """With async scheduling a guided row is never dispatched while its previous token is in flight (both
    engines draft every call: a sampled row's tokens depend on whether its call verified drafts)."""
    eng, a = eng_always, _engine("always", async_scheduling=True)
    reqs = {f"s{i}": (PROMPT, SamplingParams(max_tokens=96, temperature=1.0, seed=i,
                                             guided=GuidedDecoding(json=SCHEMA))) for i in range(3)}
    reqs["u"] = (PROMPT, SamplingParams(max_tokens=40, temperature=0))
    outs, ref = _run(a, reqs), _run(eng, reqs)
    for rid in reqs:
        assert outs[rid].token_ids == ref[rid].token_ids, rid      # same seeds: same tokens, sync or async
    for i in range(3):
        jsonschema.validate(json.loads(outs[f"s{i}"].text), SCHEMA)
    assert a.compiles_after_warmup == 0


# ------------------------------------------------------------------- speculative decoding with constrained rows
def _engine(mode, **kw):
    """fp32: at the serving precisions the verify (1 + block rows) and plain (1 row) programs may round a
    near-tie differently, for free rows as for guided ones (docs/engine.md "Adaptive speculation")."""
    from dsflash.serve.engine.engine import LLMEngine
    return LLMEngine("demo", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128, speculative_mode=mode,
                     precision="fp32", **kw)


@pytest.fixture(scope="module")
def eng_off():
    return _engine("off")


@pytest.fixture(scope="module")
def eng_always():
    return _engine("always")


def test_speculative_guided_greedy_equals_plain_and_accepts_drafts(eng_always, eng_off):
    """Drafts verified against the grammar: greedy output under a schema / regex / choice is the same with and
    without speculation, and guided rows do accept drafts (more than one token per verification)."""
    cases = {"json": GuidedDecoding(json=SCHEMA), "obj": GuidedDecoding(json_object=True),
             "re": GuidedDecoding(regex=r"[a-z]{3,8}( [a-z]{2,6}){0,3}"), "ch": GuidedDecoding(choice=["yes", "no"])}
    reqs = {k: (PROMPT, SamplingParams(max_tokens=96, temperature=0, guided=g)) for k, g in cases.items()}
    d0, a0 = eng_always.metrics.spec_num_drafts, eng_always.metrics.spec_num_accepted_tokens
    spec, plain = _run(eng_always, reqs), _run(eng_off, reqs)
    for k in cases:
        assert spec[k].token_ids == plain[k].token_ids, k
    jsonschema.validate(json.loads(spec["json"].text), SCHEMA)
    assert eng_always.metrics.spec_num_drafts > d0
    assert eng_always.metrics.spec_num_accepted_tokens > a0
    assert eng_always.compiles_after_warmup == 0 and eng_off.compiles_after_warmup == 0


def test_speculative_guided_sampled_answers_validate_over_seeds(eng_always):
    reqs = {f"s{i}": (PROMPT, SamplingParams(max_tokens=96, temperature=1.0, seed=i, guided=GuidedDecoding(json=SCHEMA)))
            for i in range(12)}
    reqs["free"] = (PROMPT, SamplingParams(max_tokens=40, temperature=0))
    outs = _run(eng_always, reqs)
    for i in range(12):
        assert outs[f"s{i}"].finish_reason == "stop", outs[f"s{i}"].text
        jsonschema.validate(json.loads(outs[f"s{i}"].text), SCHEMA)
    assert outs["free"].token_ids == _run(eng_always, {"u": reqs["free"]})["u"].token_ids   # batch-mates change nothing
    assert eng_always.compiles_after_warmup == 0
