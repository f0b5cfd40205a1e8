"""One DSpark draft sampler (``dsflash/model/draft_sampler.py``) for every caller: the engine's ``ModelBackend``,
the ``ToyBackend`` and ``dspark.propose``'s greedy default draw each draft the same way, so each caller's drafts
are ``sample_draft`` of the logits that caller reports (at temperature 1, where reported = raw logits)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.model.draft_sampler import draft_sampler, greedy_draft, sample_draft

TEMPS = jnp.asarray([0.0, 1.0, 0.0, 1.0], jnp.float32)      # greedy and sampled rows side by side


def _keys(n, seed=3):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def test_sample_draft_is_greedy_or_gumbel_max_per_row():
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 50), jnp.float32) * 3
    temps = jnp.asarray([0.0, 0.7, -1.0, 2.0], jnp.float32)
    keys = _keys(4)
    for i in range(3):
        got = np.asarray(sample_draft(logits, i, temps, keys))
        for b in range(4):
            if temps[b] > 0:
                g = jax.random.gumbel(jax.random.fold_in(keys[b], i), (50,), jnp.float32)
                want = int(jnp.argmax(logits[b] / temps[b] + g))
            else:
                want = int(jnp.argmax(logits[b]))
            assert got[b] == want, (i, b)
    ties = jnp.zeros((2, 8), jnp.float32)
    assert np.asarray(greedy_draft(ties)).tolist() == [0, 0]                  # ties to the lowest id
    assert np.asarray(sample_draft(ties, 0, jnp.zeros(2), _keys(2))).tolist() == [0, 0]
    assert np.asarray(draft_sampler(temps, keys)(logits, 1)).tolist() == np.asarray(
        sample_draft(logits, 1, temps, keys)).tolist()


def _agrees(drafts, logits, keys):
    drafts, logits = np.asarray(drafts), jnp.asarray(logits)
    for i in range(drafts.shape[1]):
        np.testing.assert_array_equal(drafts[:, i], np.asarray(sample_draft(logits[:, i], i, TEMPS, keys)))


def test_toy_backend_draws_with_the_one_sampler():
    from dsflash.model.state import CacheGeometry
    from dsflash.serve.engine.testing import ToyBackend
    be = ToyBackend()
    geo = CacheGeometry(num_slots=4, num_pages=8, page_size=8)
    be.bind_geometry(geo)
    state = be.init_state(geo)
    keys = _keys(4, seed=7)
    y = jnp.asarray([5, 9, 5, 9], jnp.int32)
    drafts, logits, _ = be.propose(be.params, state, y, jnp.full((4,), 3, jnp.int32), jnp.arange(4, dtype=jnp.int32),
                                   jnp.zeros((4,), jnp.int32), TEMPS, keys)
    _agrees(drafts, logits, keys)


@pytest.fixture(scope="module")
def tiny_backend():
    import dsflash
    from dsflash.model.state import CacheGeometry
    from dsflash.serve.engine.backend import ModelBackend
    be = ModelBackend(dsflash.load("tiny", seed=2, progress=False))
    geo = CacheGeometry(num_slots=4, num_pages=8, page_size=16)
    be.bind_geometry(geo)
    return be, be.init_state(geo)


def test_model_backend_and_dspark_default_draw_with_the_one_sampler(tiny_backend):
    from dsflash.model import dspark
    be, state = tiny_backend
    keys = _keys(4, seed=11)
    y = jnp.asarray([17, 33, 17, 33], jnp.int32)
    pos, slots, floor = jnp.full((4,), 5, jnp.int32), jnp.arange(4, dtype=jnp.int32), jnp.zeros((4,), jnp.int32)
    drafts, logits, _ = jax.jit(be.propose)(be.params, state, y, pos, slots, floor, TEMPS, keys)
    _agrees(drafts, logits, keys)
    # the greedy rows are what dspark.propose drafts with its default sampler
    plain = jax.jit(lambda p, s: dspark.propose(p, be.cfg, s, y, pos + 1, slots, be._opts(), ring_floor=floor))(
        be.params, state)
    np.testing.assert_array_equal(np.asarray(drafts)[::2], np.asarray(plain["drafts"])[::2])
    np.testing.assert_array_equal(np.asarray(logits)[::2], np.asarray(plain["logits"])[::2])
