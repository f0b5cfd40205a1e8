"""DSpark draft model (SPEC §10, §16b.9): context update from target taps and block-parallel proposal.

Stages ``mtp.0..`` are ordinary delayed-mHC blocks (SWA-only attention, draft MoE) whose window rings hold
KV derived from ``main_x = main_norm(main_proj(taps))`` at committed positions. A proposal embeds
``[y, noise, ...]`` at positions ``pos .. pos + block - 1``; its rows attend to the stage's ring context
(positions ``pos - W .. pos - 1``) and bidirectionally to every block row; a Markov head then turns the
block's base logits into a sequential chain of drafts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.config import ModelConfig
from dsflash.kernels.sparse_attention import sparse_sink_attention
from dsflash.model import mhc
from dsflash.model.draft_sampler import greedy_draft
from dsflash.model import state as st
from dsflash.model.attention import (Ctx, output_projection, project_q, project_window_kv, ring_write_mask,
                                     scatter_ring)
from dsflash.model.forward import block, embed_streams
from dsflash.model.layers import act_dtype, linear_f32, linear_fp8, rms_norm, rope_freqs
from dsflash.model.state import RunOptions


def _ctx(pos, valid, slots, opts: RunOptions) -> Ctx:
    B = pos.shape[0]
    z = jnp.zeros((B,), jnp.int32)
    return Ctx(pos=pos, valid=valid, start=pos[:, 0], lengths=jnp.sum(valid, axis=1).astype(jnp.int32), slots=slots,
               page_table=jnp.zeros((B, 1), jnp.int32), floor=z, kv_write_from=z, precision=opts.precision,
               page_size=opts.page_size, backend=opts.backend)


def main_x(params, cfg: ModelConfig, taps, precision):
    h = linear_fp8(taps, params, "mtp.0.main_proj", precision)
    return rms_norm(h, params["mtp.0.main_norm.weight"], cfg.rms_norm_eps, precision)


def update_context(params, cfg: ModelConfig, taps, start, lengths, slots, state, opts: RunOptions):
    """Write every stage's ring with main_x-derived KV for positions start .. start + lengths - 1.

    ``taps`` [B, S, T*d] are the target forward's taps (``out["taps"]``, with ``out["taps_start"]`` and
    ``out["taps_lengths"]`` as start / lengths)."""
    S = taps.shape[1]
    pos = start[:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    valid = jnp.arange(S, dtype=jnp.int32)[None] < lengths[:, None]
    ctx = _ctx(pos, valid, slots, opts)
    mx = main_x(params, cfg, taps, opts.precision)
    omega = rope_freqs(cfg, compressed=False)
    swa = dict(state["swa"])
    for s in range(cfg.n_stages):
        name = f"mtp.{s}"
        kv = project_window_kv(params, f"{name}.attn", mx, cfg, ctx, omega)
        ring = swa[name]
        R = next(iter(ring.values())).shape[1]
        swa[name] = scatter_ring(ring, slots, pos, kv, ring_write_mask(ctx, R), st.encode_window, opts.precision)
    return dict(state, swa=swa)


def _stage_attention(params, cfg, name, x, ctx: Ctx, state, ring_floor):
    """Block rows attend to the ring context (pos-W .. pos-1, not below ``ring_floor``) and to all block rows."""
    p = f"{name}.attn"
    omega = rope_freqs(cfg, compressed=False)
    dt = act_dtype(ctx.precision)
    W = cfg.sliding_window
    qr, q, rope = project_q(params, p, x, cfg, ctx, omega)
    kv = project_window_kv(params, p, x, cfg, ctx, omega)
    ring = state["swa"][name]
    R = next(iter(ring.values())).shape[1]
    ring_vals = st.decode_window(jax.tree.map(lambda a: a[ctx.slots], ring), dt)
    B, K = ctx.pos.shape
    first = ctx.start                                             # position of y
    kp = first[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None]  # context positions
    ok = (kp >= 0) & (kp >= ring_floor[:, None])
    ctx_idx = jnp.where(ok, jnp.mod(kp, R), -1)
    blk_idx = R + jnp.arange(K, dtype=jnp.int32)[None]
    idx = jnp.concatenate([ctx_idx, jnp.broadcast_to(blk_idx, (B, K))], axis=1)
    idx = jnp.broadcast_to(idx[:, None], (B, K, W + K))
    kvs = jnp.concatenate([ring_vals, kv], axis=1)
    o = sparse_sink_attention(q, kvs, idx, params[f"{p}.attn_sink"], cfg.head_dim ** -0.5, out_dtype=dt,
                              precision=ctx.precision, backend=ctx.backend, rope=rope)
    return output_projection(params, p, o, cfg, ctx)


def draft_hidden(params, cfg: ModelConfig, state, y, pos, slots, opts: RunOptions, ring_floor=None, routed_fn=None):
    """Run the stages over the block [y, noise, ...] at positions pos..pos+block-1 -> x_hat [B, block, d]."""
    B = y.shape[0]
    K = cfg.dspark_block_size
    ids = jnp.concatenate([y[:, None].astype(jnp.int32),
                           jnp.full((B, K - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    positions = pos[:, None] + jnp.arange(K, dtype=jnp.int32)[None]
    ctx = _ctx(positions, jnp.ones((B, K), bool), slots, opts)
    floor = jnp.zeros((B,), jnp.int32) if ring_floor is None else ring_floor
    X, p = embed_streams(params, ids, cfg, opts.precision)
    for s in range(cfg.n_stages):
        name = f"mtp.{s}"
        X, p, _ = block(params, cfg, name, X, p,
                        lambda x, name=name: _stage_attention(params, cfg, name, x, ctx, state, floor),
                        opts.precision, opts.backend, draft=True, routed_fn=routed_fn)
    return mhc.collapse(X, p, opts.precision)


def propose(params, cfg: ModelConfig, state, y, pos, slots, opts: RunOptions, sampler=None, ring_floor=None,
            routed_fn=None):
    """Draft ``block`` tokens after ``y`` (the token sampled for position ``pos``; context = positions < pos).

    ``sampler(logits [B, V] f32, i) -> tokens [B]`` picks each draft (default ``draft_sampler.greedy_draft``, the
    first maximal index; the engine passes ``draft_sampler.draft_sampler(temperature, keys)``).
    Returns dict(drafts [B, block] int32, logits [B, block, V] f32 — the distribution each draft was
    drawn from —, confidence [B, block] f32 raw logits)."""
    x_hat = draft_hidden(params, cfg, state, y, pos, slots, opts, ring_floor, routed_fn)
    last = f"mtp.{cfg.n_stages - 1}"
    base = linear_f32(rms_norm(x_hat, params[f"{last}.norm.weight"], cfg.rms_norm_eps, opts.precision),
                      params["head.weight"])
    m_embed = params[f"{last}.markov_head.embed.weight"]
    m_head = params[f"{last}.markov_head.head.weight"].astype(jnp.float32)
    conf_w = params[f"{last}.confidence_head.proj.weight"]
    prev = y.astype(jnp.int32)
    drafts, logits, conf = [], [], []
    for i in range(cfg.dspark_block_size):
        e = m_embed[prev].astype(act_dtype(opts.precision))
        li = base[:, i] + jnp.einsum("br,vr->bv", e.astype(jnp.float32), m_head,
                                     precision=jax.lax.Precision.HIGHEST)
        tok = greedy_draft(li) if sampler is None else sampler(li, i).astype(jnp.int32)
        c = linear_f32(jnp.concatenate([x_hat[:, i], e], axis=-1), conf_w)[:, 0]
        drafts.append(tok)
        logits.append(li)
        conf.append(c)
        prev = tok
    return {"drafts": jnp.stack(drafts, 1), "logits": jnp.stack(logits, 1), "confidence": jnp.stack(conf, 1)}
