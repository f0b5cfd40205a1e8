"""The engine's view of a model: the few functions of the model contract it calls.

``ModelBackend`` wraps ``dsflash.model.forward`` / ``dsflash.model.dspark`` (the real model,
``docs/model-contract.md``). ``dsflash.serve.engine.testing.ToyBackend`` implements the same protocol
with a trivially cheap model so the scheduler and decode loop can be tested in seconds.

Protocol (all functions pure and jit-able; ``state`` is donated by the caller):

* ``init_state(geo)`` -> state pytree
* ``forward(params, batch, state, *, logits, taps)`` -> (out, state): ``out["logits"]`` fp32 ``[B, V]``
  (``logits="last"``) or ``[B, S, V]`` (``"all"``); ``out["taps"]`` when ``taps``
* ``update_context(params, taps, batch, state)`` -> state
* ``propose(params, state, y, pos, slots, temperature, keys)`` -> (drafts ``[B, k]``, logits ``[B, k, V]``
  (log of the distribution each draft was sampled from, up to a constant), confidence ``[B, k]``)
* ``block`` (drafts per step, 0 = no draft model), ``vocab_size``, ``eos_token_id``, ``sliding_window``,
  ``num_layers``, ``global_kv_arrays(state)`` (the paged leaves, for memory accounting)
"""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp


class ModelBackend:
    def __init__(self, model, *, precision: str = "reference", bounded_replay=None, backend: str = "xla"):
        from dsflash.model.state import RunOptions  # noqa: F401 (fail early if the model is absent)
        self.model = model
        self.cfg = model.cfg
        self.params = model.params
        self.tokenizer = getattr(model, "tokenizer", None)
        self.precision = precision
        self.bounded_replay = bounded_replay
        self.backend = backend
        cfg = self.cfg
        self.block = cfg.dspark_block_size if cfg.num_nextn_predict_layers else 0
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.sliding_window = cfg.sliding_window
        self.num_layers = cfg.num_hidden_layers
        self.name = getattr(model, "name", None) or getattr(model, "model_name", None) or "dsflash"
        from dsflash.model import dspark
        sig = inspect.signature(dspark.propose)
        self._propose_params = list(sig.parameters)

    def _opts(self, **kw):
        from dsflash.model.state import RunOptions
        base = dict(precision=self.precision, backend=self.backend)
        if self.bounded_replay:
            base.update(bounded_replay=self.bounded_replay, replay_tail=self.sliding_window + self.block + 1)
        base.update(kw)
        return RunOptions(**base)

    def init_state(self, geo):
        from dsflash.model.state import init_state
        return init_state(self.cfg, geo, self.precision)

    def forward(self, params, batch, state, *, logits="last", taps=False):
        from dsflash.model.forward import forward
        opts = self._opts(logits=logits, taps=taps)
        if logits == "all" and opts.bounded_replay:
            opts = opts.replace(bounded_replay=None)  # verification rows are short: exact
        return forward(params, self.cfg, batch, state, opts)

    def update_context(self, params, taps, batch, state):
        from dsflash.model import dspark
        return dspark.update_context(params, self.cfg, taps, batch, state, self._opts())

    def propose(self, params, state, y, pos, slots, temperature, keys):
        from dsflash.model import dspark
        drafts, logits, conf = dspark.propose(params, self.cfg, state, y, pos, slots, self._opts(),
                                              temperature, keys)
        return drafts, logits, conf

    def global_kv_arrays(self, state):
        return [a for kind in ("main_kv", "index_k") for d in state[kind].values() for a in d.values()]
