"""Load-time weight layout "il" for the routed experts' MXFP4 weights (pure JAX / numpy, no Triton): the packed E2M1
nibbles and UE8M0 scales re-arranged once, when the checkpoint is placed, so that the Triton decode kernel
(``kernels/experimental/moe_layout_kernels.py``, mma "swap_il") turns 8 nibbles into four MMA-ready bf16x2
registers with ~2 instructions per weight element instead of ~4.3 (NOTES.md, "2026-12-03: load-time layout").

The layout (per weight row, per 128-wide K slab = 64 bytes, the kernel's BK):

* Weights: 32 little-endian uint16 halfwords, halfword ``8c + 2kk + q`` (c, kk in 0..3, q in 0..1). The pair of
  halfwords (q = 0, 1) is one 32-bit register; thread column c of a Hopper wgmma A fragment reads its 4 words as one
  16-byte load. Halfword (c, kk, q) holds the four elements K = 32 kk + 16 h + 4 c + 2 q + p (h, p in 0..1) -- the
  elements a thread feeds to the even (p = 0) / odd (p = 1) K-plane MMAs of ``swap_eo`` -- as 4 nibbles with their
  bits scattered so that one shift + mask puts three of them in place as bf16 bit patterns: an E2M1 nibble's three
  magnitude bits at bf16 bits 6-8 and its sign at bit 15 are exactly value * 2^-126 (the subnormal 0.5 included),
  see ``SRC``. Lane q of output X in (A, B, C, D) = (h0 p0, h1 p0, h0 p1, h1 p1).
* Scales: one uint32 per (row, slab), byte kk = the bf16 exponent field of 2^(s - 1) for the group's UE8M0 s,
  i.e. s + 126 (the kernel multiplies the value * 2^-126 pattern by 2^(s - 1): one bf16x2 multiply per two weights,
  exact). s = 0 stays 0 (the default kernels also read scale 0 as 0); s > 128 cannot be written that way and is
  stored as 255 (bf16 +inf: outputs become inf / NaN, never plausible numbers) -- ``check_scales`` refuses such
  weights at load time. s <= 128 means every weight magnitude is <= 12; real checkpoints sit at s ~ 110-125.

The kernel loads a 64-row block with its rows permuted (``kernels/experimental/moe_layout_kernels._il_rows``) so that
Triton's coalesced load layout is the wgmma A-operand layout up to a register renaming; that is an in-kernel
addressing choice, rows stay in their natural order here.

``repack`` is the pure forward map, ``to_checkpoint`` its inverse (exact on the domain), ``decode`` the host model of
the kernel's decode (the same bit operations, in numpy), ``check_scales`` the load-time domain check.
"""
from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp

BK = 128            # K slab of the layout (the kernel's BK)
BN = 64             # weight rows per program the kernel's row permutation is written for
HALF = 32           # halfwords per (row, slab)
# bf16 bit of each nibble bit (role 0: mantissa, 1-2: exponent, 3: sign) in an output lane
TARGET = (6, 7, 8, 15)
# source bit of (output X, role) inside a halfword: X = A, B, C take the lane's target bits shifted by 0 / 3 / 6
# (one mask 0x81C0 each after a left shift of 0 / 3 / 6); D takes the remaining bits 10, 11, 13, 14 (three pieces)
SRC = ((6, 7, 8, 15),       # A: v & 0x81C0
       (3, 4, 5, 12),       # B: (v << 3) & 0x81C0
       (0, 1, 2, 9),        # C: (v << 6) & 0x81C0
       (10, 11, 13, 14))    # D: ((v >> 4) & 0xC0) | ((v >> 5) & 0x100) | ((v << 1) & 0x8000)
# output X of element (h, p): A = (0, 0), B = (1, 0), C = (0, 1), D = (1, 1)
OUT = ((0, 2), (1, 3))
MAX_SCALE = 128     # largest UE8M0 scale the layout represents exactly

# The kernel's decode (inline PTX, elementwise over halfword pairs): $4 = one 32-bit word = halfwords q = 0 (bits
# 0-15) and q = 1 of one (c, kk) of a row's slab;
# $5 = the group's bf16 2^(s - 1) in both lanes; outputs A, B, C, D = (h0 p0), (h1 p0), (h0 p1), (h1 p1)
IL_ASM = """
{
.reg .b32 t, u, v;
and.b32 t, $4, 0x81C081C0;
mul.rn.bf16x2 $0, t, $5;
shl.b32 t, $4, 3;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $5;
shl.b32 t, $4, 6;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, $5;
shr.b32 t, $4, 4;
and.b32 t, t, 0x00C000C0;
shr.b32 u, $4, 5;
and.b32 u, u, 0x01000100;
shl.b32 v, $4, 1;
and.b32 v, v, 0x80008000;
or.b32 t, t, u;
or.b32 t, t, v;
mul.rn.bf16x2 $3, t, $5;
}
"""


def _check_src(src=SRC):
    bits = sorted(b for x in src for b in x)
    assert bits == list(range(16)), bits


_check_src()


def _unpack_codes(w):
    """int8 / uint8 [..., N, K/2] (low nibble = even K) -> uint8 codes [..., N, K]."""
    u = jax.lax.bitcast_convert_type(w, jnp.uint8) if w.dtype == jnp.int8 else w.astype(jnp.uint8)
    lo, hi = u & 0xF, u >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])


def repack(w, s, src=SRC):
    """Checkpoint MXFP4 (``w`` int8 [..., N, K/2] low nibble first, ``s`` UE8M0 uint8 [..., N, K/32]) -> the "il"
    layout: (halfwords uint16 [..., N, K/4], scale words uint32 [..., N, K/128]). Pure and jit-able; K must be a
    multiple of 128. ``src`` is the bit table (a parameter only so that tests can plant a wrong one)."""
    *lead, n, kh = w.shape
    K = 2 * kh
    if K % BK:
        raise ValueError(f"the il layout needs K divisible by {BK}; got K={K}")
    if tuple(s.shape) != (*lead, n, K // 32):
        raise ValueError(f"scale shape {tuple(s.shape)} does not match weights {tuple(w.shape)}")
    return _repack(w, s, src)


@functools.partial(jax.jit, static_argnums=(2,))
def _repack(w, s, src):
    *lead, n, kh = w.shape
    K = 2 * kh
    c = _unpack_codes(w).astype(jnp.uint16)                        # 16-bit throughout: half the memory on device
    # K = 128 slab + 32 kk + 16 h + 4 c + 2 q + p
    c = c.reshape(*lead, n, K // BK, 4, 2, 4, 2, 2)                # [.., slab, kk, h, c, q, p]
    hw = jnp.zeros(c.shape[:-5] + (4, 4, 2), jnp.uint16)           # [.., slab, c, kk, q]
    for h in range(2):
        for p in range(2):
            code = jnp.moveaxis(c[..., h, :, :, p], -3, -2)        # [.., slab, c, kk, q]
            for role, pos in enumerate(src[OUT[h][p]]):
                hw = hw | (((code >> role) & 1) << pos).astype(jnp.uint16)
    wh = hw.reshape(*lead, n, K // 4)
    sp = s.astype(jnp.uint32)
    sp = jnp.where(sp == 0, 0, jnp.where(sp > MAX_SCALE, 255, sp + 126))
    sp = sp.reshape(*lead, n, K // BK, 4)
    sw = sp[..., 0] | (sp[..., 1] << 8) | (sp[..., 2] << 16) | (sp[..., 3] << 24)
    return wh, sw.astype(jnp.uint32)


def to_checkpoint(wh, sw, src=SRC):
    """Inverse of ``repack`` (exact for scales <= 128; a poisoned scale comes back as 255)."""
    return _to_checkpoint(wh, sw, src)


@functools.partial(jax.jit, static_argnums=(2,))
def _to_checkpoint(wh, sw, src):
    *lead, n, kq = wh.shape
    K = 4 * kq
    hw = wh.astype(jnp.uint32).reshape(*lead, n, K // BK, 4, 4, 2)   # [.., slab, c, kk, q]
    code = jnp.zeros((*lead, n, K // BK, 4, 2, 4, 2, 2), jnp.uint32)  # [.., slab, kk, h, c, q, p]
    for h in range(2):
        for p in range(2):
            v = jnp.zeros(hw.shape, jnp.uint32)
            for role, pos in enumerate(src[OUT[h][p]]):
                v = v | (((hw >> pos) & 1) << role)
            code = code.at[..., h, :, :, p].set(jnp.moveaxis(v, -2, -3))
    code = code.reshape(*lead, n, K // 2, 2)
    w = (code[..., 0] | (code[..., 1] << 4)).astype(jnp.uint8)
    sp = sw.astype(jnp.uint32)[..., None] >> jnp.array([0, 8, 16, 24], jnp.uint32)
    sp = (sp & 0xFF).reshape(*lead, n, K // 32)
    s = jnp.where(sp == 0, 0, jnp.where(sp == 255, 255, sp - 126)).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(w, jnp.int8), s


def is_il(w) -> bool:
    """Whether a routed-expert weight array is in the il layout (uint16 halfwords; checkpoints hold int8)."""
    return jnp.dtype(w.dtype) == jnp.uint16


def check_scales(s) -> None:
    """Load-time domain check (host, concrete arrays): ValueError if a scale is above 128 (not representable in the
    il layout's one-multiply scaling), naming the count. Use the checkpoint layout (the default kernels) then."""
    a = np.asarray(s)
    bad = int(np.count_nonzero(a > MAX_SCALE))
    if bad:
        raise ValueError(f"{bad} UE8M0 scales exceed {MAX_SCALE} (max {int(a.max())}): the il MoE weight layout "
                         f"represents groups with |w| <= 12 only; keep the checkpoint layout for these weights")


def decode(wh, sw):
    """Host model of the kernel's decode (numpy, the same bit operations as ``_il_decode_tl`` / the inline PTX):
    il arrays -> float32 weights [..., N, K] in natural K order, value * 2^(s - 127)."""
    v = np.asarray(wh).astype(np.uint32)
    outs = [v & 0x81C0, (v << 3) & 0x81C0, (v << 6) & 0x81C0,
            ((v >> 4) & 0xC0) | ((v >> 5) & 0x100) | ((v << 1) & 0x8000)]
    *lead, n, kq = v.shape
    K = 4 * kq
    f = np.asarray(sw).astype(np.uint32)[..., None] >> np.array([0, 8, 16, 24], np.uint32)
    f = ((f & 0xFF) << 23).view(np.float32)                       # 2^(s - 1) as f32 (bf16 exponent field s + 126)
    f = f.reshape(*lead, n, K // BK, 1, 4, 1)                      # per (slab, c, kk, q): group kk
    with np.errstate(invalid="ignore"):          # 0 * inf in a poisoned group: nan, as in the kernel
        vals = [((x << 16).view(np.float32).reshape(*lead, n, K // BK, 4, 4, 2) * f) for x in outs]
    out = np.zeros((*lead, n, K // BK, 4, 2, 4, 2, 2), np.float32)   # [.., slab, kk, h, c, q, p]
    for h in range(2):
        for p in range(2):
            out[..., h, :, :, p] = np.moveaxis(vals[OUT[h][p]], -2, -3)
    return out.reshape(*lead, n, K)


def repack_experts(w1, s1, w3, s3, w2, s2, check=True):
    """The six routed-expert arrays -> il layout (``check``: ``check_scales`` first; needs concrete arrays)."""
    if check:
        for s in (s1, s3, s2):
            check_scales(s)
    return (*repack(w1, s1), *repack(w3, s3), *repack(w2, s2))


# ------------------------------------------------------------------------------------------ tile-major il
# Session 28, experimental (config ``tile_major``, mma "swap_il" only; revived in session 30): the il arrays with each
# (64-row block, slab) tile made contiguous. A swap_il program reads, per K step, the 64-byte slab of each of its 64
# rows: 64 pieces K / 2 bytes apart in the row-major il layout (64 concurrent row streams a program: 512 an SM in the
# up kernel at 4 programs x 2 matrices). Tile-major puts those 64 x 64 bytes in one 4 KB run and the block's 64 scale
# words in one 256-byte run. Level 1: the scale words in memory row order (the kernel, which reads rows in
# ``_il_rows``' permuted order, then makes 64 separate 4-byte copies of the run); level 2 (session 30, "blocked
# scales"): in the kernel's load order (``LOAD_ROWS``), so a step's scale read is contiguous in address order; the
# weight runs are level 1's. (The sm_90 compile still copies the words one 4-byte LDGSTS each at both levels: Triton
# spreads 64 words over 128 threads; a warp's 32 words touch 4 sectors at either level.) Session 30's hypothesis,
# NOT yet measured on a GPU: the number of concurrent row streams an SM caps the il kernels' load stream (the up
# kernel's loads alone 1.79 TB/s, the down kernel's 2.4-2.5).
# Pure permutations: same shapes and dtypes, so nothing tells tiled weights from plain ones (or one level from the
# other) -- the caller pairs them with a config of that ``tile_major`` level.

# memory row (within a 64-row block) of the kernel's load-order row rho: ``moe_layout_kernels._il_rows``
LOAD_ROWS = np.array([(r & 7) | (((r >> 5) & 1) << 3) | (((r >> 3) & 3) << 4) for r in range(BN)], np.int32)


def to_tiles(w_il, s_il, bn=BN, level=1):
    """il arrays (halfwords [..., N, K/4], scale words [..., N, K/128]) -> the same shapes, tile-major: row block nb
    (``bn`` rows) and slab j at halfword ((nb * (K/128) + j) * bn + r) * 32 + c and scale word
    (nb * (K/128) + j) * bn + r, rows r in natural order; ``level`` 2: scale word (nb * (K/128) + j) * bn + rho holds
    row ``LOAD_ROWS[rho]``'s (the kernel's load order; needs bn = 64)."""
    _check_level(level, bn)
    w, s = _tile_permute(w_il, HALF, bn, to_tiles=True), _tile_permute(s_il, 1, bn, to_tiles=True)
    if level == 2:
        s = _rows_in_run(s, bn, LOAD_ROWS)
    return w, s


def from_tiles(w_tm, s_tm, bn=BN, level=1):
    """Inverse of ``to_tiles`` (same ``level``)."""
    _check_level(level, bn)
    if level == 2:
        s_tm = _rows_in_run(s_tm, bn, np.argsort(LOAD_ROWS).astype(np.int32))
    return _tile_permute(w_tm, HALF, bn, to_tiles=False), _tile_permute(s_tm, 1, bn, to_tiles=False)


def _check_level(level, bn):
    if level not in (1, 2):
        raise ValueError(f"tile-major level is 1 (scale words in row order) or 2 (in the kernel's load order); got "
                         f"{level!r}")
    if level == 2 and bn != BN:
        raise ValueError(f"level 2 stores the scale words in the kernel's {BN}-row load order: bn must be {BN}")


def _rows_in_run(s, bn, order):
    """Scale words of tile-major ``s`` [..., N, KW]: within each run of ``bn`` words (a tile's rows), word i <- word
    ``order[i]``."""
    flat = jnp.reshape(s, (*s.shape[:-2], -1, bn))
    return jnp.take(flat, jnp.asarray(order), axis=-1).reshape(s.shape)


def _tile_permute(a, per_slab, bn, to_tiles):
    """[..., N, KW * per_slab] between row-major [nb, r, j, c] and tile-major [nb, j, r, c] (c < per_slab)."""
    *lead, n, cols = a.shape
    if n % bn or cols % per_slab:
        raise ValueError(f"tile-major il needs N divisible by {bn} and {per_slab} entries a slab; got shape "
                         f"{tuple(a.shape)}")
    kw = cols // per_slab
    nl = len(lead)
    src = (*lead, n // bn, bn, kw, per_slab) if to_tiles else (*lead, n // bn, kw, bn, per_slab)
    perm = (*range(nl), nl, nl + 2, nl + 1, nl + 3)           # swap the row and slab axes (its own inverse)
    return jnp.transpose(jnp.reshape(a, src), perm).reshape(a.shape)


def tile_experts(w1, s1, w3, s3, w2, s2, level=1):
    """The six il arrays of ``repack_experts`` -> tile-major (``to_tiles`` on each matrix, at ``level``)."""
    return (*to_tiles(w1, s1, level=level), *to_tiles(w3, s3, level=level), *to_tiles(w2, s2, level=level))
