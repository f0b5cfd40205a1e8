"""Exact, sort-free top-k selection for the indexer (bit-identical to the ``lax.top_k`` paths it replaces).

``select_topk_threshold(score, visible, topk, *, key_bits=32)``      == indexer_topk.select_topk_sorted
``candidate_mask_threshold(score, visible, block_size, topk_blocks)`` == indexer_topk.candidate_mask_sorted

Algorithm, per row of T entries, k = min(topk, T):
  1. key: each fp32 score mapped to a uint32 whose unsigned order is the IEEE total order (flip every bit of a
     negative, the sign bit of a positive): -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN.
  2. threshold: the k-th largest key, i.e. the largest v with #(key >= v) >= k, found digit by digit from the top.
     A pass fixes ``digit_bits`` bits: for each of the 2^digit_bits - 1 nonzero digits d it counts the keys
     >= prefix | d << shift (a compare + sum over the row: a plain reduction, no histogram scatter); the counts
     fall with d, so the digit is how many of them are still >= k. 32 / digit_bits passes (DIGIT_BITS = 2:
     16 passes of 3 compares), unrolled in Python
     (an XLA while loop on a GPU syncs with the host every trip). ``counts`` picks how the sums are written
     (one stacked reduction or sibling reductions); both give the same counts, only the GPU speed may differ.
  3. selection: every key > v, plus the first k - #(key > v) entries (by index) whose key == v (a cumsum of the
     tie mask), then the caller's filter (score > -inf, t < visible).
  4. compaction (select only): the cumsum of the selection mask numbers the chosen entries 1, 2, ...; output slot
     j holds the first t whose cumsum reaches j + 1, found by an unrolled binary search over the cumsum
     (log2 T gathers of [rows, k]; no sort, no scatter). Slots past the count are -1.

Why it is exact: ``lax.top_k`` returns the k largest under the IEEE total order, ties to the lowest index
(checked on CPU: +0.0 ranks above -0.0, +NaN above +inf, -NaN below -inf, NaN payloads in bit order; the
compiled CPU HLO's TopK comparator is exactly that: bitcast to s32, flip the negatives, compare GT; on an H200,
run 25 of 2026-12-02, tests/test_topk_select.py passed 22 of 22 against the GPU's lax.top_k). Step 1 maps that order onto unsigned integers one to one, so
the selected set in step 3 is the same set; the reference then sorts the surviving indices ascending, which is the
order step 4 produces. No arithmetic touches a score, so every input gives the same bits, NaN included.

``key_bits=16``: search only the top 16 key bits (16 / digit_bits passes, 8 at the default). Exact only when every score is
bf16-valued (its low 16 bits are zero, as the model's indexer scores are: indexer_topk's docstring); the caller
opts in, the default is the exact 32-bit search.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

# Bits fixed per pass (16 passes of 3 compares). H200 run 25: 2.149 ms at 32 x 6 x 131072 against lax.top_k's 2.286
# (only 1.06x: the passes are not the ~25 us each this assumed; 4 bits and "sibling" counts are untimed). Chosen because its worst case (each of the
# 3 compares re-reading the row from DRAM: 16 x 3 x ~25 us at 32 x 6 x 131072) still beats the sort's 2.55 ms,
# while 4 bits (8 passes of 15) wins only if XLA reads the row once per pass (NOTES.md, "Exact threshold top-k")
DIGIT_BITS = 2
# numpy scalars, not jnp: a jnp constant at import time would start the XLA backend, and a jax.distributed
# process must import dsflash before that (jax.distributed.initialize comes first)
_SIGN = np.uint32(0x80000000)
_ONES = np.uint32(0xFFFFFFFF)


def total_order_key(x):
    """uint32 whose unsigned order is the IEEE total order of the fp32 ``x``."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return bits ^ jnp.where(bits >= _SIGN, _ONES, _SIGN)


def kth_largest_key(key, k: int, *, key_bits: int = 32, digit_bits: int = DIGIT_BITS, counts: str = "stacked"):
    """[..., T] uint32 keys below 2^key_bits -> [...] their k-th largest (1 <= k <= T). Unrolled radix search,
    one counting reduction per digit. ``counts``: "stacked" sums one [..., 2^b - 1, T] compare; "sibling" writes
    2^b - 1 separate sums of the same key (for XLA's sibling multi-output fusion: one read of the row a pass)."""
    assert key_bits % digit_bits == 0 and 1 <= k <= key.shape[-1] and counts in ("stacked", "sibling")
    digits = jnp.arange(1, 2 ** digit_bits, dtype=jnp.uint32)
    prefix = jnp.zeros(key.shape[:-1], jnp.uint32)
    for shift in range(key_bits - digit_bits, -1, -digit_bits):
        cand = prefix[..., None] | (digits << shift)                                    # [..., 2^b - 1]
        if counts == "stacked":
            count = jnp.sum(key[..., None, :] >= cand[..., None], axis=-1, dtype=jnp.int32)
        else:
            count = jnp.stack([jnp.sum(key >= cand[..., d, None], axis=-1, dtype=jnp.int32)
                               for d in range(cand.shape[-1])], axis=-1)
        digit = jnp.sum(count >= k, axis=-1, dtype=jnp.uint32)                          # counts fall with d
        prefix = prefix | (digit << shift)
    return prefix


def topk_mask(score, k: int, *, key_bits: int = 32, digit_bits: int = DIGIT_BITS, counts: str = "stacked"):
    """[..., T] bool: the entries ``lax.top_k(score, k)`` returns (total order, ties to the lowest index)."""
    if k == 0:
        return jnp.zeros(score.shape, bool)
    key = total_order_key(score) >> (32 - key_bits)   # 16 bits: exact for bf16-valued scores only
    thr = kth_largest_key(key, k, key_bits=key_bits, digit_bits=digit_bits, counts=counts)
    above = key > thr[..., None]
    tie = key == thr[..., None]
    need = k - jnp.sum(above, axis=-1, dtype=jnp.int32)
    return above | (tie & (jnp.cumsum(tie, axis=-1, dtype=jnp.int32) <= need[..., None]))


def compact_ascending(mask, k: int):
    """[..., T] bool (at most k set) -> [..., k] int32: the set positions ascending, then -1."""
    T = mask.shape[-1]
    csum = jnp.cumsum(mask, axis=-1, dtype=jnp.int32)
    want = jnp.arange(1, k + 1, dtype=jnp.int32)                      # slot j holds the (j+1)-th set entry
    lo = jnp.zeros(mask.shape[:-1] + (k,), jnp.int32)                 # #(t: csum[t] < want), by bisection
    step = 1 << max(T - 1, 0).bit_length()
    while step:
        probe = lo + step
        seen = jnp.take_along_axis(csum, jnp.minimum(probe, T) - 1, axis=-1)
        lo = jnp.where((probe <= T) & (seen < want), probe, lo)
        step >>= 1
    return jnp.where(lo < T, lo, -1)


def select_topk_threshold(score, visible, topk: int, *, key_bits: int = 32, digit_bits: int = DIGIT_BITS,
                          counts: str = "stacked"):
    """indexer_topk.select_topk without a sort: top-min(topk, T) ascending, -1 for empty / unreachable."""
    T = score.shape[-1]
    k = min(topk, T)
    sel = topk_mask(score, k, key_bits=key_bits, digit_bits=digit_bits, counts=counts)
    ok = sel & (score > -jnp.inf) & (jnp.arange(T, dtype=jnp.int32) < visible[..., None])
    return compact_ascending(ok, k)


def block_scores(score, visible, block_size: int):
    """[B, S, T] -> [B, S, nb]: max over blocks of ``block_size`` entries, the newest visible block +inf."""
    B, S, T = score.shape
    nb = -(-T // block_size)
    padded = jnp.pad(score, ((0, 0), (0, 0), (0, nb * block_size - T)), constant_values=-jnp.inf)
    block = jnp.max(padded.reshape(B, S, nb, block_size), axis=-1)
    newest = jnp.where(visible > 0, (visible - 1) // block_size, -1)
    return jnp.where(jnp.arange(nb)[None, None] == newest[..., None], jnp.inf, block)


def candidate_mask_threshold(score, visible, block_size: int, topk_blocks: int, *, digit_bits: int = DIGIT_BITS,
                             counts: str = "stacked"):
    """indexer_topk.candidate_mask without a sort: the top blocks (not -inf) expanded back to entries."""
    T = score.shape[-1]
    block = block_scores(score, visible, block_size)
    kb = min(topk_blocks, block.shape[-1])
    keep = topk_mask(block, kb, digit_bits=digit_bits, counts=counts) & (block > -jnp.inf)
    return jnp.repeat(keep, block_size, axis=-1)[..., :T]
