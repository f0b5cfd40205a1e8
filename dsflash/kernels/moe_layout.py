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
