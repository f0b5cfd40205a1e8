"""A toy model that honours the model contract's *state and batch semantics* at negligible cost.

It exists so the engine's scheduler, paging, prefix cache, rollback and decode loop can be tested in
seconds on a CPU, independently of the real model's numerics. Its next-token logits at position ``q`` are
a fixed function of the tokens at ``q``, ``q - 1`` (read from the per-slot window ring, truncated at
``enc_floor``) and ``q // 2`` (read from the paged global KV through the page table, written only at
positions ``>= kv_write_from``). Reading a wrong page, a stale ring row or a rolled-back position changes
the output, so equality tests on top of it are meaningful. Its draft model uses the same function
without the global term (imperfect drafts, so some are rejected).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from dsflash.model.draft_sampler import draft_temperature, sample_draft



@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 64
    sliding_window: int = 8
    dspark_block_size: int = 3
    eos_token_id: int = 1
    num_hidden_layers: int = 2
    scale: float = 3.0


class ToyBackend:
    def __init__(self, cfg: ToyConfig = ToyConfig(), seed: int = 0, tokenizer=None):
        self.cfg = cfg
        self.block = cfg.dspark_block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.sliding_window = cfg.sliding_window
        self.num_layers = cfg.num_hidden_layers
        self.tokenizer = tokenizer
        self.name = "toy"
        r = np.random.default_rng(seed)
        V = cfg.vocab_size
        self.params = {k: jnp.asarray(r.normal(size=(V, V)) * cfg.scale, jnp.float32) for k in ("E", "F", "G")}

    def init_state(self, geo):
        R = self.sliding_window + geo.ring_slack
        return {"ring": jnp.zeros((geo.num_slots, R), jnp.int32),
                "dring": jnp.zeros((geo.num_slots, R), jnp.int32),
                "kv": jnp.zeros((geo.num_pages * geo.page_size,), jnp.int32)}

    def bind_geometry(self, geo):
        self._page_size = geo.page_size

    def _addr(self, batch, pos, page_size):
        page = jnp.take_along_axis(batch.page_table, jnp.clip(pos // page_size, 0, batch.page_table.shape[1] - 1), 1)
        return page * page_size + pos % page_size

    def forward(self, params, batch, state, *, logits="last", taps=False):
        page_size = self._page_size
        B, S = batch.tokens.shape
        R = state["ring"].shape[1]
        pos = batch.positions
        valid = batch.valid
        tok = batch.tokens
        slot = batch.slots[:, None]
        # write ring and global KV (masked: invalid rows go to an out-of-range index and are dropped)
        ring = state["ring"].at[jnp.where(valid, slot, 10**9), pos % R].set(tok, mode="drop")
        kv_ok = valid & (pos >= batch.kv_write_from[:, None])
        addr = self._addr(batch, pos, page_size)
        kv = state["kv"].at[jnp.where(kv_ok, addr, 10**9)].set(tok, mode="drop")
        # previous token: in the chunk, else from the ring as it was before this call (floor-truncated)
        before = state["ring"][batch.slots, (batch.start - 1) % R]
        prev = jnp.concatenate([before[:, None], tok[:, :-1]], axis=1)
        prev = jnp.where((pos - 1) >= batch.enc_floor[:, None], prev, 0)
        prev = jnp.where(pos >= 1, prev, 0)
        g = kv[self._addr(batch, pos // 2, page_size)]
        lg = params["E"][tok] + 0.5 * params["F"][prev] + 0.5 * params["G"][g]
        out = {}
        if logits == "all":
            out["logits"] = lg
        elif logits == "last":
            last = jnp.clip(batch.lengths - 1, 0, S - 1)
            out["logits"] = jnp.take_along_axis(lg, last[:, None, None], 1)[:, 0]
        if taps:
            out["taps"] = tok[..., None].astype(jnp.float32)
        return out, {**state, "ring": ring, "kv": kv}

    def update_context(self, params, out, batch, state):
        taps = out["taps"]
        R = state["dring"].shape[1]
        pos, valid = batch.positions, batch.valid
        d = state["dring"].at[jnp.where(valid, batch.slots[:, None], 10**9), pos % R].set(
            taps[..., 0].astype(jnp.int32), mode="drop")
        return {**state, "dring": d}

    def propose(self, params, state, y, pos, slots, floor, temperature, keys):
        R = state["dring"].shape[1]
        B = y.shape[0]
        prev = state["dring"][slots, pos % R]                      # token at position pos (context)
        outs, lgs = [], []
        cur, before = y, prev
        for i in range(self.block):
            lg = params["E"][cur] + 0.5 * params["F"][before]
            nxt = sample_draft(lg, i, temperature, keys)          # the one draft sampler (model/draft_sampler.py)
            outs.append(nxt)
            lgs.append(lg / draft_temperature(temperature))
            before, cur = cur, nxt
        return jnp.stack(outs, 1), jnp.stack(lgs, 1), jnp.zeros((B, self.block), jnp.float32)

    def global_kv_arrays(self, state):
        return [state["kv"]]


def run_greedy(eng, prompts, tag: str = "r", max_tokens: int = 40) -> dict:
    """Greedy requests (ids ``tag0``, ``tag1``, ...; no EOS stop) stepped to the end: their token ids by prompt
    index."""
    from dsflash.serve.types import SamplingParams
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[int(o.request_id[len(tag):])] = o.outputs[0].token_ids
    return out
