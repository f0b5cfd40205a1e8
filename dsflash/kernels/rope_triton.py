"""Triton (jax-triton) RoPE on the tails of attention's q and o, in place: ``rope.rope_q`` / ``rope.rope_o`` without
re-writing the other channels.

Why: around the sparse attention kernel the model rotates q's last rd = 64 of its 512 channels on the way in and
applies the inverse to o on the way out. In XLA that is ``concatenate([head, rotated tail])``, which reads and writes
all of q or o: eight fusions of 0.61 ms in a 16,384-token prefill step on an H200 (4.9 ms, 4 % of the step; session
22's profile), to move 1/8 of the channels. RoPE inside the flash kernel removed them but cost the kernel about as much
(session 22). Here one small kernel reads the tails and writes them back into the same buffer
(``input_output_aliases``): 1/8 of the bytes, and XLA keeps the buffer in place when nothing else reads it.

Arithmetic: ``rope.rotate_tail``'s -- pair (2i, 2i + 1) of the tail, (x0 c - x1 s, x0 s + x1 c) in fp32 (s negated
for the inverse), rounded to the buffer's dtype. Compiled without FMA contraction (``enable_fp_fusion=False``), so each
product and difference is rounded as the jnp expression rounds it. ``ROUND`` 1 rounds to bf16 by the integer RNE
(``triton_common._bf16_rne``: Triton's interpreter truncates in casts); 0 on a GPU, where the cast itself rounds.
Checked in Triton's interpreter (``scripts/triton_interpret_rope.py``: bits against ``rotate_tail``, the head channels
untouched) and on one H100 (session 23: tests/gpu/test_rope_triton.py, 0 bits differing from unfused fp32 arithmetic;
the 16,384-token prefill step 127.09 -> 123.93 ms). ``sparse_attention_triton.ROPE_INPLACE`` turns it on / off.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from dsflash.kernels.triton_common import _bf16_rne


@triton.jit
def _rope_tail(src_rows, c_row, s_row, D: tl.constexpr, RD: tl.constexpr, INVERSE: tl.constexpr,
               ROUND: tl.constexpr):
    """``rope.rotate_tail``'s rotated tail of the rows at ``src_rows`` (pointers [HG, 1] to rows of D channels):
    [HG, RD] fp32, their last RD channels, pair (2i, 2i + 1) rotated by this query row's (cos_i, sin_i) (the
    conjugate if INVERSE) in fp32, RNE to bf16 values if ROUND (the integer form: the interpreter's casts truncate).
    Only the tails move through registers (HG x RD elements, each channel's pair partner loaded again): rotating the
    [HG, D] q tile in registers made Triton keep q as a register MMA operand on sm_90 (spills, 20 % more
    instructions a loop step), and splitting o's pairs in registers went through shared memory."""
    j = tl.arange(0, RD)
    c = tl.load(c_row + j // 2)[None, :]
    s = tl.load(s_row + j // 2)[None, :]
    if INVERSE:
        s = -s
    x = tl.load(src_rows + (D - RD) + j[None, :]).to(tl.float32)
    p = tl.load(src_rows + (D - RD) + (j ^ 1)[None, :]).to(tl.float32)
    r = tl.where(((j & 1) == 0)[None, :], x * c - p * s, p * s + x * c)
    if ROUND:
        r = _bf16_rne(r)
    return r


@triton.jit
def _rope_tail_inplace_kernel(x_ptr, c_ptr, s_ptr, o_ptr, H: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
                              INVERSE: tl.constexpr, ROUND: tl.constexpr):
    """One query row: its H heads' last RD channels of x rotated by the row's (cos, sin) [RD / 2] and stored into o
    (the same buffer as x under the launch's aliasing; the other channels are never touched)."""
    row = tl.program_id(0).to(tl.int64)
    heads = row * (H * D) + tl.arange(0, H)[:, None] * D                   # [H, 1]: each head's row of D channels
    r = _rope_tail(x_ptr + heads, c_ptr + row * (RD // 2), s_ptr + row * (RD // 2), D, RD, INVERSE, ROUND)
    tl.debug_barrier()      # every load before any store: a partner may sit in another thread's part of the buffer
    tl.store(o_ptr + heads + (D - RD) + tl.arange(0, RD)[None, :], r.to(o_ptr.dtype.element_ty))


def launch_args(x, rope, *, inverse: bool, round_int: int = 0) -> dict:
    """The kernel's constexprs for x [B, S, H, D] and ``rope`` (cos, sin [B, S, rd / 2])."""
    B, S, H, D = x.shape
    rd = 2 * rope[0].shape[-1]
    if H & (H - 1) or rd & (rd - 1) or not 0 < rd <= D:
        raise ValueError(f"in-place RoPE needs a power-of-two head count and tail width <= D, got H={H}, rd={rd}, "
                         f"D={D}")
    return dict(H=H, D=D, RD=rd, INVERSE=int(inverse), ROUND=round_int)


def rope_tail_inplace(x, rope, *, inverse=False):
    """``rope.rope_q(x, rope)`` (or ``rope_o`` with ``inverse``) for bf16 x [B, S, H, D] on a GPU, the tails rotated
    in x's own buffer (None: x as it is)."""
    if rope is None:
        return x
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()  # lazy: GPU only
    B, S = x.shape[:2]
    c, s = (t.astype(jnp.float32).reshape(B * S, -1) for t in rope)
    return jt.triton_call(
        x, c, s, kernel=_rope_tail_inplace_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(B * S,), num_warps=4, num_stages=1, input_output_aliases={0: 0}, enable_fp_fusion=False,
        **launch_args(x, rope, inverse=inverse))
