"""Teacher picks: given entries forced into the sparse-attention indexer's top-k during a training forward.

The demo's names fail past the 32-token window because the backbone does not read the compressed entries that
hold them, and it cannot learn to: top-k passes no gradient, the indexer picks ~16 of 300-750 visible entries
no better than chance, so the entries holding a name are almost never among the picks a training step attends
to (``docs/training.md``, "Why the names fail"). With teacher picks, the SFT stage puts the entries covering the
name a conversation must copy (``chat_data.teacher_entries``) into every index-source layer's picks at the
positions after it; the layers reusing a source's picks get them too. The main attention then sees them and the
loss trains their keys, values and the queries that read them; ``--index-distill`` can then teach the indexer
to pick what that attention looks at. Evaluation and serving never force anything.

The forcing wraps the model's ``indexer_topk_paged`` (``dsflash.model.attention.ik``) while a forward is traced,
as ``scripts/index_picks_share.py --force-entity`` does for one entry list per row; here the list is per
position (``[B, S, F]``), so packed conversations each force their own name.
"""
from __future__ import annotations

import contextlib
import importlib

import jax.numpy as jnp


def force_positions(topk, entries, visible, valid):
    """``topk`` [B, S, K] with each position's ``entries`` [B, S, F] (distinct ids, -1 pad) put in: copies already
    among the picks are blanked (-1) and the entries take the last F slots; a pad, or an entry not yet visible
    (``visible`` [B, S]: entries < visible are), or an invalid row (``valid`` [B, S]) leaves the slot's own pick.
    F <= K."""
    K, F = topk.shape[-1], entries.shape[-1]
    if F > K:
        raise ValueError(f"teacher picks: {F} forced entries per position, top-k is {K}")
    e = entries.astype(topk.dtype)
    ok = (e >= 0) & (e < visible[..., None]) & valid[..., None]
    dup = jnp.any((topk[..., :, None] == jnp.where(ok, e, -2)[..., None, :]), axis=-1) & (topk >= 0)
    t = jnp.where(dup, -1, topk)
    return jnp.concatenate([t[..., :K - F], jnp.where(ok, e, t[..., K - F:])], axis=-1)


class Proxy:
    """A module stand-in: ``overrides`` first, the module's attributes otherwise."""

    def __init__(self, module, **overrides):
        self._m, self._o = module, overrides

    def __getattr__(self, k):
        return self._o[k] if k in self._o else getattr(self._m, k)


@contextlib.contextmanager
def forcing(entries: dict | None, page_size: int):
    """While tracing a forward inside this block, every index-source layer's top-k gets ``entries[str(ratio)]``
    ([B, S, F], :func:`force_positions`) of its compression ratio. ``None``: nothing changes."""
    if entries is None:
        yield
        return
    attention = importlib.import_module("dsflash.model.attention")
    orig = attention.ik

    def hook(q, w, pool, page_table, per_page, visible, valid, **kw):
        topk, cand = orig.indexer_topk_paged(q, w, pool, page_table, per_page, visible, valid, **kw)
        return force_positions(topk, entries[str(page_size // per_page)], visible, valid), cand

    attention.ik = Proxy(orig, indexer_topk_paged=hook)
    try:
        yield
    finally:
        attention.ik = orig
