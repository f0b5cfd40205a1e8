"""The Triton radix top-k of ``topk_triton`` with each row split over several programs (long rows).

Why: ``topk_triton`` runs one program per row, and at 32 x 6 rows x 131,072 entries its 192 programs walk 32 tiles
each serially (load -> ballot histogram -> barrier): 1.01 ms on an H200 (run 26) where reading the 100 MB of scores
three times needs ~0.07 ms. Here a row's CHUNK-entry chunks are separate programs, and the passes are launches:
  pass p (grid rows x chunks): the threshold's prefix so far from the row histograms of passes < p (256 counts
      each, summed by atomics), then this chunk's histogram of byte p over the keys matching it, atomically added
      to the row's histogram of pass p; the last pass also stores the chunk's own histogram (for the tie ranks).
  select (rows x chunks): the threshold and the ties to take from the row histograms; the ties of earlier chunks
      from their last-pass histograms at the threshold's byte; then the chunk's selection: the mask (MODE 1), or the
      chosen entries with score > -inf and t < visible, ascending into the chunk's slots of a [rows, chunks, k + 1]
      scratch with their count (MODE 0; slot k is a spare that masked-off lanes aim at).
  compact (rows; MODE 0): the chunks' lists one after another into out[row, :k], -1 after.
Counts are integers, so the atomics' order cannot change a bit: the same output as ``topk_triton`` and
``lax.top_k`` (the interpreter check scripts/triton_interpret_topk.py runs both).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.topk_triton import _block, _byte, _next_digit, _ordered_key, _tile_selection

CHUNK = 8192          # entries per program (2 tiles of 4,096): 16 programs a row at 131,072 entries


@triton.jit
def _prefix(hrow_ptr, r, R: tl.constexpr, NP: tl.constexpr, K: tl.constexpr):
    """The threshold's prefix and the k left after the first NP passes, from the row histograms [PASSES, R, 256]."""
    bins = tl.arange(0, 256)
    pre = tl.zeros([], tl.int32)
    krem = tl.full([], K, tl.int32)
    for q in tl.static_range(NP):
        pre, krem = _next_digit(tl.load(hrow_ptr + (q * R + r) * 256 + bins), krem, pre, q)
    return pre, krem


@triton.jit
def _pass_kernel(score_ptr, hrow_in, hchunk_in, hrow_ptr, hchunk_ptr, T: tl.constexpr, R: tl.constexpr,
                 C: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr,
                 PASSES: tl.constexpr, K: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = score_ptr + r.to(tl.int64) * T
    lanes = tl.arange(0, BLOCK)
    pre, krem = _prefix(hrow_ptr, r, R, P, K)
    hist = tl.zeros([256], tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + start + lanes
        inb = offs < T
        key = _ordered_key(tl.load(row + offs, mask=inb, other=0.0))
        match = inb if P == 0 else inb & ((key >> (32 - 8 * P)) == (pre >> (32 - 8 * P)))
        hist += tl.histogram(_byte(key, P), 256, mask=match)
    bins = tl.arange(0, 256)
    tl.atomic_add(hrow_ptr + (P * R + r) * 256 + bins, hist)
    if P == PASSES - 1:
        tl.store(hchunk_ptr + (r * C + c) * 256 + bins, hist)


@triton.jit
def _select_kernel(score_ptr, vis_ptr, hrow_ptr, hchunk_ptr, out_ptr, count_ptr, T: tl.constexpr, R: tl.constexpr,
                   C: tl.constexpr, CP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                   PASSES: tl.constexpr, K: tl.constexpr, MODE: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = score_ptr + r.to(tl.int64) * T
    lanes = tl.arange(0, BLOCK)
    pre, krem = _prefix(hrow_ptr, r, R, PASSES, K)
    low: tl.constexpr = 32 - 8 * PASSES
    thr = pre >> low
    last = _byte(pre, PASSES - 1)                                  # the threshold's byte in the last pass
    cs = tl.arange(0, CP)
    ties = tl.sum(tl.load(hchunk_ptr + (r * C + cs) * 256 + last, mask=cs < c, other=0), 0)   # in chunks < c
    if MODE == 0:
        vis = tl.load(vis_ptr + r)
        slots = out_ptr + (r * C + c).to(tl.int64) * (K + 1)
    count = tl.zeros([], tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + start + lanes
        inb = offs < T
        x = tl.load(row + offs, mask=inb, other=0.0)
        sel, nt = _tile_selection(x, inb, thr, ties, krem, low)
        ties += nt
        if MODE == 0:
            ok = (sel & (x > float("-inf")) & (offs < vis)).to(tl.int32)
            # masked-off lanes aim at the spare slot K, never at another lane's slot or outside the buffer
            tl.store(slots + tl.where(ok > 0, count + tl.cumsum(ok, 0) - 1, K), offs, mask=ok > 0)
            count += tl.sum(ok, 0)
        else:
            tl.store(out_ptr + r.to(tl.int64) * T + offs, sel.to(tl.int8), mask=inb)
    if MODE == 0:
        tl.store(count_ptr + r * C + c, count)


@triton.jit
def _compact_kernel(slots_ptr, count_ptr, out_ptr, C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    r = tl.program_id(0)
    j = tl.arange(0, KP)
    off = tl.zeros([], tl.int32)
    for c in range(C):
        n = tl.load(count_ptr + r * C + c)
        v = tl.load(slots_ptr + (r * C + c).to(tl.int64) * (K + 1) + j, mask=j < n, other=0)
        tl.store(out_ptr + r * K + off + j, v, mask=j < n)
        off += n
    tl.store(out_ptr + r * K + j, tl.full([KP], -1, tl.int32), mask=(j >= off) & (j < K))


def plan(T: int, k: int, *, key_bits: int = 32, chunk: int = CHUNK) -> dict:
    """Chunks, tiles and passes of one call (pure Python)."""
    if key_bits not in (16, 32):
        raise ValueError(f"key_bits must be 16 or 32, got {key_bits}")
    if not 1 <= k <= T:
        raise ValueError(f"k must be in [1, T={T}], got {k}")
    block = _block(min(T, chunk))
    chunk = -(-min(chunk, T) // block) * block
    C = -(-T // chunk)
    return dict(C=C, CP=triton.next_power_of_2(C), CHUNK=chunk, BLOCK=block, PASSES=key_bits // 8, K=k,
                KP=triton.next_power_of_2(k))


def _launches(call, rows, vis, k, key_bits, mode, chunk):
    """The launch sequence. ``call(kernel, grid, args, out_shapes, aliases, num_warps, **constexprs)`` -> outputs
    runs one kernel: ``triton_call`` on the GPU (``_jt_call``), numpy buffers in the interpreter check."""
    R, T = rows.shape
    pl = plan(T, k, key_bits=key_bits, chunk=chunk)
    C, P = pl["C"], pl["PASSES"]
    nw = 8 if pl["BLOCK"] >= 4096 else 4
    hrow = jnp.zeros((P, R, 256), jnp.int32)
    hchunk = jnp.zeros((R, C, 256), jnp.int32)
    common = dict(T=T, R=R, C=C, CHUNK=pl["CHUNK"], BLOCK=pl["BLOCK"], PASSES=P, K=k)
    hists = [jax.ShapeDtypeStruct(hrow.shape, jnp.int32), jax.ShapeDtypeStruct(hchunk.shape, jnp.int32)]
    for p in range(P):
        hrow, hchunk = call(_pass_kernel, (R, C), (rows, hrow, hchunk), hists, {1: 0, 2: 1}, nw, P=p, **common)
    outs = ([jax.ShapeDtypeStruct((R, C, k + 1), jnp.int32), jax.ShapeDtypeStruct((R, C), jnp.int32)] if mode == 0
            else [jax.ShapeDtypeStruct((R, T), jnp.int8), jax.ShapeDtypeStruct((1,), jnp.int32)])
    sel, count = call(_select_kernel, (R, C), (rows, vis, hrow, hchunk), outs, {}, nw, CP=pl["CP"], MODE=mode,
                      **common)
    if mode == 1:
        return sel
    return call(_compact_kernel, (R,), (sel, count), [jax.ShapeDtypeStruct((R, k), jnp.int32)], {}, 4, C=C, K=k,
                KP=pl["KP"])[0]


def _jt_call(kernel, grid, args, outs, aliases, num_warps, **const):
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only
    r = jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=outs, input_output_aliases=aliases or None,
                       num_warps=num_warps, num_stages=2, **const)
    return list(r) if isinstance(r, (list, tuple)) else [r]


def select_topk_split(score, visible, topk: int, *, key_bits: int = 32, chunk: int = CHUNK):
    """== topk_triton.select_topk_triton, a row over several programs."""
    T = score.shape[-1]
    k = min(topk, T)
    rows = score.reshape(-1, T).astype(jnp.float32)
    vis = jnp.broadcast_to(visible, score.shape[:-1]).reshape(-1).astype(jnp.int32)
    return _launches(_jt_call, rows, vis, k, key_bits, 0, chunk).reshape(*score.shape[:-1], k)


def topk_mask_split(score, k: int, *, key_bits: int = 32, chunk: int = CHUNK):
    """== topk_triton.topk_mask_triton, a row over several programs."""
    rows = score.reshape(-1, score.shape[-1]).astype(jnp.float32)
    vis = jnp.zeros((rows.shape[0],), jnp.int32)
    return _launches(_jt_call, rows, vis, k, key_bits, 1, chunk).reshape(score.shape) != 0


def candidate_mask_split(score, visible, block_size: int, topk_blocks: int, *, key_bits: int = 32):
    """== topk_triton.candidate_mask_triton, a row over several programs."""
    from dsflash.kernels.topk_select import block_scores
    T = score.shape[-1]
    block = block_scores(score, visible, block_size)
    keep = topk_mask_split(block, min(topk_blocks, block.shape[-1]), key_bits=key_bits) & (block > -jnp.inf)
    return jnp.repeat(keep, block_size, axis=-1)[..., :T]
