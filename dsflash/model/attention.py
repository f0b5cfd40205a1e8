"""CSA2 attention of one backbone layer (SPEC §4): projections, sliding window, compressor, indexer with the
hierarchical candidate filter, sparse sink attention and the grouped output projection.

Rows of a call are addressed by absolute position. Window keys come from ``concat(ring, chunk)`` (ring
index ``pos % R`` for positions before the call, ``R + pos - start`` inside it); compressed entries of
the active KV source come from its page pool through the page table. ``Ctx`` carries the per-call
geometry so every layer shares one computation of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsflash.config import ModelConfig
from dsflash.kernels import indexer_topk as ik
from dsflash.kernels.rope import rope_table
# gather_pool: a name of its own in this module, so the step profile's kv_gather scope wraps the model's calls
from dsflash.kernels.sparse_attention import gather_decoded as gather_pool
from dsflash.kernels.sparse_attention import sparse_sink_attention, sparse_sink_attention_paged
from dsflash import quant
from dsflash.model import state as st
from dsflash.model.index_distill import index_distill_loss
from dsflash.model.layers import (act_dtype, apply_rope, linear_bf16, linear_f32, linear_fp8, linear_fp8_grouped, rms_norm,
                                  rope_freqs)


@dataclass
class Ctx:
    """Per-call row geometry (one per view: all rows, or the bounded-replay tail)."""
    pos: jax.Array          # [B, S] absolute positions
    valid: jax.Array        # [B, S]
    start: jax.Array        # [B]
    lengths: jax.Array      # [B]
    slots: jax.Array        # [B]
    page_table: jax.Array   # [B, P]
    floor: jax.Array        # [B] SWA floor for the layers run in this view
    kv_write_from: jax.Array  # [B]
    precision: str
    page_size: int
    backend: str
    index_distill: bool = False     # training: the indexer's distillation loss into shared["index_kl"]


# ------------------------------------------------------------------ cache addressing
def pool_addresses(page_table, entries, per_page):
    """Entry ids [B, ...] -> flat pool rows through the page table."""
    page = jnp.take_along_axis(page_table, (entries // per_page).reshape(entries.shape[0], -1), axis=1)
    return page.reshape(entries.shape) * per_page + entries % per_page


def scatter_pool(pool, addr, values, mask, encode, precision):
    n = next(iter(pool.values())).shape[0]
    addr = jnp.where(mask, addr, n)   # out of range -> dropped
    enc = encode(values, precision)
    return {k: pool[k].at[addr].set(enc[k].astype(pool[k].dtype), mode="drop") for k in pool}


def ring_positions(start, R):
    """Absolute position held by each ring row just before a call starting at ``start`` [B] -> [B, R]."""
    k = jnp.arange(R, dtype=jnp.int32)[None]
    last = start[:, None] - 1
    return last - jnp.mod(last - k, R)


def ring_write_mask(ctx: Ctx, R):
    """Rows whose value lands in a ring of length R: valid and among the last R rows of the call."""
    S = ctx.pos.shape[1]
    row = jnp.arange(S, dtype=jnp.int32)[None]
    return ctx.valid & (row >= ctx.lengths[:, None] - R)


def scatter_ring(ring, slots, pos, values, mask, encode, precision):
    """ring leaves [slots, R, ...]; write values [B, S, ...] at (slot, pos % R) where mask."""
    R = next(iter(ring.values())).shape[1]
    idx = jnp.where(mask, jnp.mod(pos, R), R)
    enc = encode(values, precision)
    sl = jnp.broadcast_to(slots[:, None], pos.shape)
    return {k: ring[k].at[sl, idx].set(enc[k].astype(ring[k].dtype), mode="drop") for k in ring}


def _raw(x, precision):
    return {"x": x}


# ------------------------------------------------------------------ pieces
def window_rows(ctx: Ctx, W, R):
    """Window key ids into concat(ring[R], chunk[S]) for each query: [B, S, W] and validity."""
    kp = ctx.pos[..., None] - (W - 1) + jnp.arange(W, dtype=jnp.int32)
    start = ctx.start[:, None, None]
    idx = jnp.where(kp >= start, R + kp - start, jnp.mod(kp, R))
    ok = (kp >= 0) & (kp >= ctx.floor[:, None, None]) & ctx.valid[..., None]
    return jnp.where(ok, idx, -1)


def project_q(params, p, x, cfg, ctx, omega):
    """(qr, q [B, S, H, Dh] without RoPE, rope): the attention applies ``rope`` (cos, sin of the rows' positions) to q
    and its inverse to o itself (``sparse_sink_attention``'s ``rope``; its kernel can do it on the tails)."""
    qr = rms_norm(linear_fp8(x, params, f"{p}.wq_a", ctx.precision, backend=ctx.backend), params[f"{p}.q_norm.weight"],
                  cfg.rms_norm_eps, ctx.precision)
    q = linear_fp8(qr, params, f"{p}.wq_b", ctx.precision, backend=ctx.backend)
    q = q.reshape(*q.shape[:-1], cfg.num_attention_heads, cfg.head_dim)
    return qr, q, rope_table(ctx.pos, omega)


def project_window_kv(params, p, x, cfg, ctx, omega):
    kv = rms_norm(linear_fp8(x, params, f"{p}.wkv", ctx.precision, backend=ctx.backend), params[f"{p}.kv_norm.weight"],
                  cfg.rms_norm_eps, ctx.precision)
    kv = apply_rope(kv, ctx.pos, omega)
    return st.decode_window(st.encode_window(kv, ctx.precision), act_dtype(ctx.precision))


def output_projection(params, p, o, cfg, ctx):
    """o [B, S, H, Dh] (inverse RoPE already applied by the attention) -> grouped wo_a (bf16, no act quant) -> wo_b
    (FP8) -> [B, S, d]."""
    o = o.reshape(*o.shape[:2], cfg.o_groups, -1)
    h = linear_fp8_grouped(o, params, f"{p}.wo_a", ctx.precision, backend=ctx.backend)
    return linear_fp8(h.reshape(*h.shape[:2], -1), params, f"{p}.wo_b", ctx.precision, backend=ctx.backend)


def compress(params, p, x, cfg, ctx, ratio, comp_ring):
    """Compressor latents for rows that complete a group. Returns (latent [B,S,Dh], emits [B,S], entry [B,S],
    new comp ring). Ratio 2 pools (2j, 2j+1) with a per-channel softmax over the pair in fp32."""
    dt = act_dtype(ctx.precision)
    if ratio == 1:
        c = linear_bf16(x, params[f"{p}.compressor.wkv.weight"], ctx.precision)
        latent = rms_norm(c, params[f"{p}.compressor.norm.weight"], cfg.rms_norm_eps, ctx.precision)
        return latent, ctx.valid, ctx.pos, comp_ring
    k = linear_f32(x, params[f"{p}.compressor.wkv.weight"])
    z = linear_f32(x, params[f"{p}.compressor.wgate.weight"])
    Rc = comp_ring["kv"].shape[1]
    prev = jnp.mod(ctx.start - 1, Rc)
    k_prev = comp_ring["kv"][ctx.slots, prev][:, None]
    z_prev = comp_ring["score"][ctx.slots, prev][:, None]
    k_first = jnp.concatenate([k_prev, k[:, :-1]], axis=1)      # the token before each row
    z_first = jnp.concatenate([z_prev, z[:, :-1]], axis=1)
    zz = jnp.stack([z_first, z], axis=-1)
    kk = jnp.stack([k_first, k], axis=-1)
    pooled = jnp.sum(jax.nn.softmax(zz, axis=-1) * kk, axis=-1).astype(dt)
    latent = rms_norm(pooled, params[f"{p}.compressor.norm.weight"], cfg.rms_norm_eps, ctx.precision)
    emits = ctx.valid & (jnp.mod(ctx.pos, 2) == 1)
    mask = ring_write_mask(ctx, Rc)
    comp_ring = {
        "kv": scatter_ring({"x": comp_ring["kv"]}, ctx.slots, ctx.pos, k, mask, _raw, None)["x"],
        "score": scatter_ring({"x": comp_ring["score"]}, ctx.slots, ctx.pos, z, mask, _raw, None)["x"],
    }
    return latent, emits, ctx.pos // 2, comp_ring


def dense_entries(values, entry, write, n_entries):
    """([B, n_entries, ...] fp32 with ``values`` [B, S, ...] at their ``entry`` ids where ``write``, else 0; the
    [B, n_entries] mask of those entries): a call's new compressed entries laid out by entry id, as ``addr_all``
    gathers the pool."""
    B = entry.shape[0]
    ids = jnp.where(write, entry, n_entries)                     # not written -> out of range -> dropped
    b = jnp.arange(B)[:, None]
    dense = jnp.zeros((B, n_entries) + values.shape[2:], jnp.float32).at[b, ids].set(
        values.astype(jnp.float32), mode="drop")
    return dense, jnp.zeros((B, n_entries), bool).at[b, ids].set(True, mode="drop")


def index_keys(params, p, latent, entry, cfg, ctx, ratio, omega):
    k = rms_norm(linear_bf16(latent, params[f"{p}.indexer.wk.weight"], ctx.precision),
                 params[f"{p}.indexer.k_norm.weight"], cfg.rms_norm_eps, ctx.precision)
    return apply_rope(k, entry * ratio, omega)


def indexer_query(params, p, x, qr, cfg, ctx, omega):
    """Index queries [B, S, Hi, Di] and head weights [B, S, Hi] (activation dtype) for the scoring kernel."""
    dt = act_dtype(ctx.precision)
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    q = linear_fp8(qr, params, f"{p}.indexer.wq_b", ctx.precision).reshape(*qr.shape[:2], Hi, Di)
    q = apply_rope(q, ctx.pos[..., None], omega)
    if ctx.precision == "reference":
        q = quant.mxfp4_roundtrip(q, 32)
    w = linear_bf16(x, params[f"{p}.indexer.weights_proj.weight"], ctx.precision)
    w = (w.astype(jnp.float32) * (Di ** -0.5 * Hi ** -0.5)).astype(dt)
    return q.astype(dt), w


def candidate_mask(score, visible, cfg):
    """Layer-20 level-1 filter: top blocks of max-pooled scores, newest visible block forced in."""
    return ik.candidate_mask(score, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)


def select_topk(score, visible, cfg):
    """Top-min(index_topk, T) by score (ties to the lowest index), ascending positions, -1 for empty."""
    return ik.select_topk(score, visible, cfg.index_topk)


# ------------------------------------------------------------------ the layer
def csa_attention(params, cfg: ModelConfig, layer: int, x, ctx: Ctx, state, shared, comp_x=None, comp_ctx=None):
    """One layer's attention sublayer. Returns (y [B,S,d], state, shared).

    ``shared`` carries what index/KV sources publish to later layers of the same forward: the top-k list
    ("topk") and layer 20's candidate mask ("cand"). ``comp_x``/``comp_ctx`` let bounded replay run this
    layer's compressor over all rows while queries run on the tail only."""
    p = f"layers.{layer}.attn"
    ratio = cfg.ratio(layer)
    omega = rope_freqs(cfg, compressed=ratio > 0)
    W = cfg.sliding_window
    dt = act_dtype(ctx.precision)
    name = str(layer)
    ring = state["swa"][name]
    R = next(iter(ring.values())).shape[1]

    qr, q, rope = project_q(params, p, x, cfg, ctx, omega)
    kv = project_window_kv(params, p, x, cfg, ctx, omega)
    ring_vals = st.decode_window(jax.tree.map(lambda a: a[ctx.slots], ring), dt)
    kv_buf = [jnp.concatenate([ring_vals, kv], axis=1)]
    idx_parts = [window_rows(ctx, W, R)]
    state = dict(state, swa=dict(state["swa"], **{name: scatter_ring(
        ring, ctx.slots, ctx.pos, kv, ring_write_mask(ctx, R), st.encode_window, ctx.precision)}))

    if ratio > 0:
        src = cfg.kv_source_of(layer)
        per_page = ctx.page_size // ratio
        n_entries = ctx.page_table.shape[1] * per_page
        entries = jnp.broadcast_to(jnp.arange(n_entries, dtype=jnp.int32)[None], (ctx.pos.shape[0], n_entries))
        addr_all = pool_addresses(ctx.page_table, entries, per_page)
        if layer == src:
            cx, cctx = (x, ctx) if comp_x is None else (comp_x, comp_ctx)
            comp_ring = state["comp"].get(name)
            latent, emits, entry, comp_ring = compress(params, p, cx, cfg, cctx, ratio, comp_ring)
            write = emits & (cctx.pos >= cctx.kv_write_from[:, None])
            addr = pool_addresses(cctx.page_table, entry, per_page)
            k_idx = index_keys(params, p, latent, entry, cfg, cctx, ratio, omega)
            if ctx.index_distill:       # the keys again from the latent held constant: the loss trains wk / k_norm
                shared = dict(shared, index_k_train=dict(shared.get("index_k_train", {}), **{name: dense_entries(
                    index_keys(params, p, jax.lax.stop_gradient(latent), entry, cfg, cctx, ratio, omega),
                    entry, write, n_entries)}))
            main = apply_rope(latent, entry * ratio, omega)
            new_state = dict(state)
            new_state["index_k"] = dict(state["index_k"], **{name: scatter_pool(
                state["index_k"][name], addr, k_idx, write, st.encode_index_k, ctx.precision)})
            new_state["main_kv"] = dict(state["main_kv"], **{name: scatter_pool(
                state["main_kv"][name], addr, main, write, st.encode_main_kv, ctx.precision)})
            if comp_ring is not None:
                new_state["comp"] = dict(state["comp"], **{name: comp_ring})
            state = new_state
        if layer in cfg.index_source_layer_ids:
            isrc = str(src)
            pool = state["index_k"][isrc]
            q_idx, w_idx = indexer_query(params, p, x, qr, cfg, ctx, omega)
            is_cand = layer == cfg.candidate_source_layer_id
            # decode calls score straight from the pool on a GPU; the reference gathers every entry's key
            topk, cand = ik.indexer_topk_paged(
                q_idx, w_idx, pool, ctx.page_table, per_page, (ctx.pos + 1) // ratio, ctx.valid, topk=cfg.index_topk,
                gather=lambda: gather_pool(pool, addr_all, st.decode_index_k, dt),
                cand=shared["cand"] if layer > cfg.candidate_source_layer_id else None,
                cand_filter=(cfg.candidate_block_size, cfg.candidate_topk_blocks) if is_cand else None,
                backend=ctx.backend)
            shared = dict(shared, topk=topk, **({"cand": cand} if is_cand else {}))
            if ctx.index_distill:       # training only (model/index_distill.py); the outputs are unchanged
                sg = jax.lax.stop_gradient      # only the indexer's own weights learn from it
                dq, dw = indexer_query(params, p, sg(x), sg(qr), cfg, ctx, omega)
                keys = sg(gather_pool(pool, addr_all, st.decode_index_k, jnp.float32))
                fresh = shared.get("index_k_train", {}).get(isrc)     # entries this call wrote: with gradient
                if fresh is not None:
                    keys = jnp.where(fresh[1][..., None], fresh[0], keys)
                loss = index_distill_loss(
                    dq, dw, keys, sg(q), sg(gather_pool(state["main_kv"][isrc], addr_all, st.decode_main_kv,
                                                        jnp.float32)),
                    (ctx.pos + 1) // ratio, ctx.valid, cfg.head_dim ** -0.5, rope)
                shared["index_kl"] = shared.get("index_kl", 0.0) + loss
        base = kv_buf[0].shape[1]
        sel = shared["topk"]
        Bq, Sq, K = sel.shape
        if Sq * K < n_entries:
            # decode-sized calls: only the entries the rows selected (row s's K picks), so the bytes stay S*K per
            # sequence at any context instead of the whole page table's entries; the paged kernel reads them from
            # the pool where its gate says, else they are decoded and laid after the window rows
            picked = pool_addresses(ctx.page_table, jnp.maximum(sel, 0).reshape(Bq, Sq * K), per_page)
            o = sparse_sink_attention_paged(
                q, kv_buf[0], idx_parts[0], state["main_kv"][str(src)], picked.reshape(Bq, Sq, K), sel >= 0,
                params[f"{p}.attn_sink"], cfg.head_dim ** -0.5, decode=st.decode_main_kv, out_dtype=dt,
                precision=ctx.precision, backend=ctx.backend, rope=rope)
            return output_projection(params, p, o, cfg, ctx), state, shared
        else:
            kv_buf.append(gather_pool(state["main_kv"][str(src)], addr_all, st.decode_main_kv, dt))
            idx_parts.append(jnp.where(sel >= 0, sel + base, -1))

    kvs = jnp.concatenate(kv_buf, axis=1)
    idx = jnp.concatenate(idx_parts, axis=-1)
    o = sparse_sink_attention(q, kvs, idx, params[f"{p}.attn_sink"], cfg.head_dim ** -0.5, out_dtype=dt,
                              precision=ctx.precision, backend=ctx.backend, rope=rope)
    return output_projection(params, p, o, cfg, ctx), state, shared
