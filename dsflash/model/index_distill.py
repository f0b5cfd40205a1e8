"""Indexer distillation (training only): the lightning indexer's scores pulled toward where the main attention looks.

The indexer picks which compressed entries a query row attends to, through a top-k that passes no gradient, so the
indexer's weights never move in training (docs/training.md "Known gaps"). The demo model's chat turns need exactly
what it cannot learn then: a tool call's argument names an entity ~67 tokens back, past the 32-token window, where
only the picked entries reach (docs/training.md, "Chat stage").

The loss, per index-source layer and valid query row with at least one visible compressed entry (DeepSeek-V3.2's
indexer warm-up, restricted to the entries the indexer chooses among): the target is the main attention's
distribution over the visible compressed entries -- softmax over entries of ``q . kv * scale`` per head, averaged
over heads, with no gradient -- and the loss is ``KL(target || softmax(index scores))`` over the same entries. The
attention layer (``csa_attention``, ``RunOptions(index_distill=True)``) recomputes the index queries from its inputs
held constant, and the index keys of the entries the call writes from the compressor's latent held constant
(``dense_entries``; entries of earlier calls come from the pool, constant), so the loss moves the indexer's own
weights only (``indexer.wq_b``, ``indexer.weights_proj``, ``indexer.wk``, ``indexer.k_norm``), not the backbone or
the compressor. The forward's outputs are unchanged by computing it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.kernels.indexer_topk import indexer_scores_reference
from dsflash.kernels.rope import rope_q


def attention_target(q, kv, visible, valid, scale, rope=None):
    """[B, S, T] fp32: the main attention's probabilities over the T compressed entries (``kv`` [B, T, D], RoPE
    applied), averaged over the H heads of ``q`` [B, S, H, D] (``rope``: q's RoPE, applied here as the attention
    kernels do); entries at or past ``visible`` [B, S] and invalid rows get 0 (a row with none: all 0)."""
    q = rope_q(q, rope).astype(jnp.float32)
    lg = jnp.einsum("bshd,btd->bsht", q, kv.astype(jnp.float32)) * jnp.float32(scale)
    T = kv.shape[1]
    ok = (jnp.arange(T, dtype=jnp.int32)[None, None] < visible[..., None]) & valid[..., None]      # [B, S, T]
    lg = jnp.where(ok[:, :, None, :], lg, -jnp.inf)
    m = jnp.max(lg, axis=-1, keepdims=True)
    p = jnp.exp(lg - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = jnp.where(den > 0, p / jnp.where(den > 0, den, 1.0), 0.0)
    return jax.lax.stop_gradient(jnp.mean(p, axis=2))


def distill_kl(target, score):
    """Mean over rows with any target mass of ``KL(target || softmax(score))`` (``score`` -inf where unreachable,
    the same entries the target leaves at 0). Rows without a visible entry add nothing; 0 if there is none."""
    has = jnp.sum(target, axis=-1) > 0                                                  # [B, S]
    s = jnp.where(jnp.isfinite(score), score, -1e30)
    logq = jax.nn.log_softmax(jnp.where(has[..., None], s, 0.0), axis=-1)
    kl = jnp.sum(jax.scipy.special.xlogy(target, target) - target * jnp.where(target > 0, logq, 0.0), axis=-1)
    n = jnp.sum(has)
    return jnp.where(n > 0, jnp.sum(jnp.where(has, kl, 0.0)) / jnp.maximum(n, 1), 0.0)


def index_distill_loss(q_idx, w_idx, k_idx, q, kv, visible, valid, scale, rope=None):
    """The layer's loss: index scores of ``q_idx`` / ``w_idx`` against the keys ``k_idx`` [B, T, Di] (fp32 scoring,
    so the gradient is not rounded away), the target from ``q`` and the compressed ``kv``."""
    f32 = jnp.float32
    score = indexer_scores_reference(q_idx.astype(f32), w_idx.astype(f32), k_idx.astype(f32), visible, valid)
    return distill_kl(attention_target(q, kv, visible, valid, scale, rope), score)
