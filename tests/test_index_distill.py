"""Indexer distillation (``dsflash.model.index_distill``, ``RunOptions(index_distill=True)``): the KL is 0 exactly
when the indexer's softmax equals the attention's distribution and positive otherwise, rows without a visible entry
add nothing, the target is the heads' mean attention over the visible compressed entries, and in the model it
leaves every output as it was, is finite and positive at init, and sends gradient to the indexer's weights only (its
query and key sides), not the backbone or the compressor."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.model import index_distill as idd


def test_kl_is_zero_at_the_target_and_positive_elsewhere():
    t = jnp.asarray([[[0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]], jnp.float32)
    ninf = -jnp.inf
    at = jnp.asarray([[[np.log(0.5) + 3, np.log(0.25) + 3, np.log(0.25) + 3, ninf],
                       [7.0, ninf, ninf, ninf], [ninf, ninf, ninf, ninf]]], jnp.float32)
    assert abs(float(idd.distill_kl(t, at))) < 1e-6          # shift-invariant; the empty third row adds nothing
    off = at.at[0, 0, 1].add(1.0)
    kl = float(idd.distill_kl(t, off))
    assert kl > 1e-3
    # the empty row does not dilute the mean: two rows with mass, one of them at 0
    row0 = float(idd.distill_kl(t[:, :1], off[:, :1]))
    assert kl == pytest.approx(row0 / 2, rel=1e-6)
    assert float(idd.distill_kl(jnp.zeros_like(t), off)) == 0.0


def test_target_is_the_heads_mean_attention_over_visible_entries():
    rng = np.random.default_rng(0)
    B, S, H, D, T = 1, 3, 2, 8, 5
    q = rng.normal(size=(B, S, H, D)).astype(np.float32)
    kv = rng.normal(size=(B, T, D)).astype(np.float32)
    visible = np.asarray([[0, 2, 5]], np.int32)
    valid = np.asarray([[True, True, True]])
    p = np.asarray(idd.attention_target(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(visible), jnp.asarray(valid),
                                        0.5))
    assert np.all(p[0, 0] == 0)                                           # nothing visible yet
    for s in (1, 2):
        v = visible[0, s]
        lg = np.einsum("hd,td->ht", q[0, s], kv[0, :v]) * 0.5
        ref = np.exp(lg - lg.max(-1, keepdims=True))
        ref = (ref / ref.sum(-1, keepdims=True)).mean(0)
        np.testing.assert_allclose(p[0, s, :v], ref, rtol=1e-5)
        assert np.all(p[0, s, v:] == 0)


@pytest.fixture(scope="module")
def mini():
    from dsflash.model.params import float_params, init_params
    from dsflash.train.config import mini_config
    cfg = mini_config(512)
    return cfg, float_params(cfg, init_params(cfg, 0))


def _forward(params, cfg, tokens, distill):
    from dsflash.model.forward import forward
    from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch
    B, S = tokens.shape
    pages = -(-S // 16)
    st = init_state(cfg, CacheGeometry(B, B * pages, 16, cfg.dspark_block_size + 1), "fp32")
    out, _ = forward(params, cfg, make_batch(tokens, pages_per_seq=pages), st,
                     RunOptions(precision="fp32", logits="all", page_size=16, index_distill=distill))
    return out


def test_in_the_model_outputs_are_unchanged_and_only_the_indexer_learns(mini):
    cfg, params = mini
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 500, size=(2, 32)), jnp.int32)
    f = jax.jit(_forward, static_argnums=(1, 3))
    plain, dist = f(params, cfg, tokens, False), f(params, cfg, tokens, True)
    np.testing.assert_array_equal(np.asarray(plain["logits"]), np.asarray(dist["logits"]))
    kl = float(dist["index_kl"])
    assert np.isfinite(kl) and kl > 0

    g = jax.jit(jax.grad(lambda p: _forward(p, cfg, tokens, True)["index_kl"]))(params)
    norms = {k: float(jnp.linalg.norm(v.astype(jnp.float32))) for k, v in g.items()
             if jnp.issubdtype(v.dtype, jnp.floating)}
    moved = {k for k, n in norms.items() if n > 0}
    assert moved, "no gradient at all"
    assert all(".indexer." in k for k in moved), sorted(moved)[:8]                  # not the backbone or compressor
    for part in (".indexer.wq_b", ".indexer.weights_proj", ".indexer.wk", ".indexer.k_norm"):
        assert any(part in k for k in moved), (part, sorted(moved))


def test_bounded_replay_refuses_it():
    from dsflash.model.state import RunOptions
    with pytest.raises(ValueError, match="index_distill"):
        RunOptions(bounded_replay="report", replay_tail=8, index_distill=True)


def test_target_steps_with_distillation_lower_the_kl_and_move_the_indexer(mini):
    """``loop.target_step(..., index_weight)``: a few steps at a high learning rate lower the distillation KL and move
    the indexer's query weights; with weight 0 they move by AdamW's weight decay alone (top-k passes no gradient),
    orders of magnitude less."""
    from dsflash.train import loop
    cfg, params = mini
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 500, size=(2, 32)), jnp.int32)
    key = next(k for k in params if ".indexer.wq_b" in k and params[k].dtype == jnp.float32)
    moved = {}
    for weight in (0.0, 1.0):
        tgt, drf, const = loop.split_params(jax.tree.map(jnp.copy, params))
        w0 = np.asarray(tgt[key])
        opt = loop.make_optimizer(1e-2, 6, warmup=1)
        st = opt.init(tgt)
        kls = []
        for _ in range(4):
            tgt, st, loss, kl = loop.target_step(tgt, st, const, cfg, tokens, "fp32", opt, weight)
            kls.append(float(kl))
        moved[weight] = float(np.abs(np.asarray(tgt[key]) - w0).max())
        if weight:
            assert kls[-1] < kls[0], kls
        else:
            assert kls == [0.0] * 4
    assert moved[1.0] > 30 * moved[0.0], moved
