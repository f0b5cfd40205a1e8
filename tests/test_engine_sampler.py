"""The speculative verifier is distribution-preserving, and logits processing does what it says."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dsflash.serve.engine import sampling as S


def _keys(n, k1, salt):
    return S.request_keys(np.full((n, k1), salt, np.uint32), np.zeros((n, k1), np.uint32),
                          np.arange(n * k1, dtype=np.int32).reshape(n, k1))


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampler_matches_target_distribution(seed):
    rng = np.random.default_rng(seed)
    V, k, N = 6, 2, 40000
    p = rng.dirichlet(np.ones(V) * 0.7, size=k + 1)          # target distributions at k+1 positions
    q = rng.dirichlet(np.ones(V) * 0.7, size=k)              # draft distributions
    p[0, 3] = 0.0                                             # a token the target never emits
    p[0] /= p[0].sum()
    # drafts sampled from q (independent per position)
    dk = jax.random.split(jax.random.PRNGKey(seed), k)
    drafts = jnp.stack([jax.random.categorical(dk[i], jnp.log(q[i]), shape=(N,)) for i in range(k)], 1).astype(jnp.int32)
    tl = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (N, k + 1, V))
    ql = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (N, k, V))
    toks, num = jax.jit(S.rejection_sample)(tl, tl, ql, drafts, jnp.zeros((N,), bool), _keys(N, k + 1, 1 + seed),
                                            _keys(N, k + 1, 100 + seed))
    toks, num = np.asarray(toks), np.asarray(num)
    assert num.min() >= 1 and num.max() <= k + 1
    # position 0 is always emitted and must follow p_0 exactly
    obs0 = np.bincount(toks[:, 0], minlength=V)
    assert obs0[3] == 0
    m = p[0] > 0
    assert stats.chisquare(obs0[m], p[0][m] * N).pvalue > 1e-3
    # position 1, given position 0 was an accepted draft, must follow p_1
    sel = num >= 2
    obs1 = np.bincount(toks[sel, 1], minlength=V)
    assert stats.chisquare(obs1, p[1] * sel.sum()).pvalue > 1e-3
    # acceptance is sum_x min(p, q) at the first position
    acc = (num >= 2).mean()
    assert abs(acc - np.minimum(p[0], q[0]).sum()) < 0.02


def test_rejection_sampler_greedy_is_exact_match_prefix():
    V = 8
    tl = jnp.log(jax.nn.softmax(jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, V)), jnp.float32)))
    arg = np.asarray(jnp.argmax(tl, -1))[0]
    drafts = jnp.asarray([[arg[0], arg[1], (arg[2] + 1) % V]], jnp.int32)
    ql = jnp.zeros((1, 3, V))
    toks, num = S.rejection_sample(tl, tl, ql, drafts, jnp.ones((1,), bool), _keys(1, 4, 0), _keys(1, 4, 1))
    assert int(num[0]) == 3
    assert list(np.asarray(toks[0, :3])) == [arg[0], arg[1], arg[2]]


def test_process_logits_topk_topp_minp():
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.1]], jnp.float32))
    one = lambda v, dt=jnp.float32: jnp.asarray([v], dt)
    lp = S.process_logits(logits, one(1.0), one(2, jnp.int32), one(1.0), one(0.0))
    np.testing.assert_allclose(np.exp(np.asarray(lp[0])), [0.4 / 0.7, 0.3 / 0.7, 0, 0], atol=1e-6)
    lp = S.process_logits(logits, one(1.0), one(0, jnp.int32), one(0.75), one(0.0))   # 0.4+0.3 < 0.75 -> 3 kept
    np.testing.assert_allclose(np.exp(np.asarray(lp[0])), [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0], atol=1e-6)
    lp = S.process_logits(logits, one(1.0), one(0, jnp.int32), one(1.0), one(0.6))    # p >= 0.24 kept
    np.testing.assert_allclose(np.exp(np.asarray(lp[0])), [0.4 / 0.7, 0.3 / 0.7, 0, 0], atol=1e-6)
    lp = S.process_logits(logits, one(0.5), one(0, jnp.int32), one(1.0), one(0.0))    # temperature sharpens
    pr = np.exp(np.asarray(lp[0]))
    np.testing.assert_allclose(pr, np.array([.16, .09, .04, .01]) / .30, atol=1e-6)


def test_a_row_without_top_p_keeps_its_tail_whatever_its_batch_mates_ask():
    """The sort behind top-k / top-p runs only when some row asks for it (a ``lax.cond``), so a row with neither
    must come out the same on both branches: its exact ``log_softmax``, even where the fp32 running mass has
    reached 1 before its tail (a dominant token), which a ``before < top_p`` test alone would cut at top_p = 1."""
    V = 64
    logits = jnp.zeros((2, V), jnp.float32).at[:, 0].set(50.0)        # p(0) rounds to 1 in fp32
    want = np.asarray(jax.nn.log_softmax(logits[0]))
    arr = lambda *v, dt=jnp.float32: jnp.asarray(v, dt)
    alone = S.process_logits(logits[:1], arr(1.0), arr(0, dt=jnp.int32), arr(1.0), arr(0.0))
    mixed = S.process_logits(logits, arr(1.0, 1.0), arr(0, 0, dt=jnp.int32), arr(1.0, 0.5), arr(0.0, 0.0))
    assert bool(S.needs_truncation(arr(0, 0, dt=jnp.int32), arr(1.0, 0.5), V))
    assert not bool(S.needs_truncation(arr(0, V, dt=jnp.int32), arr(1.0, 1.0), V))
    np.testing.assert_allclose(np.asarray(alone[0]), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mixed[0]), want, rtol=1e-6)
    assert np.isfinite(np.asarray(mixed[0])).all()
    assert np.isneginf(np.asarray(mixed[1, 1:])).all() and np.isfinite(float(mixed[1, 0]))   # top-p 0.5: one kept


def test_sampling_is_greedy_argmax_on_the_all_greedy_branch_and_samples_on_the_other():
    """``sample`` / ``rejection_sample`` skip the Gumbel noise when every row is greedy; with one sampled row in
    the batch the greedy rows still get their argmax and the sampled row a sample of its distribution."""
    rng = np.random.default_rng(3)
    V, B = 16, 6
    lg = jnp.asarray(rng.normal(size=(B, V)), jnp.float32)
    lp = jax.nn.log_softmax(lg, -1)
    keys = _keys(B, 1, 5)[:, 0]
    arg = np.asarray(jnp.argmax(lg, -1))
    np.testing.assert_array_equal(np.asarray(S.sample(lp, lg, jnp.ones((B,), bool), keys)), arg)
    greedy = jnp.asarray([True] * (B - 1) + [False])
    mixed = np.asarray(S.sample(lp, lg, greedy, keys))
    np.testing.assert_array_equal(mixed[:-1], arg[:-1])
    np.testing.assert_array_equal(mixed[-1], np.asarray(S.gumbel_argmax(keys, lp))[-1])
    # rejection sampler: first draft wrong -> greedy rows emit the target argmax, the sampled row a residual sample
    tl = jnp.broadcast_to(lp[:, None], (B, 2, V))
    drafts = jnp.asarray((arg + 1) % V, jnp.int32)[:, None]
    ql = jnp.where(jnp.arange(V) == drafts[..., None], 0.0, -jnp.inf)
    toks, num = S.rejection_sample(tl, tl, ql, drafts, jnp.ones((B,), bool), _keys(B, 2, 0), _keys(B, 2, 1))
    np.testing.assert_array_equal(np.asarray(num), 1)
    np.testing.assert_array_equal(np.asarray(toks[:, 0]), arg)
    toks, num = S.rejection_sample(tl, tl, ql, drafts, greedy, _keys(B, 2, 0), _keys(B, 2, 1))
    np.testing.assert_array_equal(np.asarray(toks[:-1, 0]), arg[:-1])
    if int(num[-1]) == 1:                   # draft rejected: the correction is never the rejected one-hot draft
        assert int(toks[-1, 0]) != int(drafts[-1, 0])


def test_penalties():
    logits = jnp.asarray([[2.0, -2.0, 1.0]])
    counts = jnp.asarray([[2, 1, 0]])
    seen = jnp.asarray([[True, True, False]])
    out = S.apply_penalties(logits, counts, seen, jnp.asarray([0.5]), jnp.asarray([0.25]), jnp.asarray([2.0]))
    np.testing.assert_allclose(np.asarray(out[0]), [2 / 2 - 0.5 - 0.5, -4 - 0.25 - 0.5, 1.0])


def test_keys_depend_on_seed_and_index_only():
    a = S.request_keys(np.array([5, 6], np.uint32), np.array([0, 0], np.uint32), np.array([3, 3], np.int32))
    b = S.request_keys(np.array([6], np.uint32), np.array([0], np.uint32), np.array([3], np.int32))
    assert np.array_equal(np.asarray(a[1]), np.asarray(b[0]))
    assert not np.array_equal(np.asarray(a[0]), np.asarray(a[1]))
