"""Indexer scoring + top-k: the shared reference vs the model's former inline math, dispatch, shape errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.kernels import indexer_topk as ik


def _inputs(B=2, S=3, Hi=8, Di=16, T=64, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, S, Hi, Di)).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (B, S, Hi)) * 0.1).astype(jnp.bfloat16)
    k = jax.random.normal(ks[2], (B, T, Di)).astype(jnp.bfloat16)
    visible = jax.random.randint(ks[3], (B, S), 0, T + 1).astype(jnp.int32)
    valid = jnp.ones((B, S), bool).at[0, 0].set(False)
    return q, w, k, visible, valid


def _inline_model_math(q, w, k, visible, valid, cand, cb, kb, topk, is_cand):
    """attention.py's scoring / filter / selection as written before the kernel split (commit 892344a)."""
    dt = q.dtype
    qk = jnp.einsum("bshd,btd->bsht", q, k, preferred_element_type=jnp.float32).astype(dt)
    score = jnp.sum((jax.nn.relu(qk) * w[..., None]).astype(dt).astype(jnp.float32), axis=2).astype(dt)
    score = score.astype(jnp.float32)
    T = k.shape[1]
    ok = (jnp.arange(T)[None, None] < visible[..., None]) & valid[..., None]
    score = jnp.where(ok, score, -jnp.inf)
    mask = None
    if is_cand:
        B, S, _ = score.shape
        nb = -(-T // cb)
        block = jnp.max(jnp.pad(score, ((0, 0), (0, 0), (0, nb * cb - T)), constant_values=-jnp.inf)
                        .reshape(B, S, nb, cb), axis=-1)
        newest = jnp.where(visible > 0, (visible - 1) // cb, -1)
        block = jnp.where(jnp.arange(nb)[None, None] == newest[..., None], jnp.inf, block)
        bval, bidx = jax.lax.top_k(block, min(kb, nb))
        keep = jax.vmap(jax.vmap(lambda z, i, v: z.at[i].set(v > -jnp.inf)))(jnp.zeros((B, S, nb), bool), bidx, bval)
        mask = jnp.repeat(keep, cb, axis=-1)[..., :T]
    elif cand is not None:
        score = jnp.where(cand, score, -jnp.inf)
    val, idx = jax.lax.top_k(score, min(topk, T))
    idx = jnp.sort(jnp.where((val > -jnp.inf) & (idx < visible[..., None]), idx, T), axis=-1)
    return jnp.where(idx < T, idx, -1).astype(jnp.int32), mask


@pytest.mark.parametrize("mode", ["plain", "consumer", "candidate"])
def test_reference_is_model_math(mode):
    q, w, k, visible, valid = _inputs()
    cand = jax.random.uniform(jax.random.PRNGKey(9), visible.shape + (k.shape[1],)) < 0.5 if mode == "consumer" \
        else None
    filt = (8, 3) if mode == "candidate" else None
    got, gm = ik.indexer_topk(q, w, k, visible, valid, topk=12, cand=cand, cand_filter=filt)
    want, wm = _inline_model_math(q, w, k, visible, valid, cand, 8, 3, 12, mode == "candidate")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if filt:
        np.testing.assert_array_equal(np.asarray(gm), np.asarray(wm))
    else:
        assert gm is None


def test_ties_go_to_lowest_index():
    q, w, k, visible, valid = _inputs(B=1, S=1, T=32)
    k = jnp.ones_like(k)                                   # every entry scores the same
    idx, _ = ik.indexer_topk(q, w, k, jnp.array([[20]], jnp.int32), jnp.ones((1, 1), bool), topk=5)
    assert np.asarray(idx).tolist() == [[[0, 1, 2, 3, 4]]] or np.all(np.asarray(idx) == -1)


def test_triton_backend_on_cpu_runs_reference():
    a = _inputs()
    x, _ = ik.indexer_topk(*a, topk=10, backend="triton")
    y, _ = ik.indexer_topk(*a, topk=10, backend="xla")
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="backend"):
        ik.indexer_topk(*a, topk=10, backend="cuda")


@pytest.mark.parametrize("bad", ["q", "w", "k", "visible", "cand"])
def test_bad_shapes(bad):
    q, w, k, visible, valid = _inputs()
    cand = None
    if bad == "q":
        q = q[0]
    elif bad == "w":
        w = w[..., :-1]
    elif bad == "k":
        k = k[..., :-1]
    elif bad == "visible":
        visible = visible[:, :1]
    else:
        cand = jnp.ones((2, 3, 5), bool)
    with pytest.raises(ValueError):
        ik.indexer_topk(q, w, k, visible, valid, topk=4, cand=cand)


def test_tiny_decode_stays_on_xla():
    """The indexer's crossover (kernels/dispatch.py GATES["indexer"]) keeps <= 8192 row-entries (1 decode row x 8K)
    on XLA: the kernel lost there on the H200."""
    from dsflash.kernels import dispatch

    def triton_at(q, k):
        return dispatch.GATES["indexer"].covers(q.shape[0] * q.shape[1] * k.shape[1])
    q, w, k, visible, valid = _inputs(B=1, S=1, T=dispatch.INDEXER_XLA_MAX_ROW_ENTRIES)
    assert not triton_at(q, k)
    q2, _, k2, _, _ = _inputs(B=2, S=1, T=dispatch.INDEXER_XLA_MAX_ROW_ENTRIES)
    assert triton_at(q2, k2)
    assert triton_at(*_inputs(B=64, S=1, T=16384)[::2][:2])
