"""The text forward of DeepSeek-V4.1-Flash: ``forward(params, cfg, batch, state, opts) -> (out, new_state)``.

SPEC §2 (top level), §5-§6 (CED and bounded replay), §7 (delayed mHC wiring), §9 (Engram). See
docs/model-contract.md for the batch/state contract.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from dsflash import compile_options
from dsflash.config import ModelConfig
from dsflash.model import engram, mhc
from dsflash.model.attention import Ctx, csa_attention, ring_write_mask, scatter_ring
from dsflash.model.layers import act_dtype, linear_f32, rms_norm
from dsflash.model.moe import moe
from dsflash.model.state import Batch, RunOptions


def make_ctx(batch: Batch, opts: RunOptions, floor) -> Ctx:
    return Ctx(pos=batch.positions, valid=batch.valid, start=batch.start, lengths=batch.lengths,
               slots=batch.slots, page_table=batch.page_table, floor=floor, kv_write_from=batch.kv_write_from,
               precision=opts.precision, page_size=opts.page_size, backend=opts.backend,
               index_distill=opts.index_distill)


def tail_view(batch: Batch, ctx: Ctx, T: int):
    """The last T valid rows of every sequence (bounded replay): (row index [B, T], Ctx of the tail)."""
    first = jnp.maximum(batch.lengths - T, 0)
    rows = first[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    start = batch.start + first
    lengths = jnp.minimum(batch.lengths, T)
    S = batch.tokens.shape[1]
    rows = jnp.minimum(rows, S - 1)
    valid = jnp.arange(T, dtype=jnp.int32)[None] < lengths[:, None]
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    floor = jnp.maximum(batch.dec_floor, start)        # SWA keys below the replay start do not exist
    return rows, Ctx(pos=pos, valid=valid, start=start, lengths=lengths, slots=ctx.slots,
                     page_table=ctx.page_table, floor=floor, kv_write_from=ctx.kv_write_from,
                     precision=ctx.precision, page_size=ctx.page_size, backend=ctx.backend)


def _take_rows(a, rows):
    return jnp.take_along_axis(a, rows.reshape(*rows.shape, *([1] * (a.ndim - 2))), axis=1)


def embed_streams(params, tokens, cfg, precision):
    e = params["embed.weight"][tokens].astype(act_dtype(precision))
    X = jnp.broadcast_to(e[..., None, :], (*e.shape[:-1], cfg.hc_mult, e.shape[-1]))
    p = jnp.zeros((*tokens.shape, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    return X, p


def block(params, cfg, name, X, p, attn_fn, precision, backend, draft=False, routed_fn=None, valid=None,
          pending=None, defer=False, with_input=False):
    """One block with the delayed mHC wiring (SPEC §7): returns (X'', f_pre, expert load [E]) (``with_input``:
    and the block's input streams X, last).

    ``pending`` (then ``X`` is None): the previous block's deferred last expand ``(z, X1, post, comb)``, done here
    in the same fused pass as this block's first coefficients and collapse (as ``post_mix`` does between the two
    sublayers) instead of as a separate op whose output the next op reads back. ``defer``: return that tuple in
    place of X'' for the next block (``mhc.expand(*pending)`` materialises it). Same math either way: the XLA
    backend runs the separate pieces in the same order."""
    pre = f"{name}"
    # mHC at the two sublayer boundaries as fused ops: pre_mix = coefficients(X) + collapse(X, p); post_mix =
    # expand, then coefficients + collapse of the result. The XLA backend computes exactly the separate pieces;
    # the fused Triton kernel runs where kernels/dispatch.py says (its "mhc" crossover table).
    attn_hc = (params[f"{pre}.hc_attn_fn"], params[f"{pre}.hc_attn_base"], params[f"{pre}.hc_attn_scale"])
    if pending is None:
        hx, (a_pre, a_post, a_comb) = mhc.pre_mix(X, p, *attn_hc, cfg, precision, backend)
    else:
        X, hx, (a_pre, a_post, a_comb) = mhc.post_mix(*pending, p, *attn_hc, cfg, precision, backend)
    x = rms_norm(hx, params[f"{pre}.attn_norm.weight"], cfg.rms_norm_eps, precision)
    y = attn_fn(x)
    X1, hf, (f_pre, f_post, f_comb) = mhc.post_mix(y, X, a_post, a_comb, a_pre, params[f"{pre}.hc_ffn_fn"],
                                                   params[f"{pre}.hc_ffn_base"], params[f"{pre}.hc_ffn_scale"], cfg,
                                                   precision, backend)
    h = rms_norm(hf, params[f"{pre}.ffn_norm.weight"], cfg.rms_norm_eps, precision)
    z, load = moe(h, params, f"{pre}.ffn", cfg, precision, backend, draft=draft, routed_fn=routed_fn, valid=valid)
    out = (z, X1, f_post, f_comb) if defer else mhc.expand(z, X1, f_post, f_comb, precision)
    return (out, f_pre, load, X) if with_input else (out, f_pre, load)


def engram_step(params, cfg, k, layer, X, batch, cids_ext, precision):
    if batch.engram_rows is not None:
        emb = batch.engram_rows[:, :, k].astype(act_dtype(precision))
    else:
        rows = engram.hash_rows(cids_ext, cfg, k)
        if f"layers.{layer}.engram.embed.weight" in params:
            emb = engram.gather_rows(params, f"layers.{layer}.engram", rows, precision)
        elif engram.host_table(cfg, layer) is not None:
            emb = engram.gather_rows_host(cfg, layer, rows, precision)
        else:
            raise ValueError(f"Engram table of layer {layer} is neither in params nor registered on the host "
                             "(dsflash.model.engram.register_host_tables), and Batch.engram_rows is not given")
    return engram.inject(X, emb, params, f"layers.{layer}.engram", cfg, precision)


def engram_history(params, cfg, batch, state):
    """Compressed ids with the N-1 previous positions in front ([B, N-1+S]); pad before the sequence start."""
    N = cfg.engram_max_ngram_size
    hist = state["engram_hist"]
    Rc = hist.shape[1]
    pad = engram.compressed_ids(jnp.asarray([cfg.engram_pad_token_id]), params, cfg)[0]
    prev_pos = batch.start[:, None] - (N - 1) + jnp.arange(N - 1, dtype=jnp.int32)[None]
    if batch.prev_tokens is not None:
        given = batch.prev_tokens.astype(jnp.int32)
        prev = jnp.where(given >= 0, engram.compressed_ids(jnp.maximum(given, 0), params, cfg), -1)
    else:
        prev = hist[batch.slots[:, None], jnp.mod(prev_pos, Rc)]
    prev = jnp.where((prev_pos >= 0) & (prev >= 0), prev, pad)
    cids = engram.compressed_ids(batch.tokens, params, cfg)
    return jnp.concatenate([prev, cids], axis=1), cids


HEAD_ROW_TILE = 8


def head_logits(h, w):
    """LM head (fp32) of ``h [R, d]`` in tiles of ``HEAD_ROW_TILE`` rows. A dot rounds a row by the op's row count
    (XLA on CPU: another accumulation order at M = 1 than at M = 4), so at M = R a prompt's last logits would
    depend on how many rows its prefill bucket has; in fixed tiles they do not (the engine's (1, B) bucket)."""
    R, G = h.shape[0], HEAD_ROW_TILE
    n = -(-R // G)
    hp = jnp.pad(h, ((0, n * G - R), (0, 0))).reshape(n, G, h.shape[-1])
    out = linear_f32(hp[0], w)[None] if n == 1 else jax.lax.map(lambda x: linear_f32(x, w), hp)
    return out.reshape(n * G, -1)[:R]


def forward(params, cfg: ModelConfig, batch: Batch, state: dict, opts: RunOptions | None = None,
            routed_fn=None):
    """Pure forward; jit with ``cfg``/``opts`` static (None: ``RunOptions()``). ``routed_fn`` optionally replaces
    the routed-expert GEMM (expert-parallel sharding hook; called with ``layer=`` the block name)."""
    opts = RunOptions() if opts is None else opts
    prec = opts.precision
    L = cfg.num_hidden_layers
    ctx = make_ctx(batch, opts, batch.enc_floor)
    X, p = embed_streams(params, batch.tokens, cfg, prec)
    shared: dict = {}
    state = dict(state)
    if cfg.engram_layer_ids:
        cids_ext, cids = engram_history(params, cfg, batch, state)
        mask = ring_write_mask(ctx, state["engram_hist"].shape[1])
        state["engram_hist"] = scatter_ring({"x": state["engram_hist"]}, batch.slots, ctx.pos, cids, mask,
                                            lambda v, _: {"x": v}, None)["x"]
    replay = opts.bounded_replay
    switch_at = None
    if replay == "report":
        switch_at = cfg.decoder_start
    elif replay == "layer20_full":
        switch_at = cfg.decoder_start + 1
        late = [l for l in list(cfg.kv_source_layer_ids) + list(cfg.engram_layer_ids) if l >= switch_at]
        if late:
            raise ValueError(f"bounded_replay='layer20_full' needs no KV source/Engram at or after layer "
                             f"{switch_at}, found {late}")
    taps = {}
    loads = []
    tail_rows = None
    # Each block's last expand is deferred into the next block's first fused mHC pass (``block``'s ``pending``),
    # so it is not a separate op whose output the next one reads back. It is materialised where something else
    # changes or selects the streams (tail view, Engram) and for the head; DSpark's taps read the streams the
    # next block's fused pass wrote.
    pending = None
    dec_ctx = make_ctx(batch, opts, batch.dec_floor)
    for l in range(L):
        name = f"layers.{l}"
        comp_x = comp_ctx = None
        if pending is not None and (l == switch_at or l in cfg.engram_layer_ids):
            X, pending = mhc.expand(*pending, prec), None
        if l == switch_at:
            tail_rows, tctx = tail_view(batch, ctx, opts.replay_tail)
            X_full, p_full, ctx_full = X, p, dec_ctx
            X, p = _take_rows(X, tail_rows), _take_rows(p, tail_rows)
            shared = {k: _take_rows(v, tail_rows) for k, v in shared.items()}
            ctx = dec_ctx = tctx
            taps = {k: _take_rows(v, tail_rows) for k, v in taps.items()}
            if replay == "report" and l in cfg.kv_source_layer_ids:
                # the compressor of layer 20 still reads every row (decoder global KV for all tokens)
                comp_ctx = ctx_full
                comp_x = rms_norm(mhc.collapse(X_full, p_full, prec), params[f"{name}.attn_norm.weight"],
                                  cfg.rms_norm_eps, prec)
        elif l == cfg.decoder_start:
            ctx = dec_ctx
        if l in cfg.engram_layer_ids:
            X = engram_step(params, cfg, cfg.engram_index(l), l, X, batch, cids_ext, prec)

        def attn_fn(x, l=l, ctx=ctx, comp_x=comp_x, comp_ctx=comp_ctx):
            nonlocal state, shared
            y, state, shared = csa_attention(params, cfg, l, x, ctx, state, shared, comp_x, comp_ctx)
            return y

        nxt, p, load, X_in = block(params, cfg, name, None if pending is not None else X, p, attn_fn, prec,
                                   opts.backend, routed_fn=routed_fn, valid=ctx.valid, pending=pending, defer=True,
                                   with_input=True)
        if l in cfg.dspark_target_layer_ids:
            taps[l] = jnp.mean(X_in.astype(jnp.float32), axis=-2).astype(act_dtype(prec))
        X, pending = None, nxt
        loads.append(load)

    out = {}
    lengths = ctx.lengths
    if opts.logits == "last":
        # only each sequence's last row reaches the head: take it before the last expand, collapse and norm (per-row
        # ops, so the same values) instead of running those over every token of a prefill chunk
        last = jnp.maximum(lengths - 1, 0)[:, None]
        pending = tuple(_take_rows(a, last) for a in pending)     # (every block defers: pending is set here)
        p = _take_rows(p, last)
    X = mhc.expand(*pending, prec)
    h = rms_norm(mhc.collapse(X, p, prec), params["norm.weight"], cfg.rms_norm_eps, prec)
    if opts.logits == "all":
        out["logits"] = linear_f32(h, params["head.weight"])
    elif opts.logits == "last":
        out["logits"] = head_logits(h[:, 0], params["head.weight"])
    if opts.index_distill:
        out["index_kl"] = jnp.asarray(shared.get("index_kl", 0.0), jnp.float32)
    if opts.expert_load:
        out["expert_load"] = jnp.stack(loads)      # [L, E] tokens per expert (padding / idle rows excluded)
    if opts.taps:
        out["taps"] = jnp.concatenate([taps[l] for l in cfg.dspark_target_layer_ids], axis=-1)
        out["taps_start"] = ctx.start
        out["taps_lengths"] = ctx.lengths
    return out, state


@compile_options.jit(static_argnums=(1, 4, 5), donate_argnums=(3,))
def forward_jit(params, cfg, batch, state, opts, routed_fn=None):
    return forward(params, cfg, batch, state, opts, routed_fn)
