"""loop.target_outputs as draft_loss's ``cached``: the same loss, hits and gradients as running the target inside
the step, for a logits offset > 0 (the cache keeps only the positions anchors can reach)."""
import jax
import jax.numpy as jnp
import numpy as np

from dsflash.model.params import float_params, init_params
from dsflash.train import loop
from dsflash.train.config import mini_config


def test_cached_target_outputs_give_the_same_loss_and_gradients():
    cfg = mini_config(256, 200)
    params = float_params(cfg, init_params(cfg, 0))
    params["engram.token_map"] = jnp.asarray(np.arange(256) % 200, jnp.int32)
    _, drf, _ = loop.split_params(params)
    frozen = {k: v for k, v in params.items() if not k.startswith("mtp.")}
    S, off = 48, 20
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 256, (3, S)), jnp.int32)
    a = jnp.asarray(loop.sample_anchors(np.random.default_rng(2), cfg, 3, S, 4, lo=off))
    assert int(a.min()) >= off

    def loss(d, cached):
        return loop.draft_loss(d, frozen, cfg, tok, a, "fp32", 0.5, cached=cached)

    cached = loop.target_outputs(frozen, cfg, tok, "fp32", off)
    assert cached["logits"].shape == (3, S - off, cfg.vocab_size)
    (l0, aux0), g0 = jax.value_and_grad(loss, has_aux=True)(drf, None)
    (l1, aux1), g1 = jax.value_and_grad(loss, has_aux=True)(drf, cached)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux1["hit_per_pos"]), np.asarray(aux0["hit_per_pos"]))
    for k in g0:
        np.testing.assert_allclose(np.asarray(g1[k]), np.asarray(g0[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    # a wrong offset must show: the logits of other positions give another loss
    shifted = dict(cached, offset=jnp.int32(off - 1))
    assert abs(float(loss(drf, shifted)[0]) - float(l0)) > 1e-4
