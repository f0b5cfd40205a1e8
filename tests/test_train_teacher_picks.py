"""Copy conversations and teacher picks (issue 22, names past the window): the copy conversations put a name more
than the window before the answer that repeats it, without changing the other conversations; packing keeps track of
the tokens each tool-call / copy conversation must copy; teacher picks put exactly those entries into the indexer's
picks at the positions after them (per position, packed conversations each their own), reach the model's outputs
there and nowhere before, and leave the module as it was."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.api import SHIPPED
from dsflash.tokenizer import Tokenizer
from dsflash.train import chat_data, loop, teacher_picks

_spec = importlib.util.spec_from_file_location(
    "index_picks_share", os.path.join(os.path.dirname(__file__), "..", "scripts", "index_picks_share.py"))
ips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ips)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(SHIPPED["demo"])


def test_copy_conversations_repeat_a_name_from_beyond_the_window(tok):
    base = chat_data.conversations(limit=120)
    with_copy = chat_data.conversations(limit=120, copy_share=0.5)
    assert with_copy[:len(base)] == base                        # the other conversations do not change
    copies = with_copy[len(base):]
    train_names = {c["name"] for c in base if not c["heldout"] and not c["name"].startswith("greeting:")}
    assert len(copies) > 20 and all(c.get("copy") and not c["heldout"] for c in copies)
    assert len({c["name"] for c in copies}) > 10 and {c["name"] for c in copies} <= train_names
    assert chat_data.conversations(limit=120, copy_share=0.5) == with_copy                  # seeded
    for c in copies:
        user, answer = c["messages"]
        assert answer["content"] == c["name"] and user["content"].count(c["name"]) >= 1
        ids, mask = chat_data.encode(tok, c)
        src = chat_data.source_positions(tok, c, ids)
        assert src and c["name"] in tok.decode(ids[src].tolist())
        first = int(np.argmax(mask))                            # the answer's first token: the name's start
        assert first - max(src) > 40, (first - max(src), c["name"])      # past the demo's 32-token window
        assert tok.decode(ids[first:].tolist(), skip_special_tokens=True) == c["name"]
    with pytest.raises(ValueError):
        chat_data.conversations(limit=5, copy_share=-1)


def test_teacher_entries_follow_each_packed_conversation():
    ex = [(np.arange(1, n + 1, dtype=np.int32), np.ones(n, bool)) for n in (5, 4, 9, 3)]
    layout, dropped = chat_data.pack_layout([len(x) for x, _ in ex], 8)
    assert dropped == 1 and layout == [[(0, 0)], [(1, 0), (3, 4)]]        # 9 > 8 dropped
    rows, _, d = chat_data.pack_conversations(ex, 8, 0)
    assert d == 1 and rows[1].tolist() == [1, 2, 3, 4, 1, 2, 3, 0]       # as before the layout helper
    src = chat_data.row_sources(layout, [5, 4, 9, 3], [[1, 2], [], [0], [0, 1]])
    assert src == [[([1, 2], 5)], [([4, 5], 7)]]
    e1 = chat_data.teacher_entries(src, 8, 1, n_max=3)
    assert e1.shape == (2, 8, 3)
    np.testing.assert_array_equal(e1[0, :, :2], [[-1, -1]] * 3 + [[1, 2]] * 2 + [[-1, -1]] * 3)
    np.testing.assert_array_equal(e1[1, :, :2], [[-1, -1]] * 6 + [[4, 5]] + [[-1, -1]])
    assert (e1[..., 2] == -1).all()
    e2 = chat_data.teacher_entries(src, 8, 2, n_max=3)          # ratio 2: tokens 1, 2 -> entries 0, 1; 4, 5 -> 2
    assert e2[0, 3].tolist() == [0, 1, -1] and e2[1, 6].tolist() == [2, -1, -1]


def test_chat_rows_sources_are_the_names_tokens(tok):
    convs = [c for c in chat_data.conversations(limit=60, copy_share=1.0) if not c["heldout"]]
    ids, mask, _, src = chat_data.chat_rows(tok, convs, 1024, 0, sources=True)
    plain = chat_data.chat_rows(tok, convs, 1024, 0)
    assert np.array_equal(ids, plain[0]) and np.array_equal(mask, plain[1])
    want = sum(bool(c["tools"]) or bool(c.get("copy")) for c in convs)
    got = [s for r in src for s in r]
    assert len(got) > 0.8 * want                                # (topics asked by title have no name to copy)
    for r, row in enumerate(src):
        for pos, end in row:
            text = tok.decode(ids[r, pos].tolist())
            after = tok.decode(ids[r, max(pos) + 1:end].tolist(), skip_special_tokens=False)
            assert any(n in text for n in {c["name"] for c in convs}), text
            assert ids[r, end - 1] == tok.eos_id and text.strip().split(".")[0] in after     # copied later


def test_force_positions_puts_each_positions_entries_in_once():
    topk = jnp.asarray([[[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, -1]]], jnp.int32)
    ent = jnp.asarray([[[5, 1], [-1, -1], [5, 1]]], jnp.int32)
    got = np.asarray(teacher_picks.force_positions(topk, ent, jnp.asarray([[9, 9, 3]]), jnp.ones((1, 3), bool)))
    # row 0: both forced into the last 2 slots, the copy of 1 blanked; row 1: nothing forced; row 2: 5 not visible
    np.testing.assert_array_equal(got, [[[0, -1, 5, 1], [4, 5, 6, 7], [0, -1, 2, 1]]])
    with pytest.raises(ValueError):
        teacher_picks.force_positions(topk, jnp.zeros((1, 3, 5), jnp.int32), jnp.asarray([[9, 9, 3]]),
                                      jnp.ones((1, 3), bool))


def test_teacher_picks_reach_the_picks_and_the_loss_only_where_forced():
    from dsflash.model import attention
    from dsflash.model.params import float_params, init_params
    from dsflash.train.config import mini_config
    cfg = mini_config(512)
    params = float_params(cfg, init_params(cfg, 0))
    S = 48
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 500, size=(2, S)), jnp.int32)
    src = [[([3, 4, 5], 40)], []]                               # row 0 copies tokens 3-5 at positions 6..39
    F = cfg.index_topk // 2
    force = {str(r): jnp.asarray(chat_data.teacher_entries(src, S, r, F))
             for r in {cfg.ratio(l) for l in cfg.index_source_layer_ids}}
    orig = attention.ik
    with teacher_picks.forcing(force, loop.PAGE):
        rec = ips.capture(params, cfg, tokens, jnp.asarray([S, S], jnp.int32))
    assert attention.ik is orig                                 # unpatched afterwards
    for layer, d in rec.items():
        ents = sorted({p // cfg.ratio(layer) for p in (3, 4, 5)})
        for s in range(6, 40):
            vis = [e for e in ents if e < d["visible"][0, s]]
            assert set(vis) <= set(d["topk"][0, s].tolist()), (layer, s)
    const = {k: v for k, v in params.items() if not jnp.issubdtype(v.dtype, jnp.floating)}
    tr = {k: v for k, v in params.items() if k not in const}
    w = jnp.ones((2, S - 1), jnp.float32) / (2 * (S - 1))
    plain, _ = loop.sft_loss(tr, const, cfg, tokens, w, "fp32")
    none = {k: jnp.full_like(v, -1) for k, v in force.items()}
    same, _ = loop.sft_loss(tr, const, cfg, tokens, w, "fp32", force=none)
    forced, _ = loop.sft_loss(tr, const, cfg, tokens, w, "fp32", force=force)
    assert float(same) == pytest.approx(float(plain), abs=1e-6) and abs(float(forced) - float(plain)) > 1e-5
    # per position: rows of row 0 before the first forced entry is complete, and row 1, predict as unforced
    with teacher_picks.forcing(force, loop.PAGE):
        nf = np.asarray(jax.jit(lambda p, t: loop.token_nll(p, cfg, t, "fp32"))(params, tokens))
    nu = np.asarray(loop.token_nll(params, cfg, tokens, "fp32"))
    np.testing.assert_allclose(nf[1], nu[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nf[0, :4], nu[0, :4], rtol=1e-5, atol=1e-6)
    assert np.abs(nf[0, 6:40] - nu[0, 6:40]).max() > 1e-4
    # a training step with teacher picks runs and moves the weights
    opt = loop.make_optimizer(1e-3, 4)
    st = opt.init(tr)
    tr2, _, loss, _ = loop.sft_step(dict(tr), st, const, cfg, tokens, w, "fp32", opt, False, 0.0, force)
    assert np.isfinite(float(loss)) and float(loss) == pytest.approx(float(forced), rel=1e-5)
