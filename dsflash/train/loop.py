"""Training loops over float master weights: the target (next-token CE) and the DSpark stages (SPEC §10).

* Target: ``float_params(cfg, init_params(cfg, seed))`` minus the ``mtp.*`` draft tensors; every step runs
  the real :func:`dsflash.model.forward` on a fresh state (``logits="all"``) and minimises next-token
  cross-entropy. The MoE gate biases (aux-free balancing) and the sparse-attention indexer get no gradient
  through top-k selection; they keep their init here (no bias update rule / indexer distillation yet).
* DSpark: the target is frozen; its taps give the draft context. For ``anchors`` random positions ``p`` per
  row, a fresh draft state's rings are filled with :func:`dspark.update_context` from the taps of
  ``p-W .. p-1``, :func:`dspark.draft_hidden` runs the block ``[y = x_p, noise, ...]`` and the Markov-chained
  logits ``base_i + markov(prev_i)`` with teacher forcing (``prev_0 = x_p``, ``prev_i = x_{p+i}``) predict
  ``x_{p+1} .. x_{p+block}``. Loss = CE to the data tokens + ``distill`` x CE to the target's own
  next-token distribution at those positions + BCE of the confidence head on "this draft is the target's
  greedy token". ``embed`` / ``head`` are shared with the target and stay frozen.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsflash import compile_options
from dsflash.config import ModelConfig
from dsflash.model import dspark
from dsflash.model.forward import forward
from dsflash.model.layers import linear_f32, rms_norm
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch

PAGE = 16


def split_params(params: dict) -> tuple[dict, dict, dict]:
    """-> (target trainables, draft trainables, constants (non-float, e.g. engram.token_map))."""
    tgt, drf, const = {}, {}, {}
    for k, v in params.items():
        if not jnp.issubdtype(v.dtype, jnp.floating):
            const[k] = v
        elif k.startswith("mtp."):
            drf[k] = v
        else:
            tgt[k] = v
    return tgt, drf, const


def _target_forward(params, cfg, tokens, precision, taps=False, index_distill=False):
    B, S = tokens.shape
    pages = -(-S // PAGE)
    st = init_state(cfg, CacheGeometry(B, B * pages, PAGE, cfg.dspark_block_size + 1), precision)
    batch = make_batch(tokens, pages_per_seq=pages)
    out, _ = forward(params, cfg, batch, st, RunOptions(precision=precision, logits="all", taps=taps,
                                                        page_size=PAGE, index_distill=index_distill))
    return out


def _nll_kl(params, cfg, tokens, precision, index_weight=0.0):
    """(per-position next-token NLL ``[B, S-1]`` fp32, the indexer's distillation KL -- 0 unless ``index_weight``
    > 0: ``model/index_distill.py``)."""
    out = _target_forward(params, cfg, tokens, precision, index_distill=index_weight > 0)
    lp = jax.nn.log_softmax(out["logits"][:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    return nll, out.get("index_kl", jnp.float32(0.0))


def token_nll(params, cfg, tokens, precision):
    """Per-position next-token NLL ``[B, S-1]`` (fp32)."""
    return _nll_kl(params, cfg, tokens, precision)[0]


def target_loss(trainable, const, cfg, tokens, precision, index_weight=0.0):
    """(mean NLL + ``index_weight`` x the indexer's distillation KL, that KL)."""
    nll, kl = _nll_kl({**trainable, **const}, cfg, tokens, precision, index_weight)
    return jnp.mean(nll) + index_weight * kl, kl


def make_optimizer(lr: float, steps: int, warmup: int = 50, weight_decay: float = 0.01, clip: float = 1.0):
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps // 5)), max(steps, 2),
                                               end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, b2=0.95, weight_decay=weight_decay))


@compile_options.jit(static_argnums=(3, 5, 6, 7), donate_argnums=(0, 1))
def target_step(trainable, opt_state, const, cfg, tokens, precision, opt, index_weight=0.0):
    """One optimizer step: (trainable, opt_state, loss, the indexer's distillation KL)."""
    (loss, kl), g = jax.value_and_grad(target_loss, has_aux=True)(trainable, const, cfg, tokens, precision,
                                                                  index_weight)
    upd, opt_state = opt.update(g, opt_state, trainable)
    return optax.apply_updates(trainable, upd), opt_state, loss, kl


@compile_options.jit(static_argnums=(1, 3))
def eval_nll(params, cfg, tokens, precision):
    """Summed NLL and token count of a batch (for perplexity)."""
    nll = token_nll(params, cfg, tokens, precision)
    return jnp.sum(nll), nll.size


# ------------------------------------------------------------------ supervised fine-tuning (chat)
def quantised_view(trainable: dict, cfg) -> dict:
    """``trainable`` as its export loads back (FP8 / MXFP4 / bf16 round trips) in the forward, with the float
    master weights' gradient passed straight through: a fine-tune's small updates otherwise round away at export
    (6 steps of the chat stage: held-out chat loss 3.61 in float, 4.29 as exported)."""
    from dsflash.train.export import stored_roundtrip
    rt = stored_roundtrip(cfg, trainable)
    return {k: w + jax.lax.stop_gradient(rt[k] - w) for k, w in trainable.items()}


def sft_loss(trainable, const, cfg, tokens, weights, precision, qat=False, index_weight=0.0, force=None):
    """(``sum(weights * NLL)`` + ``index_weight`` x the indexer's distillation KL, that KL): ``weights`` ``[B, S-1]``
    weigh the prediction of ``tokens[:, 1:]`` (zero off the assistant tokens of chat rows; the caller normalises
    them, see ``run._sft_weights``). ``qat``: the forward runs the weights as exported (:func:`quantised_view`).
    ``force``: teacher picks, ``{str(ratio): [B, S, F] entries}`` put into the indexer's top-k
    (``teacher_picks``)."""
    from dsflash.train import teacher_picks
    if qat:
        trainable = quantised_view(trainable, cfg)
    with teacher_picks.forcing(force, PAGE):
        nll, kl = _nll_kl({**trainable, **const}, cfg, tokens, precision, index_weight)
    return jnp.sum(weights * nll) + index_weight * kl, kl


@compile_options.jit(static_argnums=(3, 6, 7, 8, 9), donate_argnums=(0, 1))
def sft_step(trainable, opt_state, const, cfg, tokens, weights, precision, opt, qat=False, index_weight=0.0,
             force=None):
    """One optimizer step: (trainable, opt_state, loss, the indexer's distillation KL); ``force``: teacher picks
    (:func:`sft_loss`)."""
    (loss, kl), g = jax.value_and_grad(sft_loss, has_aux=True)(trainable, const, cfg, tokens, weights, precision,
                                                               qat, index_weight, force)
    upd, opt_state = opt.update(g, opt_state, trainable)
    return optax.apply_updates(trainable, upd), opt_state, loss, kl


@compile_options.jit(static_argnums=(1, 4))
def eval_masked_nll(params, cfg, tokens, mask, precision):
    """Summed NLL of the tokens ``mask`` marks (``[B, S]``; token 0 of a row is never predicted) and their count."""
    m = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(m * token_nll(params, cfg, tokens, precision)), jnp.sum(m)


def masked_loss(params, cfg, rows: np.ndarray, mask: np.ndarray, batch_size: int, precision: str) -> float:
    """Mean NLL per masked token over ``rows`` (whole batches; the tail that does not fill one is dropped)."""
    tot, n = 0.0, 0.0
    for i in range(0, len(rows) - batch_size + 1, batch_size):
        s, c = eval_masked_nll(params, cfg, jnp.asarray(rows[i:i + batch_size]), jnp.asarray(mask[i:i + batch_size]),
                               precision)
        tot += float(s)
        n += float(c)
    return tot / max(n, 1.0)


# ------------------------------------------------------------------ DSpark
def draft_logits(params, cfg: ModelConfig, taps, tokens, anchors, precision):
    """Teacher-forced Markov-chained draft logits ``[B*J, block, V]`` (+ x_hat, markov embeddings).

    ``taps`` [B, S, T*d] of the frozen target, ``anchors`` [B, J] positions p (W <= p, p + block < S)."""
    B, S = tokens.shape
    J = anchors.shape[1]
    W, K = cfg.sliding_window, cfg.dspark_block_size
    opts = RunOptions(precision=precision, page_size=PAGE)
    rows = jnp.repeat(jnp.arange(B), J)
    p = anchors.reshape(-1)
    ctx_pos = p[:, None] - W + jnp.arange(W)[None]                        # [BJ, W]
    ctx_taps = taps[rows[:, None], ctx_pos]                               # [BJ, W, T*d]
    n = B * J
    slots = jnp.arange(n, dtype=jnp.int32)
    st = init_state(cfg, CacheGeometry(n, n, PAGE, K + 1), precision)
    st = dspark.update_context(params, cfg, ctx_taps, (p - W).astype(jnp.int32), jnp.full((n,), W, jnp.int32),
                               slots, st, opts)
    y = tokens[rows, p]
    x_hat = dspark.draft_hidden(params, cfg, st, y, p.astype(jnp.int32), slots, opts)
    last = f"mtp.{cfg.n_stages - 1}"
    base = linear_f32(rms_norm(x_hat, params[f"{last}.norm.weight"], cfg.rms_norm_eps, precision),
                      params["head.weight"])                               # [BJ, K, V]
    prev = tokens[rows[:, None], p[:, None] + jnp.arange(K)[None]]          # teacher forcing: x_p .. x_{p+K-1}
    e = params[f"{last}.markov_head.embed.weight"][prev].astype(jnp.float32)
    mk = jnp.einsum("nkr,vr->nkv", e, params[f"{last}.markov_head.head.weight"].astype(jnp.float32))
    return base + mk, x_hat, e, rows, p


def _target_outputs(src, cfg, tokens, precision, offset: int = 0):
    """The frozen target's taps ``[B, S, T*d]`` and logits from position ``offset`` on ``[B, S-offset, V]``: what
    :func:`draft_loss` needs of the target. The target is frozen, so a fixed row pool can be run once and these
    passed as ``cached`` (the target forward is most of a draft step: 4.6 of 6.4 s on the 2-core CPU)."""
    out = _target_forward(src, cfg, tokens, precision, taps=True)
    return {"taps": out["taps"], "logits": out["logits"][:, offset:], "offset": jnp.int32(offset)}


# Called on its own (the target cache of train/run.py) it is a program of its own, compiled with the numerics
# option; inside draft_loss it is traced into draft_step / draft_loss_jit, whose option then holds, and must be a
# plain jit there: JAX refuses compiler_options on a nested jit.
target_outputs = compile_options.jit(_target_outputs, static_argnums=(1, 3, 4))
_target_outputs_nested = jax.jit(_target_outputs, static_argnums=(1, 3, 4))


def draft_loss(draft, frozen, cfg, tokens, anchors, precision, distill, served=None, served_precision=None,
               cached=None):
    """``served`` (optional): the target as it is served (stored FP8/MXFP4 params), run at ``served_precision``
    for the taps and the target logits, so the draft learns from what the engine will feed it; ``frozen`` then
    holds its dequantised float copy for the shared ``embed`` / ``head``. ``cached``: :func:`target_outputs` of
    these ``tokens`` (anchors must then be >= its offset), instead of running the target here."""
    params = {**frozen, **draft}
    if cached is None:
        src, src_precision = (frozen, precision) if served is None else (served, served_precision)
        cached = _target_outputs_nested(src, cfg, tokens, src_precision)
    out = jax.lax.stop_gradient(cached)
    K = cfg.dspark_block_size
    logits, x_hat, e, rows, p = draft_logits(params, cfg, out["taps"], tokens, anchors, precision)
    tpos = p[:, None] + jnp.arange(K)[None]                                 # target logits at p+i predict p+i+1
    labels = tokens[rows[:, None], tpos + 1]
    t_logits = out["logits"][rows[:, None], tpos - out["offset"]]
    lp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0]
    soft = -jnp.sum(jax.nn.softmax(t_logits, axis=-1) * lp, axis=-1)
    last = f"mtp.{cfg.n_stages - 1}"
    conf = linear_f32(jnp.concatenate([x_hat.astype(jnp.float32), e], axis=-1),
                      params[f"{last}.confidence_head.proj.weight"])[..., 0]
    hit = (jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)).astype(jnp.float32)
    bce = optax.sigmoid_binary_cross_entropy(conf, jax.lax.stop_gradient(hit))
    loss = jnp.mean(ce) + distill * jnp.mean(soft) + 0.1 * jnp.mean(bce)
    return loss, {"ce": jnp.mean(ce), "hit": jnp.mean(hit), "hit_per_pos": jnp.mean(hit, axis=0)}


@compile_options.jit(static_argnums=(3, 6, 7, 8, 10), donate_argnums=(0, 1))
def draft_step(draft, opt_state, frozen, cfg, tokens, anchors, precision, opt, distill, served=None,
               served_precision=None, cached=None):
    (loss, aux), g = jax.value_and_grad(draft_loss, has_aux=True)(draft, frozen, cfg, tokens, anchors,
                                                                   precision, distill, served, served_precision,
                                                                   cached)
    upd, opt_state = opt.update(g, opt_state, draft)
    return optax.apply_updates(draft, upd), opt_state, loss, aux


def sample_anchors(rng: np.random.Generator, cfg: ModelConfig, B: int, S: int, J: int, lo=0) -> np.ndarray:
    """``[B, J]`` anchor positions p with a full window before them, the block after, and ``p >= lo`` (an int, or
    one bound per row: ``[B]``)."""
    hi = S - cfg.dspark_block_size - 1
    lo = np.maximum(np.asarray(lo, np.int64), cfg.sliding_window)
    if hi < cfg.sliding_window:
        raise ValueError(f"seq_len {S} too short for DSpark anchors (needs > window + block + 1)")
    if (lo > hi).any():
        raise ValueError(f"anchor lower bound {int(lo.max())} leaves no anchor in a row of {S} tokens (last {hi})")
    return rng.integers(lo[..., None] if lo.ndim else lo, hi + 1, size=(B, J)).astype(np.int32)


def perplexity(params, cfg, rows: np.ndarray, batch_size: int, precision: str) -> float:
    """Over every row of ``rows``: the tail that does not fill a batch runs as a smaller one (it used to be
    dropped, so the recorded number depended on the batch size: the demo's 480 held-out rows gave 21.62 at batch 64,
    448 rows, and 22.17 at batch 32)."""
    tot, n = 0.0, 0
    for i in range(0, len(rows), batch_size):
        s, c = eval_nll(params, cfg, jnp.asarray(rows[i:i + batch_size]), precision)
        tot += float(s)
        n += int(c)
    return math.exp(tot / max(n, 1))


draft_loss_jit = compile_options.jit(draft_loss, static_argnums=(2, 5, 6, 8))


# ------------------------------------------------------------------ DSpark data: the target's own greedy chains
@compile_options.jit(static_argnums=(1, 3, 4))
def greedy_extend(params, cfg, tokens, start, precision):
    """Replace ``tokens[:, start:]`` by the target's greedy continuation of ``tokens[:, :start]``.

    At serving time a draft token is accepted when it equals the target's greedy token *given the target's
    own earlier tokens*, so the draft learns best from those chains, not from the data. Full recompute per
    position (causal, so later garbage does not matter): simple, and cheap at demo size."""
    def body(t, tok):
        lg = _target_forward(params, cfg, tok, precision)["logits"]
        nxt = jnp.argmax(lg[:, t - 1].astype(jnp.float32), axis=-1).astype(tok.dtype)
        return tok.at[:, t].set(nxt)
    return jax.lax.fori_loop(start, tokens.shape[1], body, tokens)


def greedy_pool(params, cfg, rows: np.ndarray, start: int, batch_size: int, precision: str,
                progress=None) -> np.ndarray:
    """:func:`greedy_extend` over ``rows`` in batches (the tail that does not fill a batch is dropped)."""
    out = []
    for i in range(0, len(rows) - batch_size + 1, batch_size):
        out.append(np.asarray(greedy_extend(params, cfg, jnp.asarray(rows[i:i + batch_size]), start, precision)))
        if progress is not None:
            progress(len(out))
    return np.concatenate(out) if out else rows[:0]


def served_engine(model, max_num_seqs: int, max_model_len: int):
    """The engine :func:`greedy_pool_served` decodes with (speculation off); build it once and pass it to every
    pool of a run: each engine compiles its own prefill / decode programs (~9 s on 2 CPU cores for the mini
    config)."""
    from dsflash.llm import LLM
    return LLM(model, speculative=False, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def greedy_pool_served(model, rows: np.ndarray, start, max_num_seqs: int = 256, chunk: int = 1024,
                       progress=None, llm=None) -> np.ndarray:
    """The serving engine's greedy continuation of ``rows[:, :start]`` (``model``: a loaded checkpoint or its
    folder), speculation off, at the engine's reference precision. ``start``: an int, or one per row (chat prompts
    of their own lengths).

    These are exactly the chains a served draft is verified against, and the engine decodes with its KV cache
    (one row per token) where :func:`greedy_extend` recomputes the whole row per token: on one H200 the latter
    at reference precision took ~13 s per 512 rows, too slow for the thousands of rows a draft needs.
    ``llm``: an engine from :func:`served_engine` to reuse (``model`` and ``max_num_seqs`` are then its own)."""
    from dsflash.serve.types import SamplingParams

    rows = np.asarray(rows)
    S = rows.shape[1]
    starts = np.broadcast_to(np.asarray(start), (len(rows),))
    if starts.size and not ((0 < starts) & (starts < S)).all():
        raise ValueError(f"start must be in (0, {S}), got {start}")
    if llm is None:
        llm = served_engine(model, max_num_seqs, S)
    out = rows.copy()
    for i in range(0, len(rows), chunk):
        st = [int(x) for x in starts[i:i + chunk]]
        sps = [SamplingParams(max_tokens=S - s, temperature=0.0, ignore_eos=True) for s in st]
        res = llm.generate([r[:s].tolist() for r, s in zip(rows[i:i + chunk], st)], sps)
        for j, (r, s) in enumerate(zip(res, st)):
            ids = r.outputs[0].token_ids
            if len(ids) != S - s:
                raise RuntimeError(f"engine returned {len(ids)} tokens for row {i + j}, expected {S - s}")
            out[i + j, s:] = ids
        if progress is not None:
            progress(1)
    return out
