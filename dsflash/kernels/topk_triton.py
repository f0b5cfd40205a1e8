"""Triton exact top-k for the indexer: one program per score row finds the k-th largest key by a radix search and
writes the selection, bit-identical to ``topk_select`` (and so to ``lax.top_k``).

Same contract as ``topk_select.select_topk_threshold`` / ``topk_mask`` (the references, pure JAX), without their
16 XLA counting passes (H200 run 25: 16 x ~0.13 ms at 32 x 6 rows x 131,072 entries, 2.15 ms in all):
  1. key: the fp32 bits as int32, the low 31 bits flipped on negatives: signed order == IEEE total order
     (-NaN < -inf < ... < -0.0 < +0.0 < ... < +NaN), the order ``lax.top_k`` ranks by.
  2. the k-th largest key, 8 bits a pass from the top (``PASSES`` = 4 for 32-bit keys; 2 searches the top 16
     bits only, exact when every score is bf16-valued): a pass reads the row once, keeps the keys whose higher
     bits equal the prefix found so far and histograms their next byte (``tl.histogram``); the digit is the
     largest byte whose suffix count still reaches the k left, and the k left drops by the count above it.
  3. one more pass selects: every key above the threshold, the first (by index) ``need`` keys equal to it.
     MODE 0 (``select_topk``): the selected entries with score > -inf and t < visible, written ascending to
     out[row, :k] by a running count + an in-block cumsum, -1 after. MODE 1 (``topk_mask``): the mask as int8.
A row is read PASSES + 1 times (4 KB tiles; one 512 KB row per program at 131,072 entries).
``masked=True`` (``VIS_BOUND``; MODE 0): the caller promises every entry at t >= visible is -inf (or -NaN), as the
indexer's scorers write it. Then a row is read only up to n = min(T, max(visible, k)): every entry past n ranks below
each finite visible one and after it by index, so the k-th largest key among the first n (n >= k of them) selects the
same finite visible entries as the whole row does. A causal prefill's row s sees ~s / ratio entries: about half the
reads (H200, session 22: tests/gpu/test_topk_triton.py's masked cases bit-identical; 16K prefill step 127.41 -> 125.35
ms, the indexer op 13.94 -> 12.60).
STATUS: interpreter on CPU (tests/test_kernels_topk_triton.py); H200 run 26 (2026-12-02): tests/gpu/test_topk_triton.py 10
passed; 32 x 6 rows x 131,072 entries 1.01 ms (16-bit keys) / 1.29 (32-bit) against lax.top_k + sort 2.64 (host wall
time per call; kernel busy time 0.44 ms, run 32). The front end sends rows of >= ``dispatch.TOPK_SPLIT_MIN_ENTRIES``
to ``topk_split_triton``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose signed order is the IEEE total order."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _next_digit(hist, krem, pre, p: tl.constexpr):
    """One radix step: from byte ``p``'s histogram [256] of the keys matching ``pre``, the k-th largest key's byte
    (the largest whose suffix count still reaches ``krem``) -> (prefix with that byte, k left among its ties)."""
    bins = tl.arange(0, 256)
    suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist          # keys >= each byte; falls with the byte
    digit = tl.sum((suffix >= krem).to(tl.int32), 0) - 1
    krem -= tl.sum(tl.where(bins > digit, hist, 0), 0)
    if p == 0:
        pre = (digit ^ 128) << 24                                  # back to the signed key's top byte
    else:
        pre = pre | (digit << (24 - 8 * p))
    return pre, krem


@triton.jit
def _byte(key, p: tl.constexpr):
    """Byte ``p`` (0 = top) of the key in unsigned order."""
    if p == 0:
        return ((key >> 24) & 255) ^ 128
    return (key >> (24 - 8 * p)) & 255


@triton.jit
def _tile_selection(x, inb, thr, ties, krem, low: tl.constexpr):
    """A tile's selection: every key above the threshold ``thr`` and the ties whose rank (``ties`` seen before the
    tile + in-tile count) is within the ``krem`` to take -> (mask, ties in the tile)."""
    key = _ordered_key(x) >> low
    tie = (inb & (key == thr)).to(tl.int32)
    sel = (inb & (key > thr)) | ((tie > 0) & (ties + tl.cumsum(tie, 0) <= krem))
    return sel, tl.sum(tie, 0)


@triton.jit
def _topk_kernel(score_ptr, vis_ptr, out_ptr, T: tl.constexpr, stride: tl.constexpr, K: tl.constexpr, PASSES: tl.constexpr,
                 BLOCK: tl.constexpr, MODE: tl.constexpr, VIS_BOUND: tl.constexpr = 0):
    r = tl.program_id(0)
    row = score_ptr + r.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    if VIS_BOUND:      # entries past visible are -inf: the first max(visible, K) decide (module doc)
        n = tl.minimum(tl.maximum(tl.load(vis_ptr + r), K), T)
    else:
        n = T
    pre = tl.zeros([], tl.int32)       # the threshold's bits found so far (signed-key representation)
    krem = tl.full([], K, tl.int32)    # how many of the k are still to find among the keys matching ``pre``
    for p in tl.static_range(PASSES):
        hist = tl.zeros([256], tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + lanes
            inb = offs < n
            key = _ordered_key(tl.load(row + offs, mask=inb, other=0.0))
            match = inb if p == 0 else inb & ((key >> (32 - 8 * p)) == (pre >> (32 - 8 * p)))
            hist += tl.histogram(_byte(key, p), 256, mask=match)
        pre, krem = _next_digit(hist, krem, pre, p)
    low: tl.constexpr = 32 - 8 * PASSES                # key bits below the search: ignored
    thr = pre >> low
    if MODE == 0:
        vis = tl.load(vis_ptr + r)
        out_row = out_ptr + r.to(tl.int64) * K
    else:
        out_row = out_ptr + r.to(tl.int64) * stride
    ties = tl.zeros([], tl.int32)
    count = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        inb = offs < n
        x = tl.load(row + offs, mask=inb, other=0.0)
        sel, nt = _tile_selection(x, inb, thr, ties, krem, low)
        ties += nt
        if MODE == 0:
            ok = (sel & (x > float("-inf")) & (offs < vis)).to(tl.int32)
            tl.store(out_row + count + tl.cumsum(ok, 0) - 1, offs, mask=ok > 0)
            count += tl.sum(ok, 0)
        else:
            tl.store(out_row + offs, sel.to(tl.int8), mask=inb)
    if MODE == 0:
        for start in range(0, K, BLOCK):
            slot = start + lanes
            tl.store(out_row + slot, tl.full([BLOCK], -1, tl.int32), mask=(slot >= count) & (slot < K))


def _block(T: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(T)))


def kernel_args(score, k: int, *, key_bits: int = 32, mode: int = 0, masked: bool = False):
    """(rows [R, T] fp32, constexprs, grid, warps) for ``_topk_kernel`` on ``score`` [..., T]. ``masked``: entries at
    t >= visible are -inf, so each row is read up to max(visible, k) only (MODE 0)."""
    if masked and mode != 0:
        raise ValueError("masked=True is for the selection (mode 0): the mask mode writes every entry of the row")
    if key_bits not in (16, 32):
        raise ValueError(f"key_bits must be 16 or 32, got {key_bits}")
    T = score.shape[-1]
    if not 1 <= k <= T:
        raise ValueError(f"k must be in [1, T={T}], got {k}")
    rows = score.reshape(-1, T).astype(jnp.float32)
    const = dict(T=T, stride=T, K=k, PASSES=key_bits // 8, BLOCK=_block(T), MODE=mode, VIS_BOUND=int(masked))
    return rows, const, (rows.shape[0],), 8 if T >= 4096 else 4


READ_TO_VISIBLE = True   # honour ``masked`` (off: whole rows always; the step profile's A/B variant "moeil_fullrows")


def select_topk_triton(score, visible, topk: int, *, key_bits: int = 32, masked: bool = False):
    """== topk_select.select_topk_threshold (== indexer_topk.select_topk_sorted): [..., T] -> [..., min(topk, T)]
    int32 ascending positions, -1 after. ``key_bits=16``: only for bf16-valued scores. ``masked``: only for scores
    that are -inf at t >= visible (the indexer's scorers'); each row is then read up to max(visible, topk)."""
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only
    T = score.shape[-1]
    k = min(topk, T)
    rows, const, grid, nw = kernel_args(score, k, key_bits=key_bits, mode=0, masked=masked and READ_TO_VISIBLE)
    vis = jnp.broadcast_to(visible, score.shape[:-1]).reshape(-1).astype(jnp.int32)
    out = jt.triton_call(rows, vis, kernel=_topk_kernel, out_shape=jax.ShapeDtypeStruct((rows.shape[0], k),
                         jnp.int32), grid=grid, num_warps=nw, num_stages=2, **const)
    return out.reshape(*score.shape[:-1], k)


def topk_mask_triton(score, k: int, *, key_bits: int = 32):
    """== topk_select.topk_mask: [..., T] bool, the entries lax.top_k(score, k) returns."""
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only
    rows, const, grid, nw = kernel_args(score, k, key_bits=key_bits, mode=1)
    vis = jnp.zeros((rows.shape[0],), jnp.int32)      # unused in MODE 1
    out = jt.triton_call(rows, vis, kernel=_topk_kernel, out_shape=jax.ShapeDtypeStruct(rows.shape, jnp.int8),
                         grid=grid, num_warps=nw, num_stages=2, **const)
    return out.reshape(score.shape) != 0


def candidate_mask_triton(score, visible, block_size: int, topk_blocks: int, *, key_bits: int = 32):
    """== topk_select.candidate_mask_threshold, the block threshold by the kernel."""
    from dsflash.kernels.topk_select import block_scores
    T = score.shape[-1]
    block = block_scores(score, visible, block_size)
    keep = topk_mask_triton(block, min(topk_blocks, block.shape[-1]), key_bits=key_bits) & (block > -jnp.inf)
    return jnp.repeat(keep, block_size, axis=-1)[..., :T]
