"""On-device sampling: logits processing, per-request keys, and the speculative verifier.

Everything here is a pure ``jnp`` function over rows (requests) and positions, used inside the compiled
prefill and decode-loop programs.

Keys: a request's randomness depends only on its seed and the *output token index* being decided,
never on the batch row or on what else is running: ``key(seed, n) = fold_in(fold_in(PRNGKey(lo), hi), n)``
with ``lo``/``hi`` the two 32-bit halves of the seed. Purposes are folded in last:
``ACCEPT`` (the uniform of a draft's acceptance test), ``SAMPLE`` (a target / residual / bonus sample),
``DRAFT`` (the key handed to the draft proposer).

Processing order (vLLM's): repetition penalty (prompt + output tokens), frequency and presence
penalties (output tokens), temperature, top-k, top-p, min-p. Greedy rows (temperature 0) take the
argmax of the penalised logits (lowest index on ties).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

ACCEPT, SAMPLE, DRAFT = 1, 2, 3
NEG_INF = -jnp.inf


def request_keys(seed_lo, seed_hi, index):
    """Keys ``[...]`` for requests with the given seed halves at output index ``index`` (broadcast)."""
    seed_lo, seed_hi, index = jnp.broadcast_arrays(jnp.asarray(seed_lo, jnp.uint32),
                                                   jnp.asarray(seed_hi, jnp.uint32),
                                                   jnp.asarray(index, jnp.int32))
    shape = index.shape

    def one(lo, hi, n):
        k = jax.random.PRNGKey(lo)
        return jax.random.fold_in(jax.random.fold_in(k, hi), n)

    keys = jax.vmap(one)(seed_lo.reshape(-1), seed_hi.reshape(-1), index.reshape(-1))
    return keys.reshape(*shape, *keys.shape[1:])


def purpose(keys, p: int):
    flat = keys.reshape(-1, keys.shape[-1])
    return jax.vmap(lambda k: jax.random.fold_in(k, p))(flat).reshape(keys.shape)


def uniforms(keys):
    flat = keys.reshape(-1, keys.shape[-1])
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(flat).reshape(keys.shape[:-1])


def gumbel_argmax(keys, logp):
    """Sample from ``softmax(logp)`` (unnormalised, -inf allowed) with one key per row: argmax(logp + G)."""
    V = logp.shape[-1]
    flat_k = keys.reshape(-1, keys.shape[-1])
    g = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(flat_k).reshape(logp.shape)
    return jnp.argmax(jnp.where(jnp.isneginf(logp), NEG_INF, logp + g), axis=-1).astype(jnp.int32)


def apply_penalties(logits, counts, seen, presence, frequency, repetition):
    """logits [..., V]; counts (output-token counts) and seen (prompt or output) [..., V]; params [...]."""
    rep = repetition[..., None]
    penal = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penal, logits)
    c = counts.astype(logits.dtype)
    return logits - frequency[..., None] * c - presence[..., None] * (c > 0)


def needs_truncation(top_k, top_p, vocab_size: int):
    """Whether any row restricts its distribution by top-k (``0 < k < V``) or top-p (``p < 1``)."""
    return jnp.any(((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0))


def _truncate_top_k_top_p(x, top_k, top_p):
    """Scaled logits [..., V] -> the same with everything outside each row's top-k / top-p set at -inf.

    ``top_p >= 1`` keeps every token: in fp32 the running mass can round up to 1 before the tail, which would
    otherwise cut tokens of rows that asked for no top-p (and make a row's result depend on its batch-mates)."""
    V = x.shape[-1]
    srt = -jnp.sort(-x, axis=-1)                                          # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[..., None]
    kth = jnp.take_along_axis(srt, k - 1, axis=-1)
    x = jnp.where(x < kth, NEG_INF, x)
    srt = jnp.where(jnp.arange(V) < k, srt, NEG_INF)
    ps = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(ps, axis=-1) - ps                                  # mass strictly above each
    keep = ((before < top_p[..., None]) | (top_p[..., None] >= 1.0)) & (jnp.arange(V) < k)
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    thr = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
    return jnp.where(x < thr, NEG_INF, x)


def process_logits(logits, temperature, top_k, top_p, min_p):
    """Penalised logits [..., V] -> normalised log-probabilities of the sampling distribution.

    Rows with temperature 0 get the distribution at temperature 1 (they are sampled by argmax). The sort behind
    top-k / top-p runs only when some row asks for either (``lax.cond``): it dominated a CPU decode step of the
    demo model (31 ms of a ~74 ms speculative iteration at 8 x 6 rows x 4,096 ids), and most requests are plain."""
    V = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[..., None]
    x = logits.astype(jnp.float32) / t
    x = lax.cond(needs_truncation(top_k, top_p, V), lambda x: _truncate_top_k_top_p(x, top_k, top_p),
                 lambda x: x, x)
    logp = jax.nn.log_softmax(x, axis=-1)
    mx = jnp.max(logp, axis=-1, keepdims=True)
    x = jnp.where((min_p[..., None] > 0) & (logp < mx + jnp.log(jnp.maximum(min_p[..., None], 1e-30))), NEG_INF, x)
    return jax.nn.log_softmax(x, axis=-1)


def apply_token_mask(logits, mask, guided):
    """Guided decoding: logits [B, ..., V] -> the same with tokens outside row b's bitmask at -inf where
    ``guided[b]``. ``mask`` [B, W] int32 (bit ``v % 32`` of word ``v // 32`` set = allowed, llguidance's layout),
    or [B, P, W] for logits [B, P, V] (one mask per position: a verify block). Runs only when some row is guided
    (``lax.cond``), so unconstrained batches pay nothing."""
    V = logits.shape[-1]

    def masked(x):
        v = jnp.arange(V, dtype=jnp.int32)
        bits = (mask[..., v // 32] >> (v % 32)) & 1                             # [B, (P,) V]
        g = guided.reshape(guided.shape + (1,) * (bits.ndim - 1))
        allowed = (bits == 1) | ~g
        allowed = allowed.reshape(allowed.shape[:-1] + (1,) * (x.ndim - allowed.ndim) + allowed.shape[-1:])
        return jnp.where(allowed, x, NEG_INF)

    return lax.cond(jnp.any(guided), masked, lambda x: x, logits)


def sample(logp, greedy_logits, greedy, keys):
    """One token per row: argmax of ``greedy_logits`` where ``greedy`` else a sample of ``logp``."""
    g = jnp.argmax(greedy_logits, axis=-1).astype(jnp.int32)
    # the V-wide Gumbel noise only when some row samples
    s = lax.cond(jnp.any(~greedy), lambda: gumbel_argmax(keys, logp), lambda: g)
    return jnp.where(greedy, g, s)


def draft_accepted(target_logp, target_arg, q_d, drafts, greedy, u):
    """Each draft's acceptance test (``drafts`` / ``target_arg`` / ``q_d`` / ``u`` of one shape, ``target_logp`` that
    shape + [V], ``greedy`` broadcast to it): a greedy row accepts the target's argmax, a sampled one when
    ``u < p / q`` (as ``u * q < p``; q > 0 for sampled drafts). The one rule of ``rejection_sample`` and of the
    runner's sequential verify, which tests row by row to stop early."""
    p_d = jnp.exp(jnp.take_along_axis(target_logp, drafts[..., None], axis=-1)[..., 0])
    return jnp.where(greedy, drafts == target_arg, u * q_d < p_d)


def rejection_sample(target_logp, target_greedy_logits, draft_logp, drafts, greedy, keys_accept, keys_sample,
                     no_draft=None, accepted=None):
    """Verify ``k`` drafts against ``k + 1`` target distributions (Leviathan et al.; vLLM's rejection sampler).

    target_logp [B, k+1, V]     processed log p (the target's sampling distribution at each position)
    target_greedy_logits        [B, k+1, V] logits whose argmax is the greedy choice
    draft_logp [B, k, V]        log q, the distribution each draft was sampled from (-inf allowed)
    drafts [B, k] int32         proposals o_1..o_k
    greedy [B] bool
    no_draft [B] bool or None   rows whose drafts are all rejected and whose first token is a plain sample of
                                the target (guided rows: their drafts were not checked against the grammar)
    keys_accept, keys_sample    [B, k+1, 2] keys for the acceptance uniforms / residual-or-bonus samples
    accepted [B, k] bool or None  each draft's acceptance test, already made (the sequential verify makes it row by
                                row, by the same rule, to stop early; positions it did not reach are False)

    Returns ``tokens [B, k+1]`` (accepted drafts then the correction or bonus token; entries past
    ``num [B]`` are padding) and ``num`` in 1..k+1. Sampled rows accept ``o_i`` with probability
    ``min(1, p(o_i)/q(o_i))``; the first rejected position emits a sample of ``norm(max(p - q, 0))``; if
    every draft is accepted a bonus token is sampled from ``p_{k+1}``. The emitted tokens are then
    distributed exactly as sequential sampling from the target. Greedy rows accept while the draft equals
    the target argmax and emit the argmax at the first mismatch.
    """
    B, k1, V = target_logp.shape
    k = k1 - 1
    tgt_arg = jnp.argmax(target_greedy_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    if accepted is None:
        q_d = jnp.exp(jnp.take_along_axis(draft_logp, drafts[..., None], axis=-1)[..., 0])
        acc = draft_accepted(target_logp[:, :k], tgt_arg[:, :k], q_d, drafts, greedy[:, None],
                             uniforms(keys_accept[:, :k]))
    else:
        acc = accepted
    if no_draft is not None:
        acc = acc & ~no_draft[:, None]
        draft_logp = jnp.where(no_draft[:, None, None], NEG_INF, draft_logp)   # q = 0: the residual is p
    a = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)        # accepted prefix length
    # correction / bonus distribution at position a
    def residual_sample():
        p_a = jnp.take_along_axis(target_logp, a[:, None, None], axis=1)[:, 0]   # [B, V]
        q_pad = jnp.concatenate([draft_logp, jnp.full((B, 1, V), NEG_INF, draft_logp.dtype)], axis=1)
        q_a = jnp.take_along_axis(q_pad, a[:, None, None], axis=1)[:, 0]
        resid = jnp.maximum(jnp.exp(p_a) - jnp.exp(q_a), 0.0)
        has_resid = jnp.sum(resid, axis=-1, keepdims=True) > 0
        # no draft mass here (no_draft rows, the bonus position): the residual is p itself, taken as is so the
        # token is bitwise plain sampling's (log(exp(p)) differs from p by an ulp and could flip a near tie)
        has_q = jnp.any(q_a > NEG_INF, axis=-1, keepdims=True)
        logr = jnp.where(has_resid & has_q, jnp.log(resid), p_a)            # residual (or p if p == q / q = 0)
        k_a = jnp.take_along_axis(keys_sample, a[:, None, None], axis=1)[:, 0]
        return gumbel_argmax(k_a, logr)

    # the V-wide residual and its Gumbel noise only when some row samples
    corr_s = lax.cond(jnp.any(~greedy), residual_sample, lambda: jnp.zeros((B,), jnp.int32))
    corr_g = jnp.take_along_axis(tgt_arg, a[:, None], axis=1)[:, 0]
    corr = jnp.where(greedy, corr_g, corr_s)
    j = jnp.arange(k1)[None, :]
    d_pad = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < a[:, None], d_pad, jnp.where(j == a[:, None], corr[:, None], -1))
    return tokens.astype(jnp.int32), (a + 1).astype(jnp.int32)
