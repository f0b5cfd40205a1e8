"""EPLB in the engine (``LLMEngine(..., eplb=True)``): record per-physical-expert load every step,
rebalance every ``eplb_interval`` steps, install the new placement without recompiling.

* **Placement as arguments.** The target model's stacked routed-expert arrays are physical
  (``[P, ...]``, ``P = E + eplb_redundant_experts``; start layout slot ``p`` -> logical ``p mod E``) and the
  per-layer tables ``log2phy [L, E, R]`` / ``logcnt [L, E]`` ride in the params dict under
  ``eplb.log2phy`` / ``eplb.logcnt`` (replicated device arrays). The backend builds the EP ``routed_fn``
  inside the jitted step from those traced tables (``make_routed_fn(..., return_load=True)``), so a new
  placement is new argument values: same shapes, same shardings, no recompilation.
* **Load.** Every target forward (prefill, decode, draft verification) returns ``expert_load [L, P]``:
  the hook's :func:`dsflash.sharding.eplb.route` count over ``valid`` rows only (padding and DP dummy rows
  are ``valid=False``). The runner sums a call's iterations; the engine adds a step's prefill and decode
  calls and records one ``[L, P]`` per engine step in :class:`EplbState` (host window).
* **Rebalance.** When :meth:`EplbState.record` says a rebalance is due, the policy runs on the window and
  the plan is applied **one MoE layer per engine step**, between steps: that layer's expert arrays are
  re-laid out by one pre-compiled gather (same shardings in and out; XLA moves the bytes between ranks)
  and its table rows are swapped in the same update, so every forward sees each layer fully old or
  fully new. The copy is synchronous in this version (it runs between two steps, not overlapped with a
  forward). Replicas hold the same weights and every token still meets the same logical experts, so
  outputs do not change (up to the order of the fp32 sum over a token's experts).

The DSpark draft's experts are not rebalanced (the draft keeps the plain EP hook, logical ids).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsflash.sharding.eplb import EXPERT_TENSORS, EplbConfig, EplbState, LayerMover, expert_prefix, source_index

TABLE_KEYS = ("eplb.log2phy", "eplb.logcnt")


def check_options(eplb, window, interval, redundant):
    """Engine options -> ValueError naming the field."""
    if not isinstance(eplb, bool):
        raise ValueError(f"eplb: must be True or False, got {eplb!r}")
    for name, v, lo in (("eplb_window", window, 1), ("eplb_interval", interval, 1),
                        ("eplb_redundant_experts", redundant, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name}: must be an integer >= {lo}, got {v!r}")


class EngineEplb:
    """EPLB state of the target model plus the device-side placement (params + tables)."""

    def __init__(self, backend, *, window: int = 1000, interval: int = 3000, redundant: int = 0):
        from jax.sharding import NamedSharding, PartitionSpec
        from dsflash.sharding.rules import expert_axes
        mesh = getattr(backend, "mesh", None)
        if mesh is None or not hasattr(backend, "cfg"):
            raise ValueError("eplb: needs the model on a mesh with data-parallel / expert-parallel size > 1 "
                             "(e.g. mesh=make_mesh('dep=2'))")
        axes = expert_axes(mesh, getattr(backend, "strategy", "dep"))
        n_ep = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if n_ep < 2:
            raise ValueError(f"eplb: the mesh's expert-parallel size is {n_ep}; EPLB needs > 1")
        cfg = backend.cfg
        self.L, self.E, self.n_ep = cfg.num_hidden_layers, cfg.n_routed_experts, n_ep
        try:
            self.state = EplbState(self.L, self.E, n_ep, EplbConfig(window_size=window, step_interval=interval,
                                                                  num_redundant_experts=redundant))
        except ValueError as e:
            raise ValueError(f"eplb_redundant_experts: {e}") from None
        self.P = self.state.P
        self.repl = NamedSharding(mesh, PartitionSpec())
        params = dict(backend.params)
        self.names = [t for t in EXPERT_TENSORS if expert_prefix(0) + t in params]
        if redundant:      # logical [E, ...] -> physical [P, ...] in the start layout, same shardings
            for l in range(self.L):
                idx = jnp.asarray(self.state.phy2log[l], jnp.int32)
                for t in self.names:
                    a = params[expert_prefix(l) + t]
                    params[expert_prefix(l) + t] = jax.device_put(jnp.take(a, idx, axis=0), a.sharding)
        params.update(self._device_tables())
        backend.params = params
        backend.eplb_shape = (self.L, self.P)
        # one compiled gather per distinct layer signature (ahead of time: serving never compiles)
        self._move = {}
        for l in range(self.L):
            arrs = self._layer_arrays(params, l)
            sig = self._sig(arrs)
            if sig not in self._move:
                fn = jax.jit(lambda arrs, src: tuple(jnp.take(a, src, axis=0) for a in arrs),
                             out_shardings=tuple(a.sharding for a in arrs))
                src = jax.device_put(np.arange(self.P, dtype=np.int32), self.repl)
                self._move[sig] = fn.lower(arrs, src).compile()
        self.mover = None           # LayerMover of the latest rebalance (done once every layer is applied)
        self.last_load = None
        self.copies = 0             # expert slots copied so far

    # ------------------------------------------------------------------ helpers
    def _device_tables(self) -> dict:
        t = self.state.tables
        return {"eplb.log2phy": jax.device_put(np.asarray(t.log2phy, np.int32), self.repl),
                "eplb.logcnt": jax.device_put(np.asarray(t.logcnt, np.int32), self.repl)}

    def _layer_arrays(self, params, l):
        return tuple(params[expert_prefix(l) + t] for t in self.names)

    @staticmethod
    def _sig(arrs):
        return tuple((a.shape, str(a.dtype), a.sharding) for a in arrs)

    @property
    def pending(self) -> list[int]:
        """Layers of the latest rebalance not applied yet."""
        return [] if self.mover is None else self.mover.layers[self.mover.pos:]

    @property
    def last_plan(self):
        return None if self.mover is None else self.mover.plan

    def _apply_layer(self, params: dict) -> dict:
        """The next pending layer: its expert arrays by the pre-compiled gather, then its tables (the
        mover's ``set_layer``), uploaded with the params."""
        l = self.mover.layers[self.mover.pos]
        moves = self.mover.plan.moves[l]
        params = dict(params)
        if moves:
            arrs = self._layer_arrays(params, l)
            src = jax.device_put(source_index(moves, self.P), self.repl)
            new = self._move[self._sig(arrs)](arrs, src)
            for t, a in zip(self.names, new):
                params[expert_prefix(l) + t] = a
            self.copies += len(moves)
        self.mover.step()
        params.update(self._device_tables())
        return params

    # ------------------------------------------------------------------ engine hooks
    def after_step(self, load, params: dict) -> dict:
        """One engine step's load ``[L, P]`` (valid rows only); returns the params to use from now on
        (one more layer of a pending rebalance applied, or the first layer of a new one)."""
        self.last_load = np.asarray(load)
        due = self.state.record(self.last_load)
        if not self.pending and due:
            self.mover = LayerMover(self.state, self.state.rebalance())
        if self.pending:
            params = self._apply_layer(params)
        return params

    def rebalance_now(self, params: dict) -> tuple[dict, object]:
        """Run the policy on the window now and apply every layer at once (finishing a pending plan first)."""
        while self.pending:
            params = self._apply_layer(params)
        self.mover = LayerMover(self.state, self.state.rebalance())
        while self.pending:
            params = self._apply_layer(params)
        return params, self.last_plan

    def metrics(self) -> dict:
        m = self.state.metrics()
        out = {"eplb_balancedness": m["balancedness"], "eplb_avg_tokens": m["avg_tokens"],
               "eplb_max_tokens": m["max_tokens"], "eplb_steps_until_rebalance": m["steps_until_rebalance"],
               "eplb_rebalances": m["rebalances"], "eplb_recorded_steps": self.state.recorded_steps,
               "eplb_layers_pending": len(self.pending), "eplb_expert_copies": self.copies,
               "eplb_physical_experts": self.P, "eplb_ep_size": self.n_ep}
        if self.last_plan is not None:
            out["eplb_last_balancedness_before"] = self.last_plan.balancedness_before
            out["eplb_last_balancedness_predicted"] = self.last_plan.balancedness_after
        return out
