"""Prompt-token logprobs for ``echo`` + ``logprobs`` on ``/v1/completions`` (what evaluation harnesses read for
log-likelihood): one exact forward over the prompt with ``logits="all"`` on a fresh one-slot state.

The engine's compiled prefill returns only the last position's logits, so this is a separate program: lengths
are padded to powers of two (a handful of compiles), bounded replay is off (``logits="all"`` is exact), and it
runs on its own single thread, reading the engine's parameters only (the engine's own state is never touched).
Entry ``i`` is ``log p(ids[i] | ids[:i])``; entry 0 is None, as in vLLM.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np


def _bucket(n: int) -> int:
    return max(16, 1 << math.ceil(math.log2(max(n, 1))))


@functools.lru_cache(maxsize=None)
def _scorer(k: int):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def score(logits, ids):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[:-1]       # position i predicts ids[i+1]
        chosen = jnp.take_along_axis(lp, ids[1:, None], axis=-1)[:, 0]
        if k:
            tv, ti = jax.lax.top_k(lp, k)
        else:
            tv, ti = jnp.zeros((lp.shape[0], 0)), jnp.zeros((lp.shape[0], 0), jnp.int32)
        return chosen, ti, tv
    return score


def prompt_logprobs(engine, ids: list[int], k: int) -> list[Optional[dict]]:
    """``[None, {"token_id", "logprob", "top": {id: logprob}}, ...]`` for the prompt ``ids`` (``k`` top entries).
    ``engine`` is an ``LLMEngine`` (its ``backend``), or any engine with its own ``prompt_logprobs``."""
    own = getattr(engine, "prompt_logprobs", None)
    if own is not None:
        return own(ids, k)
    be = getattr(engine, "backend", None)
    if be is None or not hasattr(be, "cfg") or not hasattr(be, "_opts"):
        raise NotImplementedError("this engine cannot score prompts")
    if getattr(be, "mesh", None) is not None:
        raise NotImplementedError("prompt logprobs are not implemented on a DP mesh")
    from dsflash.model.forward import forward_jit
    from dsflash.model.state import CacheGeometry, init_state, make_batch

    n = len(ids)
    S = _bucket(n)
    ps = int(be.page_size)
    pages = -(-S // ps)
    geo = CacheGeometry(num_slots=1, num_pages=pages, page_size=ps, ring_slack=16)
    state = init_state(be.cfg, geo, be.precision)
    tokens = np.zeros((1, S), np.int32)
    tokens[0, :n] = ids
    batch = make_batch(tokens, lengths=[n], pages_per_seq=pages)
    out, _ = forward_jit(be.params, be.cfg, batch, state, be._opts(logits="all"), be.routed_fn)
    padded = np.zeros((S,), np.int32)
    padded[:n] = ids
    chosen, ti, tv = (np.asarray(a) for a in _scorer(int(k))(out["logits"][0], padded))
    res: list[Optional[dict]] = [None]
    for i in range(n - 1):
        res.append({"token_id": int(ids[i + 1]), "logprob": float(chosen[i]),
                    "top": {int(t): float(v) for t, v in zip(ti[i], tv[i])}})
    return res
