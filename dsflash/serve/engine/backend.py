"""The engine's view of a model: the few functions of the model contract it calls.

``ModelBackend`` wraps ``dsflash.model.forward`` / ``dsflash.model.dspark`` (the real model,
``docs/model-contract.md``). ``dsflash.serve.engine.testing.ToyBackend`` implements the same protocol
with a trivially cheap model so the scheduler and decode loop can be tested in seconds.

Protocol (all functions pure and jit-able; ``state`` is donated by the caller):

* ``bind_geometry(geo)`` (optional) — told the cache geometry before ``init_state``
* ``init_state(geo)`` -> state pytree
* ``forward(params, batch, state, *, logits, taps)`` -> (out, state): ``out["logits"]`` fp32 ``[B, V]``
  (``logits="last"``) or ``[B, S, V]`` (``"all"``); ``out["taps"]`` when ``taps``; with EPLB on
  (``eplb_shape`` set) also ``out["expert_load"] [L, P]`` (per-physical-expert tokens of valid rows)
* ``update_context(params, out, batch, state)`` -> state (DSpark context from the forward's taps)
* ``propose(params, state, y, pos, slots, floor, temperature, keys)`` -> (drafts ``[B, k]``, logits ``[B, k, V]``,
  confidence ``[B, k]``). ``y`` is the token just sampled for position ``pos + 1``; ``keys [B, 2]`` are per-row
  keys and ``temperature [B]`` per-row temperatures (0 = greedy drafts); ``logits`` are the log of the
  distribution each draft was sampled from, up to a constant (the rejection sampler's ``q``).
* ``block`` (drafts per step, 0 = no draft model), ``vocab_size``, ``eos_token_id``, ``sliding_window``,
  ``num_layers``, ``global_kv_arrays(state)`` (the paged leaves, for memory accounting)
"""
from __future__ import annotations

import jax


def load_model(name_or_path, **load_opts):
    """A preset name or checkpoint folder through ``dsflash.load`` (``dsflash.api.load``: serve/ imports
    the floor below it, not the package face)."""
    from dsflash.api import load
    return load(name_or_path, **load_opts)


def make_backend(model, c):
    """The engine's view of ``model``, with the run options the ``EngineConfig`` ``c`` resolves against the
    model's own. A prebuilt backend cannot change its options: an explicit, different setting is an error."""
    from dsflash.api import Model
    if not isinstance(model, (str, Model)) and all(hasattr(model, a) for a in ("propose", "init_state",
                                                                                "forward")):
        have = model.run_options() if hasattr(model, "run_options") else {}
        want = c.run_options(None) if have else {}
        for name in ("precision", "backend", "bounded_replay"):
            if getattr(c, name) is None or (name == "backend" and c.backend == "auto"):
                continue                                  # unset, or "auto": the backend's own choice stands
            if have and want[name] != have[name]:
                raise ValueError(f"EngineConfig.{name}: {getattr(c, name)!r}, but the engine backend passed in "
                                 f"was built with {have[name]!r}; pass the Model (or set it on ModelBackend)")
        if c.moe_weight_layout != "auto" and c.moe_weight_layout != have.get("moe_weight_layout", "checkpoint"):
            raise ValueError(f"EngineConfig.moe_weight_layout: {c.moe_weight_layout!r}, but the engine backend passed "
                             f"in was built with {have.get('moe_weight_layout', 'checkpoint')!r}; pass the Model")
        return model
    if isinstance(model, str):
        ro = c.run_options(None)
        load_opts = dict(c.load_options or {})
        if c.mesh is not None:
            load_opts["mesh"] = c.mesh
        load_opts.setdefault("precision", ro["precision"])
        load_opts.setdefault("backend", ro["backend"])
        model = load_model(model, **load_opts)
    elif c.mesh is not None or c.load_options:
        raise ValueError("EngineConfig.mesh / load_options: apply to model names; the Model passed in is loaded")
    ro = c.run_options(model.opts)
    return ModelBackend(model, precision=ro["precision"], backend=ro["backend"], bounded_replay=ro["bounded_replay"],
                        moe_weight_layout="checkpoint" if c.eplb and c.moe_weight_layout == "auto" else c.moe_weight_layout)


class ModelBackend:
    supports_row_keys = True

    def __init__(self, model, *, precision: str | None = None, bounded_replay="model", backend: str | None = None,
                 dequantize: bool | None = None, moe_weight_layout: str = "checkpoint"):
        """``precision`` / ``backend`` default to the model's own ``RunOptions`` (``model.opts``), never to a
        second default of their own; so does ``bounded_replay`` unless given (None = exact; the engine passes
        what ``EngineConfig.run_options`` resolved). ``backend`` "auto" is resolved here (``config.resolve_backend``).
        ``moe_weight_layout`` "il": the routed experts' weights are repacked once here (``model.params.moe_il_weights``)
        for the Triton MoE decode; the outputs are bit-identical to the checkpoint layout's. "auto": "il" on the Triton
        backend on one device (128-divisible widths, not dequantised), else "checkpoint"."""
        from dsflash.serve.engine.config import MOE_WEIGHT_LAYOUTS, resolve_backend
        self.model = model
        self.cfg = model.cfg
        self.params = model.params
        self.tokenizer = getattr(model, "tokenizer", None)
        mo = getattr(model, "opts", None)
        self.precision = precision or getattr(mo, "precision", None) or "reference"
        self.bounded_replay = getattr(mo, "bounded_replay", None) if bounded_replay == "model" else bounded_replay
        self.backend = resolve_backend(backend or getattr(mo, "backend", None) or "auto")
        cfg = self.cfg
        self.block = cfg.dspark_block_size if cfg.num_nextn_predict_layers else 0
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_id", None) is not None:
            self.eos_token_id = self.tokenizer.eos_id
        self.sliding_window = cfg.sliding_window
        self.num_layers = cfg.num_hidden_layers
        # Engram history the model needs before a call's first position (Batch.prev_tokens)
        self.history = cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0
        self.name = getattr(model, "name", None) or getattr(model, "model_name", None) or "dsflash"
        self.page_size = 64
        # DP ranks of the model's mesh (dp x dep axes). With dp > 1 the state is placed by the rule table and
        # the routed experts run expert-parallel through the model's hook; dp == 1 keeps the plain path.
        self.dp = int(getattr(model, "dp", 1) or 1)
        self.mesh = getattr(model, "mesh", None) if self.dp > 1 else None
        self.strategy = getattr(model, "strategy", "dep")
        self.routed_fn = getattr(model, "routed_fn", None) if self.dp > 1 else None
        # the draft's routed experts go through the EP hook only when the strategy splits them (a replicated
        # draft MoE, draft_expert_parallel=False, runs the plain routed MoE on its whole expert stack)
        from dsflash.sharding.rules import get_strategy
        self.draft_routed_fn = self.routed_fn if get_strategy(self.strategy).draft_expert_parallel else None
        if moe_weight_layout not in MOE_WEIGHT_LAYOUTS:
            raise ValueError(f"moe_weight_layout: must be one of {', '.join(MOE_WEIGHT_LAYOUTS)}, "
                             f"got {moe_weight_layout!r}")
        slabs = cfg.hidden_size % 128 == 0 and cfg.moe_intermediate_size % 128 == 0
        if moe_weight_layout == "auto":   # il where the Triton decode reads it (measured faster: docs/engine.md)
            moe_weight_layout = ("il" if self.backend == "triton" and self.mesh is None and not dequantize and slabs
                                 else "checkpoint")
        # XLA on one CPU device: dequantise the FP8 / MXFP4 weights once instead of in every call (bit-identical
        # outputs; dsflash.model.params.dequantized_weights). None = that case; True / False force it.
        if dequantize is None:
            dequantize = (self.backend == "xla" and self.mesh is None and jax.default_backend() == "cpu"
                          and moe_weight_layout == "checkpoint")     # "il" asked for: keep the packed experts
        if moe_weight_layout == "il" and (self.mesh is not None or dequantize):
            raise ValueError("moe_weight_layout: 'il' is single-device only for now (the expert-parallel path reads "
                             "the checkpoint layout) and keeps the experts packed (not with dequantize=True)")
        if moe_weight_layout == "il" and not slabs:
            raise ValueError(f"moe_weight_layout: 'il' needs hidden_size and moe_intermediate_size divisible by "
                             f"128 (its 128-wide slabs); this model has {cfg.hidden_size} and "
                             f"{cfg.moe_intermediate_size}")
        self.dequantized = False
        if dequantize:
            from dsflash.model.params import dequantized_weights
            dq = dequantized_weights(self.cfg, self.params)
            if dq is not None:
                self.params, self.dequantized = dq, True
        self.moe_weight_layout = moe_weight_layout
        if moe_weight_layout == "il":
            from dsflash.model.params import moe_il_weights
            self.params = moe_il_weights(self.cfg, self.params)
        # EPLB (set up by dsflash.serve.engine.eplb.EngineEplb): physical target experts, tables in params;
        # (L, P) of the per-physical load every forward then returns, None = EPLB off
        self.eplb_shape = None

    def run_options(self) -> dict:
        """What the compiled programs run with (the engine's startup log line and metrics)."""
        return {"precision": self.precision, "backend": self.backend, "bounded_replay": self.bounded_replay,
                "dequantized_weights": self.dequantized, "moe_weight_layout": self.moe_weight_layout}

    def bind_geometry(self, geo):
        self.page_size = geo.page_size

    def _opts(self, **kw):
        from dsflash.model.state import RunOptions
        base = dict(precision=self.precision, backend=self.backend)
        if "page_size" in RunOptions.__dataclass_fields__:
            base["page_size"] = self.page_size
        if self.bounded_replay:
            base.update(bounded_replay=self.bounded_replay, replay_tail=self.sliding_window + self.block + 1)
        base.update(kw)
        if base.get("logits") == "all" and base.get("bounded_replay"):
            base["bounded_replay"] = None          # verification rows are short: run them exactly
        return RunOptions(**base)

    def init_state(self, geo):
        from dsflash.model.state import init_state
        self.bind_geometry(geo)
        state = init_state(self.cfg, geo, self.precision)
        if self.mesh is not None:
            from dsflash.model.params import place_value
            from dsflash.sharding.rules import state_shardings
            state = jax.tree.map(place_value, state, state_shardings(state, self.mesh, self.strategy))
        return state

    def forward(self, params, batch, state, *, logits="last", taps=False):
        from dsflash.model.forward import forward
        if self.eplb_shape is not None:
            return forward(params, self.cfg, batch, state, self._opts(logits=logits, taps=taps, expert_load=True),
                           self._eplb_routed_fn(params))
        return forward(params, self.cfg, batch, state, self._opts(logits=logits, taps=taps), self.routed_fn)

    def _eplb_routed_fn(self, params):
        """The EP hook with this call's (traced) per-layer EPLB tables; returns per-physical loads."""
        from dsflash.sharding.ep_moe import make_routed_fn
        l2p, cnt = params["eplb.log2phy"], params["eplb.logcnt"]
        names = [f"layers.{l}" for l in range(self.cfg.num_hidden_layers)]
        return make_routed_fn(self.mesh, log2phy={n: l2p[l] for l, n in enumerate(names)},
                              logcnt={n: cnt[l] for l, n in enumerate(names)}, return_load=True)

    def update_context(self, params, out, batch, state):
        from dsflash.model import dspark
        start = out.get("taps_start", batch.start)
        lengths = out.get("taps_lengths", batch.lengths)
        return dspark.update_context(params, self.cfg, out["taps"], start, lengths, batch.slots, state, self._opts())

    def propose(self, params, state, y, pos, slots, floor, temperature, keys):
        from dsflash.model import dspark
        from dsflash.model.draft_sampler import draft_sampler, draft_temperature
        kw = {"routed_fn": self.draft_routed_fn} if self.draft_routed_fn is not None else {}
        out = dspark.propose(params, self.cfg, state, y, pos + 1, slots, self._opts(),
                             sampler=draft_sampler(temperature, keys), ring_floor=floor, **kw)
        # the distribution each draft was drawn from (what the verifier's rejection sampling compares against)
        return out["drafts"], out["logits"] / draft_temperature(temperature)[:, :, None], out["confidence"]

    def global_kv_arrays(self, state):
        return [a for kind in ("main_kv", "index_k") for d in state[kind].values() for a in d.values()]
