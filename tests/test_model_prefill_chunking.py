"""A prompt's prefill must not depend on how the engine cuts it: the same prompts prefilled alone in one call of a
``[1, 128]`` program, or in 31 / 32 / 12-token chunks of a ``[4, 32]`` program that also carries another prompt's
chunks (another row, another slot), give bit-identical caches and last-position logits. That is what lets the engine
pick a prefill bucket by load (the ``(1, B)`` bucket for a lone prompt) without changing any request's tokens.

Every rounding of the released model is per token (FP8 activations per 32 along K, the FP8 window KV and FP4 / MXFP4
compressed caches used in-chunk exactly as read back later), so what can differ is the accumulation order of XLA's
dots by their row count: the last-position LM head ran at M = the bucket's rows (1 vs 4) and rounded differently."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.model.forward import forward_jit, head_logits
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch

SLOTS, PAGES, PS = 4, 8, 16          # 128 positions per slot


@pytest.fixture(scope="module")
def model():
    from dsflash.checkpoint.synth import fast_init_params
    from dsflash.config import preset
    cfg = preset("tiny")
    return cfg, fast_init_params(cfg, 0)


def _prefill(cfg, params, precision, calls):
    """``calls``: list of (T, [(row, slot, tokens, start), ...]) run in turn on one state; returns the state and
    each (slot, start) chunk's last-position logits."""
    state = init_state(cfg, CacheGeometry(num_slots=SLOTS, num_pages=SLOTS * PAGES, page_size=PS, ring_slack=16),
                       precision)
    opts = RunOptions(precision=precision, page_size=PS, logits="last")
    logits = {}
    for T, chunks in calls:
        rows = 1 if T == 128 else 4
        tok = np.zeros((rows, T), np.int32)
        start, lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        slots = np.full(rows, SLOTS - 1, np.int32)          # padding rows: length 0, nothing written
        for r, s, ids, p in chunks:
            tok[r, :len(ids)], start[r], lengths[r], slots[r] = ids, p, len(ids), s
        batch = make_batch(tok, start, lengths, slots, pages_per_seq=PAGES)
        out, state = forward_jit(params, cfg, batch, state, opts)
        for r, s, ids, p in chunks:
            logits[(s, p + len(ids))] = np.asarray(out["logits"][r])
    return jax.tree.map(np.asarray, state), logits


def _bits(a):
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.parametrize("precision", ["reference", "bf16"])
def test_prefill_is_invariant_to_chunking_and_bucket_rows(model, precision):
    cfg, params = model
    rng = np.random.default_rng(5)
    P = rng.integers(3, cfg.vocab_size, 75)        # slot 0
    Q = rng.integers(3, cfg.vocab_size, 50)        # slot 1
    alone = [(128, [(0, 0, P, 0)]), (128, [(0, 1, Q, 0)])]
    # odd chunk ends (31, 63): the ratio-2 compressors carry a pending group across the boundary
    packed = [(32, [(0, 1, Q[:32], 0), (2, 0, P[:31], 0)]),
              (32, [(1, 0, P[31:63], 31), (3, 1, Q[32:], 32)]),
              (32, [(2, 0, P[63:], 63)])]
    s_a, l_a = _prefill(cfg, params, precision, alone)
    s_b, l_b = _prefill(cfg, params, precision, packed)
    for key in [(0, 75), (1, 50)]:
        assert np.array_equal(l_a[key], l_b[key]), (key, float(np.abs(l_a[key] - l_b[key]).max()))
    flat_a = jax.tree_util.tree_flatten_with_path(s_a)[0]
    differ = [jax.tree_util.keystr(p) for (p, a), b in zip(flat_a, jax.tree.leaves(s_b))
              if not np.array_equal(_bits(a), _bits(b))]
    assert not differ, differ


def test_head_logits_of_a_row_do_not_depend_on_the_row_count(model):
    """The tile the head runs in: row r's logits among 1, 3, 8 or 13 rows are the same bits (two tiles at 13)."""
    cfg, params = model
    h = jnp.asarray(np.random.default_rng(0).standard_normal((13, cfg.hidden_size)), jnp.bfloat16)
    w = params["head.weight"]
    f = jax.jit(head_logits)
    full = np.asarray(f(h, w))
    for n in (1, 3, 8):
        assert np.array_equal(np.asarray(f(h[:n], w)), full[:n]), n
    assert np.array_equal(np.asarray(f(h[9:], w)), full[9:])
