"""Expert-parallel routed MoE: ``dsflash.kernels.moe_gemm.routed_moe`` wrapped in ``shard_map``.

The stacked expert arrays ``w* [E, ...]`` are split over the EP mesh axes (``expert`` rule of the
strategy: ``dep`` [x ``ep`` x ``tp``]); token rows ``x [T, d]`` over the DP axes (``batch`` rule). Each
device runs the unchanged single-device kernel on its local expert slice with expert ids remapped to
``0 .. E_loc-1``; assignments to other devices' experts get the id ``E_loc`` (one past the last group:
the grouped GEMM drops them) and routing weight 0. ``idx`` holds *physical* expert ids: with EPLB
replicas, map logical ids first (:func:`dsflash.sharding.eplb.route`).

Two dispatch/combine collectives (``EPSettings.collective``):

* ``"allgather"`` (default; JAX_LANDSCAPE §6.5): all-gather the token rows (and ids/weights) over the
  DP∩EP axes -> local grouped GEMM over every gathered (token, slot) that hits a local expert ->
  ``psum`` over EP axes that do not split tokens (e.g. ``tp`` in ``dep=8,tp=2``) -> ``psum_scatter``
  back to each rank's rows. Works for any DP/EP axis combination.
* ``"all_to_all"``: each rank packs its (token, slot) pairs per destination rank into a buffer of
  ``[n_ep, C, d]``, one ``all_to_all`` sends them, the owner computes, a second ``all_to_all`` returns
  the outputs, and the sender scatter-adds them into its rows. Needs tokens split over the same axes
  as the experts.

Two paths (``EPSettings.mode``), both with static shapes under jit:

* ``"prefill"``: variable token counts; the buffer holds every (token, slot) (no drops, exact for any
  routing); after the kernel's stable sort the local assignments form one contiguous segment per
  expert (DeepEP "normal" layout) and the non-local ones sit past the last group.
* ``"decode"``: a fixed capacity per local expert (allgather) or per destination rank (all_to_all),
  independent of the routing (DeepEP "low-latency" masked layout ``[E_loc, C]``). Assignments past
  the capacity are dropped and counted (``return_stats=True``); with ``capacity`` large enough it is
  exact. Default capacity: ``ceil(capacity_factor * T * k / E)`` rows per expert.

Both are exact w.r.t. the single-device ``routed_moe`` up to the order of the fp32 sum over a
token's k expert outputs (bit-exact when at most two of a token's experts live on different devices).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dsflash.kernels.moe_gemm import routed_moe
from dsflash.model.moe import expert_load
from dsflash.sharding.mesh import mesh_sizes
from dsflash.sharding.rules import expert_axes as _strategy_expert_axes
from dsflash.sharding.rules import token_axes as _strategy_token_axes

COLLECTIVES = ("allgather", "all_to_all")
MODES = ("prefill", "decode")


@dataclass(frozen=True)
class EPSettings:
    """Static settings of one expert-parallel MoE call (hashable).

    collective       "allgather" | "all_to_all"
    mode             "prefill" (no drops) | "decode" (fixed capacity, masked layout)
    capacity         decode rows per local expert (allgather) / per destination rank (all_to_all);
                     None = ceil(capacity_factor * rows * k / n) with rows/n as seen by that buffer
    capacity_factor  slack of the default capacity
    token_axes       mesh axes splitting token rows (None: the strategy's ``batch`` rule)
    expert_axes      mesh axes splitting experts (None: the strategy's ``expert`` rule)
    strategy         rule table the defaults come from
    """
    collective: str = "allgather"
    mode: str = "prefill"
    capacity: int | None = None
    capacity_factor: float = 2.0
    token_axes: tuple | None = None
    expert_axes: tuple | None = None
    strategy: str = "dep"

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ValueError(f"EPSettings.collective must be one of {COLLECTIVES}, got {self.collective!r}")
        if self.mode not in MODES:
            raise ValueError(f"EPSettings.mode must be one of {MODES}, got {self.mode!r}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError("EPSettings.capacity must be >= 1")
        if self.capacity_factor <= 0:
            raise ValueError("EPSettings.capacity_factor must be > 0")

    def axes(self, mesh) -> tuple[tuple, tuple]:
        tok = tuple(self.token_axes) if self.token_axes is not None else _strategy_token_axes(mesh, self.strategy)
        exp = tuple(self.expert_axes) if self.expert_axes is not None else _strategy_expert_axes(mesh, self.strategy)
        return tok, exp


def default_capacity(rows: int, k: int, n: int, factor: float) -> int:
    """Rows per group when ``rows * k`` assignments spread over ``n`` groups, with slack ``factor``."""
    return max(1, min(rows * k, int(math.ceil(factor * rows * k / n))))


def _linear_index(axes, sizes):
    """This device's index along the flattened ``axes`` (row-major, as a PartitionSpec tuple entry)."""
    i = jnp.int32(0)
    for a in axes:
        i = i * sizes[a] + jax.lax.axis_index(a)
    return i


def _rank_in_group(gid, n_groups):
    """For flat group ids (``n_groups`` = dropped), the 0-based arrival order of each entry in its group."""
    order = jnp.argsort(gid, stable=True)
    counts = jnp.bincount(gid, length=n_groups + 1)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.zeros_like(gid).at[order].set(jnp.arange(gid.shape[0], dtype=gid.dtype))
    return pos - starts[gid]


def _pack(gid, n_groups, cap, rows_of):
    """Capacity-limited masked layout: entry -> slot ``gid * cap + rank`` (dropped past ``cap``).

    Returns (slot_row [n_groups*cap] index into the entries (== len(entries) for empty slots),
    n_dropped)."""
    n = gid.shape[0]
    rank = _rank_in_group(gid, n_groups)
    keep = (gid < n_groups) & (rank < cap)
    slot = jnp.where(keep, gid * cap + rank, n_groups * cap)
    slot_row = jnp.full((n_groups * cap,), n, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    dropped = jnp.sum((gid < n_groups) & ~keep)
    return slot_row, dropped


def ep_routed_moe(x, idx, weight, w1, s1, w3, s3, w2, s2, *, mesh, limit, precision="reference", backend="xla",
                  settings: EPSettings = EPSettings(), valid=None, return_stats: bool = False):
    """Expert-parallel ``routed_moe``: same arguments plus ``mesh``/``settings``; ``valid [T]`` masks
    padding/dummy rows (they get no expert output). Returns ``[T, d]`` float32 sharded over the token
    axes (and ``{"dropped": int32}`` summed over devices when ``return_stats``)."""
    tok_axes, exp_axes = settings.axes(mesh)
    sizes = mesh_sizes(mesh)
    T, d = x.shape
    k = idx.shape[1]
    E = w1.shape[0]
    n_tok = int(np.prod([sizes[a] for a in tok_axes])) if tok_axes else 1
    n_ep = int(np.prod([sizes[a] for a in exp_axes])) if exp_axes else 1
    if T % n_tok:
        raise ValueError(f"ep_routed_moe: {T} token rows do not divide over token axes {tok_axes} ({n_tok}); "
                         "pad the batch (dsflash.sharding.dp_balance.pad_to_max)")
    if E % n_ep:
        raise ValueError(f"ep_routed_moe: {E} physical experts do not divide over expert axes {exp_axes} ({n_ep})")
    gather_axes = tuple(a for a in exp_axes if a in tok_axes)   # token rows spread over these EP ranks
    reduce_axes = tuple(a for a in exp_axes if a not in tok_axes)  # EP ranks that see the same rows
    if settings.collective == "all_to_all" and reduce_axes:
        raise ValueError(f"ep_routed_moe: all_to_all needs tokens split over every expert axis; expert axes "
                         f"{reduce_axes} do not split tokens (use collective='allgather')")
    if valid is None:
        valid = jnp.ones((T,), jnp.bool_)
    kern = partial(routed_moe, limit=limit, precision=precision, backend=backend)
    E_loc = E // n_ep
    T_loc = T // n_tok

    def allgather_body(x, idx, weight, valid, w1, s1, w3, s3, w2, s2):
        if gather_axes:
            x, idx, weight, valid = (jax.lax.all_gather(a, gather_axes, axis=0, tiled=True)
                                     for a in (x, idx, weight, valid))
        rows = x.shape[0]
        lo = _linear_index(exp_axes, sizes) * E_loc
        local = (idx >= lo) & (idx < lo + E_loc) & valid[:, None]
        lidx = jnp.where(local, idx - lo, E_loc).astype(jnp.int32)
        lw = jnp.where(local, weight, 0.0).astype(weight.dtype)
        dropped = jnp.int32(0)
        if settings.mode == "prefill":
            out = kern(x, lidx, lw, w1, s1, w3, s3, w2, s2)
        else:
            cap = settings.capacity or default_capacity(rows, k, E, settings.capacity_factor)
            slot_row, dropped = _pack(lidx.reshape(-1), E_loc, cap, rows * k)
            tok = jnp.where(slot_row < rows * k, slot_row // k, rows)          # rows = the zero pad row
            filled = slot_row < rows * k
            bid = jnp.where(filled, jnp.arange(E_loc * cap, dtype=jnp.int32) // cap, E_loc)
            bw = jnp.where(filled, lw.reshape(-1)[jnp.minimum(slot_row, rows * k - 1)], 0.0)
            xp = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)], axis=0)
            ob = kern(xp[tok], bid[:, None], bw[:, None].astype(weight.dtype), w1, s1, w3, s3, w2, s2)
            out = jnp.zeros((rows + 1, d), jnp.float32).at[tok].add(ob)[:rows]
        if reduce_axes:
            out = jax.lax.psum(out, reduce_axes)
        if gather_axes:
            out = jax.lax.psum_scatter(out, gather_axes, scatter_dimension=0, tiled=True)
        return out, jax.lax.psum(dropped, exp_axes) if exp_axes else dropped

    def a2a_body(x, idx, weight, valid, w1, s1, w3, s3, w2, s2):
        n_rows = T_loc * k
        dest = jnp.where(valid[:, None], idx // E_loc, n_ep).reshape(-1).astype(jnp.int32)
        if settings.mode == "prefill":
            cap = n_rows
        else:
            cap = settings.capacity or default_capacity(T_loc, k, n_ep, settings.capacity_factor)
        slot_row, dropped = _pack(dest, n_ep, cap, n_rows)
        filled = slot_row < n_rows
        srow = jnp.minimum(slot_row, n_rows - 1)
        tok = jnp.where(filled, slot_row // k, T_loc)
        send_id = jnp.where(filled, idx.reshape(-1)[srow] % E_loc, E_loc).astype(jnp.int32)
        send_w = jnp.where(filled, weight.reshape(-1)[srow], 0.0).astype(weight.dtype)
        xp = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)], axis=0)
        send_x = xp[tok]

        def a2a(a):
            a = a.reshape(n_ep, cap, *a.shape[1:])
            a = jax.lax.all_to_all(a, exp_axes, 0, 0, tiled=True)
            return a.reshape(n_ep * cap, *a.shape[2:])

        rx, rid, rw = a2a(send_x), a2a(send_id), a2a(send_w)
        o = kern(rx, rid[:, None], rw[:, None], w1, s1, w3, s3, w2, s2)
        back = a2a(o)
        out = jnp.zeros((T_loc + 1, d), jnp.float32).at[tok].add(back)[:T_loc]
        return out, jax.lax.psum(dropped, exp_axes)

    body = allgather_body if settings.collective == "allgather" else a2a_body
    tok_spec = P(tok_axes if len(tok_axes) != 1 else tok_axes[0]) if tok_axes else P()
    exp_spec = P(exp_axes if len(exp_axes) != 1 else exp_axes[0]) if exp_axes else P()
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(tok_spec, tok_spec, tok_spec, tok_spec) + (exp_spec,) * 6,
                       out_specs=(tok_spec, P()))
    out, dropped = fn(x, idx.astype(jnp.int32), weight, valid, w1, s1, w3, s3, w2, s2)
    if return_stats:
        return out, {"dropped": dropped}
    return out


def make_routed_fn(mesh, settings: EPSettings = EPSettings(), log2phy=None, logcnt=None, spread: str = "token",
                   return_load: bool = False):
    """A drop-in for ``routed_moe`` (same signature) that runs expert-parallel on ``mesh``: pass it as the
    model's ``routed_fn`` hook (``dsflash.model.forward.forward(..., routed_fn=...)``). With no expert
    axes (e.g. a draft whose experts are replicated) every device runs its own token rows.

    With ``log2phy [E, R]`` / ``logcnt [E]`` (one layer's EPLB tables) the incoming ids are logical and
    the expert arrays physical (``[P, ...]``, redundant replicas): ids are mapped to replicas first
    (:func:`dsflash.sharding.eplb.route`). ``log2phy`` / ``logcnt`` may also be dicts keyed by block name
    (``"layers.3"``, ``"mtp.0"``): the model passes that name as ``layer=``; a block missing from the dict
    runs on logical ids (no EPLB). The tables may be traced arrays (build the hook inside the jitted step
    to pass them as arguments: new tables then need no recompilation).

    ``return_load=True`` (the engine's EPLB recording): the hook also takes ``valid=`` (``[T]``, False =
    padding / dummy rows) and returns ``(out, load [P] float32)``, the per-physical-expert token count of
    the pass over valid rows; it carries ``returns_load = True`` so ``dsflash.model.moe`` knows."""

    def routed_fn(x, idx, weight, w1, s1, w3, s3, w2, s2, *, limit, precision="reference", backend="xla",
                  layer=None, valid=None):
        load = None
        if log2phy is not None and not (isinstance(log2phy, dict) and layer not in log2phy):
            from dsflash.sharding.eplb import route
            l2p = log2phy[layer] if isinstance(log2phy, dict) else log2phy
            cnt = logcnt[layer] if isinstance(logcnt, dict) else logcnt
            idx, load = route(idx, jnp.asarray(l2p), jnp.asarray(cnt), valid=valid, num_physical=w1.shape[0],
                              spread=spread)
        out = ep_routed_moe(x, idx, weight, w1, s1, w3, s3, w2, s2, mesh=mesh, limit=limit, precision=precision,
                            backend=backend, settings=settings, valid=valid)
        if not return_load:
            return out
        if load is None:                    # no EPLB tables for this block: ids are already physical
            load = expert_load(idx, valid, w1.shape[0])
        return out, load.astype(jnp.float32)

    routed_fn.returns_load = return_load
    return routed_fn
