"""DSpark draft (SPEC §10, §16b.9): the context written step by step equals the context written by one
prefill, drafts follow the greedy Markov chain, and the API's propose() is consistent with the pieces."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import dsflash
from dsflash.config import preset
from dsflash.model import dspark
from dsflash.model.forward import forward_jit
from dsflash.model.params import init_params
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch

PAGE, PAGES, S = 16, 4, 24
OPTS = RunOptions(precision="fp32", page_size=PAGE, taps=True, logits="last")
update = jax.jit(dspark.update_context, static_argnums=(1, 7))
propose = jax.jit(dspark.propose, static_argnums=(1, 6, 7))


@pytest.fixture(scope="module")
def setup():
    cfg = preset("tiny")
    return cfg, init_params(cfg, seed=5), np.random.default_rng(9).integers(0, cfg.vocab_size, (1, S)).astype(np.int32)


def fresh(cfg):
    return init_state(cfg, CacheGeometry(num_slots=1, num_pages=PAGES, page_size=PAGE), "fp32")


def test_context_by_decode_equals_context_by_prefill(setup):
    cfg, params, toks = setup
    slots = jnp.zeros((1,), jnp.int32)
    out, st = forward_jit(params, cfg, make_batch(toks, pages_per_seq=PAGES), fresh(cfg), OPTS)
    st = update(params, cfg, out["taps"], out["taps_start"], out["taps_lengths"], slots, st, OPTS)
    y = jnp.argmax(out["logits"], -1).astype(jnp.int32)
    pos = jnp.array([S], jnp.int32)
    a = propose(params, cfg, st, y, pos, slots, OPTS)

    st2 = fresh(cfg)
    for i in range(S):
        o, st2 = forward_jit(params, cfg, make_batch(toks[:, i:i + 1], start=[i], pages_per_seq=PAGES), st2, OPTS)
        st2 = update(params, cfg, o["taps"], o["taps_start"], o["taps_lengths"], slots, st2, OPTS)
    b = propose(params, cfg, st2, y, pos, slots, OPTS)

    np.testing.assert_array_equal(np.asarray(a["drafts"]), np.asarray(b["drafts"]))
    np.testing.assert_allclose(np.asarray(a["logits"]), np.asarray(b["logits"]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(a["confidence"]), np.asarray(b["confidence"]), atol=1e-4)

    # greedy Markov chain: every draft is the argmax of the distribution it was drawn from
    d, lg = np.asarray(a["drafts"])[0], np.asarray(a["logits"])[0]
    assert d.shape == (cfg.dspark_block_size,)
    np.testing.assert_array_equal(d, lg.argmax(-1))
    # ... and the chain conditions on the previous token: a different y changes the first distribution
    c = propose(params, cfg, st, (y + 1) % cfg.vocab_size, pos, slots, OPTS)
    assert np.abs(np.asarray(c["logits"])[0, 0] - lg[0]).max() > 1e-3

    # a sampler hook draws the chain (here: always the second-best token)
    second = lambda logits, i: jnp.argsort(-logits, axis=-1)[:, 1]
    s = propose(params, cfg, st, y, pos, slots, OPTS, second)
    np.testing.assert_array_equal(np.asarray(s["drafts"])[0], np.argsort(-np.asarray(s["logits"])[0], -1)[:, 1])


def test_model_api_propose_and_logits():
    m = dsflash.load("tiny", seed=5, precision="fp32", page_size=PAGE)
    toks = np.random.default_rng(9).integers(0, 512, (1, S))
    r = m.propose(toks)
    assert r["drafts"].shape == (1, m.cfg.dspark_block_size)
    assert r["confidence"].shape == (1, m.cfg.dspark_block_size)
    logits = m.logits(toks)
    assert r["y"][0] == logits[0, -1].argmax()
    with pytest.raises(ValueError, match="token_ids"):
        m.logits([[0, 600]])
