"""Lightning-indexer scoring + top-k selection (SPEC_V41 §4.5), the DeepSelect analogue.

``indexer_topk(q, w, k, visible, valid, *, topk, cand=None, cand_filter=None, backend)``
  q        [B, S, Hi, Di]  index queries (activation dtype; RoPE and the MXFP4 round trip already applied)
  w        [B, S, Hi]      per-head weights, already scaled by Di^-0.5 * Hi^-0.5 (activation dtype)
  k        [B, T, Di]      compressed index keys of the sequence (gathered through the page table)
  visible  [B, S] int32    entries t < visible are reachable ((pos + 1) // ratio)
  valid    [B, S] bool     padding rows score -inf everywhere
  topk                     index_topk (512 in V4.1); k = min(topk, T)
  cand     [B, S, T] bool  candidate consumers (layers 24-36): entries outside it score -inf
  cand_filter              (block_size, topk_blocks) at the candidate source (layer 20): also return its mask
  -> (idx [B, S, k] int32 ascending, -1 for empty; candidate mask [B, S, T] bool or None)

``indexer_topk_paged(q, w, pool, page_table, per_page, visible, valid, *, topk, gather, ...)``
  the same, with the keys left in the paged pool (T = pages x per_page entries, entry t at pool row
  page_table[b, t // per_page] * per_page + t % per_page); ``gather()`` returns them as ``k`` for the reference
  path. Decode calls (S <= PAGED_MAX_ROWS) on a GPU score straight from the pool (``indexer_paged_triton``).

Numerics (the model's, SPEC §4.5; every backend must give the same bits):
  qk[h, t]  = bf16(q_h . k_t)              fp32 accumulation
  c[h, t]   = bf16(relu(qk) * w_h)         (bf16 x bf16 is exact in fp32, so this is one rounding)
  score[t]  = f32(bf16(sum_h c[h, t]))     fp32 sum over heads, rounded to bf16 (bf16 precision)
  masked to -inf where t >= visible or the row is padding (or outside ``cand``).
Selection: ``jax.lax.top_k`` (ties go to the lowest index), re-sorted ascending, unreachable -> -1 (on a GPU the
same bits without a sort: the Triton radix top-k, kernels/topk_triton.py, or the XLA threshold search,
kernels/topk_select.py, as the dispatch gates say).
The candidate filter: max over blocks of ``block_size`` entries, the newest visible block forced in, top
``topk_blocks`` blocks whose score is not -inf, expanded back to entries.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash import quant
from dsflash.kernels import dispatch, topk_select
from dsflash.kernels.indexer_topk_shapes import check_inputs as _check


def indexer_scores_reference(q, w, k, visible, valid, cand=None):
    """score [B, S, T] fp32 (bf16-valued), -inf where unreachable."""
    _check(q, w, k, visible, valid, cand)
    dt = q.dtype
    qk = jnp.einsum("bshd,btd->bsht", q, k.astype(dt), preferred_element_type=jnp.float32).astype(dt)
    contrib = (jax.nn.relu(qk) * w[..., None]).astype(dt)
    score = jnp.sum(contrib.astype(jnp.float32), axis=2).astype(dt).astype(jnp.float32)
    T = k.shape[1]
    ok = (jnp.arange(T, dtype=jnp.int32)[None, None] < visible[..., None]) & valid[..., None]
    if cand is not None:
        ok = ok & cand
    return jnp.where(ok, score, -jnp.inf)


def candidate_mask(score, visible, block_size, topk_blocks, *, backend="xla", bf16_scores=False):
    """Layer-20 level-1 filter: top blocks of max-pooled scores, newest visible block forced in. The Triton radix
    top-k where ``dispatch.use_triton("topk", ...)`` says (at the blocks per row), else the sort-free threshold
    path where ``dispatch.use_threshold_topk`` says; the same bits every way (tests/test_topk_select.py,
    tests/test_kernels_topk_triton.py). ``bf16_scores``: every score is bf16-valued (16-bit keys suffice)."""
    blocks = -(-score.shape[-1] // block_size)
    if dispatch.use_triton("topk", backend, blocks):
        from dsflash.kernels import topk_triton  # lazy: needs a CUDA GPU and jax-triton
        return topk_triton.candidate_mask_triton(score, visible, block_size, topk_blocks,
                                                 key_bits=16 if bf16_scores else 32)
    if dispatch.use_threshold_topk(blocks):
        return topk_select.candidate_mask_threshold(score, visible, block_size, topk_blocks)
    return candidate_mask_sorted(score, visible, block_size, topk_blocks)


def select_topk(score, visible, topk, *, backend="xla", bf16_scores=False, masked=False):
    """Top-min(topk, T) by score (ties to the lowest index), ascending positions, -1 for empty. The Triton radix
    top-k, the sort-free threshold path or lax.top_k, as ``candidate_mask`` chooses (same bits every way).
    ``masked``: the scores are -inf at t >= visible (as every scorer here writes them), so the Triton kernel reads a
    row only up to max(visible, topk); same bits."""
    if dispatch.use_triton("topk", backend, score.shape[-1]):
        bits = 16 if bf16_scores else 32
        if score.shape[-1] >= dispatch.TOPK_SPLIT_MIN_ENTRIES:       # a row over several programs
            from dsflash.kernels import topk_split_triton  # lazy: needs a CUDA GPU and jax-triton
            return topk_split_triton.select_topk_split(score, visible, topk, key_bits=bits)
        from dsflash.kernels import topk_triton  # lazy: needs a CUDA GPU and jax-triton
        return topk_triton.select_topk_triton(score, visible, topk, key_bits=bits, masked=masked)
    if dispatch.use_threshold_topk(score.shape[-1]):
        return topk_select.select_topk_threshold(score, visible, topk)
    return select_topk_sorted(score, visible, topk)


def candidate_mask_sorted(score, visible, block_size, topk_blocks):
    """The reference filter through ``lax.top_k`` over the pooled blocks."""
    B, S, T = score.shape
    block = topk_select.block_scores(score, visible, block_size)
    nb = block.shape[-1]
    kb = min(topk_blocks, nb)
    bval, bidx = jax.lax.top_k(block, kb)
    keep = jnp.zeros((B, S, nb), bool)
    keep = jax.vmap(jax.vmap(lambda k, i, v: k.at[i].set(v > -jnp.inf)))(keep, bidx, bval)
    return jnp.repeat(keep, block_size, axis=-1)[..., :T]


def select_topk_sorted(score, visible, topk):
    """The reference selection: ``lax.top_k``, then a sort of the kept positions."""
    T = score.shape[-1]
    k = min(topk, T)
    val, idx = jax.lax.top_k(score, k)
    ok = (val > -jnp.inf) & (idx < visible[..., None])
    idx = jnp.where(ok, idx, T)
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx < T, idx, -1).astype(jnp.int32)


def select(score, visible, *, topk, cand_filter=None, backend="xla", bf16_scores=False, masked=False):
    """The shared selection stage: (top-k list, candidate mask or None) from written scores (``masked``: -inf at
    t >= visible, see ``select_topk``)."""
    kw = dict(backend=backend, bf16_scores=bf16_scores)
    mask = None if cand_filter is None else candidate_mask(score, visible, *cand_filter, **kw)
    return select_topk(score, visible, topk, masked=masked, **kw), mask


def indexer_topk_reference(q, w, k, visible, valid, *, topk, cand=None, cand_filter=None):
    return select(indexer_scores_reference(q, w, k, visible, valid, cand), visible, topk=topk,
                  cand_filter=cand_filter, masked=True)


def indexer_topk(q, w, k, visible, valid, *, topk, cand=None, cand_filter=None, backend="auto", force=False):
    """Scores by the reference or the Triton scorer, as ``dispatch.use_triton("indexer", ...)`` decides at B*S*T
    row-entries (the kernel on a GPU above 8K: one decode row over <= 8K entries stays on XLA; ``force``: at any
    size, for tests and the bench); the selection stage is shared."""
    B, S = q.shape[:2]
    kw = dict(topk=topk, cand_filter=cand_filter, backend=backend, bf16_scores=q.dtype == jnp.bfloat16,
              masked=True)   # both scorers write -inf at t >= visible
    if not dispatch.use_triton("indexer", backend, B * S * k.shape[1], force=force):
        return select(indexer_scores_reference(q, w, k, visible, valid, cand), visible, **kw)
    from dsflash.kernels import indexer_topk_triton  # lazy: needs a CUDA GPU and jax-triton
    score = indexer_topk_triton.indexer_scores_triton(q, w, k, visible, valid, cand)
    return select(score, visible, **kw)


def paged_keys(pool, page_table, per_page, dtype=jnp.bfloat16):
    """Every entry's index key [B, T, Di] gathered through the page table and decoded: the paged scorer's
    reference input (the model's own gather, ``attention.gather_pool`` with ``state.decode_index_k``, gives the
    same array: tests/test_kernels_indexer_paged.py)."""
    B, P = page_table.shape
    t = jnp.arange(P * per_page, dtype=jnp.int32)
    addr = page_table[:, t // per_page] * per_page + t % per_page
    rows = {k: v[addr] for k, v in pool.items()}
    if "x" in rows:
        return rows["x"].astype(dtype)
    vals = quant.e2m1_from_codes(quant.unpack_nibbles(rows["q"]))
    g = vals.reshape(*vals.shape[:-1], -1, 32) * quant.e8m0_to_f32(rows["s"])[..., None]
    return g.reshape(vals.shape).astype(dtype)


PAGED_MAX_ROWS = dispatch.PAGED_MAX_ROWS   # decode calls; a prefill chunk shares one gathered copy over its rows


def indexer_topk_paged(q, w, pool, page_table, per_page, visible, valid, *, topk, gather, cand=None,
                       cand_filter=None, backend="auto", force=False):
    """``indexer_topk`` over keys still in the paged pool: the paged Triton scorer where
    ``dispatch.use_triton("indexer_paged", ...)`` says so at B*S*T row-entries (and the rows and layout are its
    own: ``indexer_topk_shapes.paged_supports``), else ``indexer_topk`` on ``gather()``'s keys."""
    from dsflash.kernels.indexer_topk_shapes import paged_supports
    B, S = q.shape[:2]
    T = page_table.shape[1] * per_page
    if (S <= PAGED_MAX_ROWS and paged_supports(q, pool)
            and dispatch.use_triton("indexer_paged", backend, B * S * T, force=force)):
        from dsflash.kernels import indexer_paged_triton  # lazy: needs a CUDA GPU and jax-triton
        score = indexer_paged_triton.indexer_scores_paged_triton(q, w, pool, page_table, per_page, visible, valid,
                                                                 cand)
        return select(score, visible, topk=topk, cand_filter=cand_filter, backend=backend, bf16_scores=True,
                      masked=True)
    return indexer_topk(q, w, gather().astype(q.dtype), visible, valid, topk=topk, cand=cand,
                        cand_filter=cand_filter, backend=backend, force=force)
