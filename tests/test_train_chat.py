"""dsflash.train.chat_data + the SFT stage: conversations from CPython's docs, rendered as the server renders them,
their tool calls parsed back, the loss mask on exactly the assistant's generations, and a few SFT steps end to end."""
import json
import os
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from dsflash.api import SHIPPED
from dsflash.chat import encode_chat, parse_output, render_tool_calls
from dsflash.tokenizer import ASSISTANT, EOS, THINK_END, THINK_START, Tokenizer
from dsflash.train import chat_data, data


@pytest.fixture(scope="module")
def convs():
    return chat_data.conversations()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(SHIPPED["demo"])


def test_builder_is_deterministic_and_split_like_the_corpus(convs):
    again = chat_data.conversations()
    assert again == convs and chat_data.info(again) == chat_data.info(convs)
    # the same in another process: no memory address (an object default's repr in a signature) in the text
    assert not re.search(r" at 0x[0-9a-fA-F]+", json.dumps(convs)), "a signature names a memory address"
    info = chat_data.info(convs)
    n = info["conversations"]
    assert n > 1000 and 0.15 < info["thinking"] / n < 0.35 and 0.12 < info["tool_calls"] / n < 0.28
    assert info["multi_turn"] > 0.04 * n and 0 < info["heldout"] < 0.1 * n
    assert chat_data.conversations(seed=1) != convs
    # the split is the documentation corpus's: an entry is held out iff the document it comes from is
    docs = set(data.corpus_documents())
    entries = {e.name: e for e in chat_data.entries()}
    for c in convs:
        if c["name"].startswith("greeting:"):
            assert not c["heldout"]
            continue
        e = entries[c["name"]]
        assert e.document in docs and c["heldout"] == data.is_heldout(e.document)
    train, held = chat_data.split(convs)
    assert {c["name"] for c in train}.isdisjoint(c["name"] for c in held)


def _expected_targets(c):
    """What the model generates for each supervised assistant turn, built from the messages alone: in thinking mode
    without tools the rendering drops earlier turns' reasoning, so only the last turn is a target there."""
    asst = [m for m in c["messages"] if m["role"] == "assistant"]
    if c["thinking"] and not c["tools"]:
        asst = asst[-1:]
    out = []
    for m in asst:
        t = (m.get("reasoning_content", "") + THINK_END) if c["thinking"] else ""
        t += m["content"] + ("\n\n" + render_tool_calls([tc["function"] for tc in m["tool_calls"]])
                             if m.get("tool_calls") else "")
        out.append((t + EOS, m))
    return out


def test_every_conversation_renders_and_its_tool_calls_parse_into_schema_valid_arguments(convs):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in chat_data.TOOLS}
    n_calls = 0
    for c in convs:
        segs = chat_data.render(c)
        full = encode_chat(c["messages"], tools=c["tools"], thinking=c["thinking"], add_generation_prompt=False)
        assert "".join(t for t, _ in segs) == full
        targets = [t for t, y in segs if y]
        want = _expected_targets(c)
        assert targets == [t for t, _ in want], c["name"]
        for k, (t, y) in enumerate(segs):
            if y:                                    # the prompt before a target is the server's generation prompt
                assert segs[k - 1][0].endswith(ASSISTANT + (THINK_START if c["thinking"] else THINK_END))
        for t, m in want:
            reasoning, content, calls = parse_output(t, thinking=c["thinking"])
            if c["thinking"]:
                assert reasoning == m["reasoning_content"]
            assert (content or "") == m["content"]
            assert [x["function"]["name"] for x in calls] == [x["function"]["name"] for x in m.get("tool_calls", [])]
            for x, orig in zip(calls, m.get("tool_calls", [])):
                args = json.loads(x["function"]["arguments"])
                jsonschema.validate(args, schemas[x["function"]["name"]])
                assert args == json.loads(orig["function"]["arguments"])
                n_calls += 1
    assert n_calls > 500


def test_mask_covers_exactly_the_assistant_generations(convs, tok):
    sample = convs[::7] + [c for c in convs if c["tools"]][:40] + convs[-10:]     # + greetings
    for c in sample:
        ids, mask = chat_data.encode(tok, c)
        segs = chat_data.render(c)
        assert ids.tolist() == tok.encode("".join(t for t, _ in segs))      # the server's tokenisation
        edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(int), 0]))
        runs = list(zip(edges[::2], edges[1::2]))
        targets = [t for t, y in segs if y]
        assert len(runs) == len(targets)
        for (a, b), t in zip(runs, targets):
            assert tok.decode(ids[a:b].tolist(), skip_special_tokens=False) == t
            assert ids[b - 1] == tok.eos_id and ids[a - 1] in (tok.think_start_id, tok.think_end_id)


def test_packing_keeps_conversations_whole_and_pads_unmasked():
    ex = [(np.arange(1, n + 1, dtype=np.int32), np.arange(n) % 2 == 1) for n in (5, 4, 9, 3, 2)]
    rows, mask, dropped = chat_data.pack_conversations(ex, 8, pad_id=0)
    assert dropped == 1 and rows.shape == (3, 8)             # 9 > 8 dropped; [5] [4 3] [2]
    assert rows[0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0] and rows[1].tolist() == [1, 2, 3, 4, 1, 2, 3, 0]
    assert not mask[rows == 0].any() and mask.sum() == 2 + 2 + 1 + 1


def test_sft_weights_mix_chat_and_documentation_by_the_fraction():
    from dsflash.train.run import _sft_weights
    m = np.zeros((4, 9), bool)
    m[0, 3:6] = m[1, 1:] = True
    m[2:] = True
    w = _sft_weights(m, 2, 0.25)
    assert w.shape == (4, 8)
    np.testing.assert_allclose([w[:2].sum(), w[2:].sum()], [0.75, 0.25], rtol=1e-6)
    assert (w[0, [2, 3, 4]] > 0).all() and w[0].astype(bool).sum() == 3     # weight k predicts token k + 1
    np.testing.assert_allclose(_sft_weights(m[:2], 2, 0.25).sum(), 1.0, rtol=1e-6)   # no documentation rows


SMOKE = dict(vocab_size=512, batch_size=4, seq_len=32, eval_batches=1, quiet=True, draft_steps=0)


def test_sft_stage_end_to_end_lowers_the_chat_loss(tmp_path):
    """``train(target_from=..., sft_steps=...)`` on a mini checkpoint (random init, exported like a trained one):
    the chat loss on its training rows falls, the export carries the fine-tuned target and the source's draft, and
    training.json records the SFT stage and the measured perplexity."""
    import dsflash
    from dsflash.engram_map import build_compressed_token_map
    from dsflash.model.params import float_params, init_params
    from dsflash.train import run
    from dsflash.train.config import mini_config
    from dsflash.train.export import export_checkpoint

    docs = data.corpus_documents()[:120]
    tokdir, src = tmp_path / "tok", tmp_path / "src"
    data.train_tokenizer(tokdir, data.split_documents(docs)[0], 512, 511)
    tmap, n = build_compressed_token_map(Tokenizer.from_folder(tokdir))
    cfg = mini_config(512, n)
    params = float_params(cfg, init_params(cfg, 0))
    params["engram.token_map"] = jnp.asarray(tmap, jnp.int32)
    info = data.corpus_info(docs)
    export_checkpoint(str(src), cfg, params, str(tokdir), {"config": "mini", "seq_len": 32, "corpus": info,
                                                           "target_step_kept": 0, "draft_steps_run": 7})
    chat = dict(limit=12, per_entry=2, tool_share=0.0, multi_share=0.3)
    m = run.train(str(tmp_path / "sft"), target_from=str(src), docs=docs, sft_steps=8, sft_lr=3e-3,
                  sft_seq_len=256, sft_lm_fraction=0.25, eval_every=4, chat=chat, **SMOKE)
    s = m["sft"]
    assert s["steps_run"] == 8 and s["conversations"]["train_rows"] >= 4
    assert s["train_chat_loss"] < s["init_train_chat_loss"] - 1.0, s
    assert np.isfinite([s["heldout_chat_loss"], s["loaded_heldout_chat_loss"], m["loaded_heldout_ppl"]]).all()
    # quantisation-aware: the kept step was measured as its export loads back -- the same loss from the loaded
    # checkpoint at the stage's fp32 numerics (loaded_heldout_chat_loss adds the reference numerics' FP8 activations)
    n_chat = SMOKE["batch_size"] - round(0.25 * SMOKE["batch_size"])
    _, _, hrows, hmask, _ = run.sft_rows(Tokenizer.from_folder(tokdir), chat, 256, 0, SMOKE["batch_size"], n_chat)
    from dsflash.train import loop
    sft = dsflash.load(str(tmp_path / "sft" / "checkpoint"), progress=False)
    loaded_fp32 = loop.masked_loss(sft.params, sft.cfg, hrows, hmask, SMOKE["batch_size"], "fp32")
    assert s["qat"] and loaded_fp32 == pytest.approx(s["heldout_chat_loss"], rel=1e-5), (loaded_fp32, s)
    meta = json.load(open(tmp_path / "sft" / "checkpoint" / "training.json"))
    assert meta["sft"]["step_kept"] == s["step_kept"] and meta["loaded_heldout_ppl"] == m["loaded_heldout_ppl"]
    assert meta["sft"]["corpus"]["sha256"] == data.corpus_info(docs)["sha256"]     # where the conversations came from
    assert meta["draft_steps_run"] == 7                 # no draft stage: the source's draft and its record stand
    a = dsflash.load(str(src), progress=False)
    b = dsflash.load(str(tmp_path / "sft" / "checkpoint"), progress=False)
    for k in a.params:                              # a new target; the source's draft, byte for byte
        if k.startswith("mtp.") or k == "engram.token_map":
            assert np.array_equal(np.asarray(a.params[k]), np.asarray(b.params[k])), k
    assert not np.array_equal(np.asarray(a.params["embed.weight"]), np.asarray(b.params["embed.weight"]))
    assert os.path.exists(tmp_path / "sft" / "checkpoint" / "heldout_rows.npy")
    with pytest.raises(ValueError, match="target_from"):
        run.train(str(tmp_path / "bad"), docs=docs, sft_steps=1, **SMOKE)


def test_a_second_sft_stage_keeps_the_first_ones_record():
    from dsflash.train import run
    assert run._sft_record({"config": "demo"}, {"steps": 3}) == {"sft": {"steps": 3}}
    once = {"config": "demo", **run._sft_record({}, {"steps": 160})}
    twice = {**once, **run._sft_record(once, {"steps": 300})}
    assert twice["sft"] == {"steps": 300} and twice["sft_earlier"] == [{"steps": 160}]
    thrice = run._sft_record(twice, {"steps": 5})
    assert thrice == {"sft": {"steps": 5}, "sft_earlier": [{"steps": 160}, {"steps": 300}]}


def test_stored_roundtrip_is_what_an_export_loads_back():
    """``export.stored_roundtrip`` (the QAT forward's weights, traced jnp) equals quantising for export and
    dequantising the stored tensors, tensor for tensor, and it moves weights off the formats' grids."""
    from dsflash.model.params import float_params, init_params
    from dsflash.train import loop
    from dsflash.train.config import mini_config
    from dsflash.train.export import quantize_params, stored_roundtrip

    cfg = mini_config(512, 300)
    params = float_params(cfg, init_params(cfg, 0))
    tgt, drf, const = loop.split_params(params)
    rng = np.random.default_rng(0)
    moved = {k: v * (1 + 0.05 * jnp.asarray(rng.standard_normal(v.shape), v.dtype)) for k, v in tgt.items()}
    rt = stored_roundtrip(cfg, moved)
    back = float_params(cfg, quantize_params(cfg, {**moved, **drf, **const}))
    assert set(rt) == set(moved)
    for k in moved:
        np.testing.assert_array_equal(np.asarray(rt[k]), np.asarray(back[k]), err_msg=k)
    changed = [k for k in moved if not np.array_equal(np.asarray(rt[k]), np.asarray(moved[k]))]
    assert len(changed) > len(moved) // 2
    # the straight-through view: the forward sees the round trip, the gradient is the identity's
    view = loop.quantised_view(moved, cfg)
    k = next(n for n in changed if n.endswith(".weight"))
    np.testing.assert_array_equal(np.asarray(view[k]), np.asarray(rt[k]))
    import jax
    g = jax.grad(lambda w: jnp.sum(loop.quantised_view({**moved, k: w}, cfg)[k] * 3.0))(moved[k])
    np.testing.assert_array_equal(np.asarray(g), np.full(g.shape, 3.0, np.float32))


def test_trial_conversations_are_the_first_held_out_or_evenly_spread_named_training_ones():
    """The selection both trial scripts score (chat_samples.py --trials, index_picks_share.py)."""
    convs = [{"name": f"e{i}" if i % 5 else None, "tools": [1] if i % 2 else None, "heldout": i >= 40,
              "thinking": False, "messages": []} for i in range(60)]
    held = chat_data.trial_conversations(convs, 3, "heldout")
    assert [c["name"] for c in held["tool"]] == ["e41", "e43", None]      # the unnamed e45 is held out too: kept
    assert held["tool"] == [c for c in convs if c["heldout"] and c["tools"]][:3]
    assert held["answer"] == [c for c in convs if c["heldout"] and not c["tools"]][:3]
    train = chat_data.trial_conversations(convs, 4, "train")
    tools = [c for c in convs[:40] if c["name"] and c["tools"]]            # 16 named training tool rows
    assert train["tool"] == tools[::4][:4]
    assert all(c["name"] and not c["heldout"] and not c["tools"] for c in train["answer"]) and len(train["answer"]) == 4
    with pytest.raises(ValueError, match="split"):
        chat_data.trial_conversations(convs, 3, "test")
