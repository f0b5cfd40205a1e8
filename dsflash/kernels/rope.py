"""The rotary embedding's arithmetic, shared by the model (``layers.apply_rope``) and the attention front-ends,
which apply it to q on the way in and its inverse to o on the way out (``sparse_attention.sparse_sink_attention``'s
``rope``; the one-split flash kernel can do both itself, on the 64-channel tails, so that q and o are not re-written
by a concatenation in HBM: ``sparse_attention_triton.ROPE_IN_KERNEL``).

``rope_table(pos, omega)``: (cos, sin) of pos * omega, fp32, shape pos.shape + [rd / 2].
``rotate_tail(x, cos, sin, inverse)``: the last rd = 2 * cos.shape[-1] channels of x, pairs (2i, 2i + 1), rotated
by the table (the conjugate if ``inverse``) in fp32 and rounded to x.dtype; the other channels unchanged.
``rope_q`` / ``rope_o`` / ``check_rope``: the same for attention's q and o [B, S, H, D] and a (cos, sin) table of the
rows [B, S, rd / 2], as the attention front-ends take it (``sparse_attention``'s ``rope``)."""
from __future__ import annotations

import jax.numpy as jnp


def rope_table(pos, omega):
    ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(omega)
    return jnp.cos(ang), jnp.sin(ang)


def rotate_tail(x, c, s, inverse=False):
    rd = 2 * c.shape[-1]
    if inverse:
        s = -s
    head, tail = x[..., :-rd], x[..., -rd:].astype(jnp.float32)
    t = tail.reshape(*tail.shape[:-1], rd // 2, 2)
    x0, x1 = t[..., 0], t[..., 1]
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    rot = jnp.stack([r0, r1], axis=-1).reshape(tail.shape).astype(x.dtype)
    return jnp.concatenate([head, rot], axis=-1)


def rope_q(q, rope):
    """q [B, S, H, D] with ``rope`` (cos, sin [B, S, rd/2]) applied (None: q as it is)."""
    return q if rope is None else rotate_tail(q, rope[0][:, :, None], rope[1][:, :, None])


def rope_o(o, rope):
    """o [B, S, H, D] with the inverse of ``rope`` applied (None: o as it is)."""
    return o if rope is None else rotate_tail(o, rope[0][:, :, None], rope[1][:, :, None], inverse=True)


def check_rope(rope, q):
    """Raise ValueError unless ``rope`` is None or (cos, sin) of shape [B, S, rd/2] with 0 < rd <= D."""
    if rope is None:
        return
    B, S, _, D = q.shape
    c, s = rope
    if c.shape != s.shape or c.ndim != 3 or c.shape[:2] != (B, S) or not 0 < 2 * c.shape[2] <= D:
        raise ValueError(f"rope must be (cos, sin), each [B={B}, S={S}, rd/2] with rd <= D={D}, got "
                         f"{c.shape} / {s.shape}")
