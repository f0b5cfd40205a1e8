"""How a DSpark draft token is picked, in one place for every caller: ``dspark.propose``'s default, the engine's
``ModelBackend.propose`` and the engine's ``ToyBackend``. The verifier's rejection sampling judges each draft against
the distribution it was drawn from, so all of them must draw it the same way."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_draft(logits):
    """logits [B, V] -> [B] int32: the first maximal index (ties to the lowest id, as everywhere in dsflash)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def draft_temperature(temperature):
    """[B] temperatures -> [B, 1] divisors of the draft logits: the row's temperature, 1 for greedy rows (whose
    logits so stay bit for bit what the draft head computed)."""
    return jnp.where(temperature > 0, temperature, 1.0)[:, None]


def sample_draft(logits, i, temperature, keys):
    """Draft ``i`` of a block, per row, from the draft head's raw logits [B, V] f32: greedy where the row's
    temperature is <= 0, else Gumbel-max over ``logits / temperature`` with the row's key folded with ``i``
    (``keys`` [B, 2]). The V-wide noise is drawn only when some row samples."""
    t = draft_temperature(temperature)
    greedy = greedy_draft(logits)

    def sampled():
        k = jax.vmap(lambda kk: jax.random.fold_in(kk, i))(keys)
        g = jax.vmap(lambda kk: jax.random.gumbel(kk, (logits.shape[-1],), jnp.float32))(k)
        return jnp.argmax(logits / t + g, axis=-1).astype(jnp.int32)

    s = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)
    return jnp.where(temperature > 0, s, greedy)


def draft_sampler(temperature, keys):
    """``sample_draft`` in the form ``dspark.propose`` takes: ``sampler(logits, i)``."""
    return lambda logits, i: sample_draft(logits, i, temperature, keys)
