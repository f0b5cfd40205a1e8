"""The block's last mHC expand runs inside the next block's fused pass (``forward.block``'s ``pending``), not as an
op of its own: traced, ``forward`` calls ``mhc.expand`` only where the streams must exist on their own (into an
Engram layer, at the bounded-replay tail view, before the head) and ``post_mix`` everywhere else. The numbers are
derived from the config, so the test follows its layer lists. (That the outputs are unchanged is what the model's
golden / decode / replay / DSpark tests check.)"""
import importlib

import jax
import numpy as np
import pytest

from dsflash.config import preset
from dsflash.model import mhc
from dsflash.model.params import init_params
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch

fwd = importlib.import_module("dsflash.model.forward")    # (the package exports the function under that name)
PAGE, PAGES, S = 16, 6, 24


def _count_calls(monkeypatch, cfg, **opts):
    calls = {"expand": 0, "pre_mix": 0, "post_mix": 0}
    for name in calls:
        orig = getattr(mhc, name)

        def counted(*a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(*a, **k)
        monkeypatch.setattr(mhc, name, counted)
    params = init_params(cfg, seed=3)
    toks = np.random.default_rng(7).integers(0, cfg.vocab_size, size=(2, S)).astype(np.int32)
    state = init_state(cfg, CacheGeometry(num_slots=2, num_pages=2 * PAGES, page_size=PAGE), "fp32")
    o = RunOptions(precision="fp32", page_size=PAGE, **opts)
    jax.eval_shape(lambda p, b, s: fwd.forward(p, cfg, b, s, o), params,
                   make_batch(toks, lengths=[S, 17], pages_per_seq=PAGES), state)
    return calls


@pytest.mark.parametrize("replay", [None, "report"])
def test_the_last_expand_runs_in_the_next_blocks_fused_pass(monkeypatch, replay):
    cfg = preset("tiny")
    L = cfg.num_hidden_layers
    own = {l for l in cfg.engram_layer_ids if l > 0}            # where the streams are materialised between blocks
    opts = {}
    if replay:
        own.add(cfg.decoder_start)
        opts = dict(bounded_replay=replay, replay_tail=cfg.sliding_window + cfg.dspark_block_size, logits="last")
    assert L >= 4 and len(own) < L - 1, "the tiny config no longer exercises the deferral"
    calls = _count_calls(monkeypatch, cfg, **opts)
    assert calls == {"expand": len(own) + 1,                      # + the head's
                     "pre_mix": 1 + len(own),                     # layer 0 and after each materialisation
                     "post_mix": L + (L - 1 - len(own))}, (calls, sorted(own))
    assert set(cfg.dspark_target_layer_ids) - own, "no DSpark tap layer keeps the deferral: taps untested here"


def test_the_head_expands_only_the_last_rows(monkeypatch):
    """With logits "last" only each sequence's last row reaches the head, so the last expand, collapse and norm run
    on those rows (B x 1), not on every token of the chunk; with "all" on every row."""
    cfg = preset("tiny")
    for logits, rows in (("last", 1), ("all", S)):
        shapes = []
        orig = mhc.expand

        def recorded(y, *a, **k):
            shapes.append(y.shape)
            return orig(y, *a, **k)
        monkeypatch.setattr(mhc, "expand", recorded)
        _count_calls(monkeypatch, cfg, logits=logits)       # (wraps the recorder; the head's expand is the last)
        monkeypatch.setattr(mhc, "expand", orig)
        assert shapes[-1] == (2, rows, cfg.hidden_size), (logits, shapes)
