"""Expert-parallel load balancing (EPLB), SERVING §2.

Pieces, from policy to runtime:

* **Policy** (host, numpy; DeepSeek's algorithm, re-implemented from its description):
  :func:`balanced_packing` (greedy: heaviest item first into the lightest pack that still has room;
  every pack gets exactly ``n / packs`` items), :func:`replicate_experts` (each extra slot goes to the
  expert with the highest load per replica), :func:`rebalance_hierarchical` (groups -> nodes by
  balanced packing, replicate inside each node, pack replicas onto the node's GPUs) and
  :func:`rebalance_experts` (hierarchical when ``num_groups % num_nodes == 0``, else the global
  policy = the same routine with one group and one node, which still packs GPUs). V4.1 routing has
  no expert groups (one group), so multi-node EP always takes the global policy.
* **Tables** (:class:`EplbTables`, host int32 arrays per layer): ``phy2log [L, P]``, ``log2phy [L, E, R]``
  (-1 padded, ``R = P - E + 1``), ``logcnt [L, E]``.
* **Router** (:func:`route`): maps each (token, top-k slot) to a replica by a position modulo the
  replica count (``spread="position"``: vLLM's flattened ``t*k + j``; default ``"token"``: ``t + j``,
  which stays uniform when top-k comes out sorted) and returns the per-physical-expert load of the
  pass from the same ids (rows masked by ``valid`` - padding / dummy tokens - are not counted).
* **State** (:class:`EplbState`, one per model: target 384 experts, DSpark draft 128): a circular
  window of per-step loads (default 1000 steps) on device, a step counter that starts 3/4 done so the
  first rebalance comes after ``interval/4`` steps and then every ``interval`` (default 3000);
  dummy steps advance the counter but are not recorded. ``balancedness`` = Σ_layers mean rank load /
  Σ_layers max rank load (a ratio of sums, per layer over EP ranks).
* **Weight moves** (:func:`plan_moves`, :class:`LayerMover`): per layer, unchanged slots stay, a slot
  that can be filled from the same rank is a local copy, the rest are remote copies with the
  receivers of one expert split evenly over the ranks that hold it. The mover applies one layer per
  engine step (weights and that layer's tables swap together), so decoding never stops.

In a single-controller SPMD program the per-step load array is already global (jit sums it across
shards), which is the all-reduce over the EP group; in a multi-process job every process records the
same global array.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

EXPERT_TENSORS = ("w1.weight", "w1.scale", "w3.weight", "w3.scale", "w2.weight", "w2.scale")


# ================================================================================ policy (host)
def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each.

    weight [B, n] -> (pack_index [B, n], rank_in_pack [B, n]). Items go heaviest first (stable order
    for ties) into the currently lightest pack with a free place (lowest pack index on ties)."""
    weight = np.asarray(weight, np.float64)
    B, n = weight.shape
    if n % num_packs:
        raise ValueError(f"balanced_packing: {n} items do not divide into {num_packs} packs")
    cap = n // num_packs
    pack = np.zeros((B, n), np.int64)
    rank = np.zeros((B, n), np.int64)
    for b in range(B):
        loads = np.zeros(num_packs)
        counts = np.zeros(num_packs, np.int64)
        for i in np.argsort(-weight[b], kind="stable"):
            p = int(np.argmin(np.where(counts < cap, loads, np.inf)))
            pack[b, i], rank[b, i] = p, counts[p]
            loads[p] += weight[b, i]
            counts[p] += 1
    return pack, rank


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [B, n_log] -> (phy2log [B, num_phy], phy_rank [B, num_phy], logcnt [B, n_log]).

    Slots 0..n_log-1 hold one replica of each expert; every extra slot goes to the expert with the
    highest load per replica (lowest id on ties), minimising the maximum per-replica load."""
    weight = np.asarray(weight, np.float64)
    B, n = weight.shape
    if num_phy < n:
        raise ValueError(f"replicate_experts: {num_phy} physical slots < {n} logical experts")
    phy2log = np.tile(np.arange(num_phy) % n, (B, 1))
    phy_rank = np.zeros((B, num_phy), np.int64)
    logcnt = np.ones((B, n), np.int64)
    for j in range(n, num_phy):
        e = np.argmax(weight / logcnt, axis=1)
        phy2log[:, j] = e
        phy_rank[:, j] = logcnt[np.arange(B), e]
        logcnt[np.arange(B), e] += 1
    return phy2log, phy_rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[-1]), perm.shape), axis=-1)
    return inv


def rebalance_hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int):
    """weight [L, E] -> (phy2log [L, P], phy_rank [L, P], logcnt [L, E]); physical slot p lives on GPU
    ``p // (P / num_gpus)``, GPUs ``g // (num_gpus / num_nodes)`` on one node."""
    weight = np.asarray(weight, np.float64)
    L, E = weight.shape
    for what, a, b in (("experts", E, num_groups), ("groups", num_groups, num_nodes),
                       ("gpus", num_gpus, num_nodes), ("physical slots", num_phy, num_gpus)):
        if a % b:
            raise ValueError(f"EPLB: {a} {what} are not a multiple of {b}")
    if num_phy < E:
        raise ValueError(f"EPLB: {num_phy} physical slots < {E} logical experts")
    gs, gpn = E // num_groups, num_groups // num_nodes
    e_node, p_node, p_gpu = E // num_nodes, num_phy // num_nodes, num_phy // num_gpus
    phy2log = np.zeros((L, num_phy), np.int64)
    phy_rank = np.zeros((L, num_phy), np.int64)
    logcnt = np.zeros((L, E), np.int64)
    for l in range(L):
        w = weight[l]
        # 1. groups -> nodes
        gpack, grank = balanced_packing(w.reshape(num_groups, gs).sum(1)[None], num_nodes)
        e = np.arange(E)
        log2mlog = (gpack[0][e // gs] * gpn + grank[0][e // gs]) * gs + e % gs
        mlog2log = _inverse(log2mlog)
        # 2. replicate inside each node
        wm = w[mlog2log].reshape(num_nodes, e_node)
        p2m, prank, mcnt = replicate_experts(wm, p_node)
        # 3. pack the node's replicas onto its GPUs
        per_replica = np.take_along_axis(wm / mcnt, p2m, axis=1)
        pack, rank = balanced_packing(per_replica, num_gpus // num_nodes)
        pphy2phy = _inverse(pack * p_gpu + rank)
        pp2m = np.take_along_axis(p2m, pphy2phy, axis=1) + (np.arange(num_nodes) * e_node)[:, None]
        phy2log[l] = mlog2log[pp2m.reshape(-1)]
        phy_rank[l] = np.take_along_axis(prank, pphy2phy, axis=1).reshape(-1)
        logcnt[l] = mcnt.reshape(-1)[log2mlog]
    return phy2log, phy_rank, logcnt


def rebalance_experts(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int):
    """DeepSeek's policy: hierarchical when ``num_groups % num_nodes == 0`` (prefill, small EP), else global.

    Returns (phy2log [L, P], log2phy [L, E, P-E+1] (-1 padded), logcnt [L, E]) as numpy int32."""
    if num_nodes < 1 or num_gpus % num_nodes:
        num_nodes = 1  # as vLLM: ranks not divisible by nodes -> one node
    if num_groups % num_nodes == 0:
        phy2log, phy_rank, logcnt = rebalance_hierarchical(weight, num_phy, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phy_rank, logcnt = rebalance_hierarchical(weight, num_phy, 1, 1, num_gpus)
    log2phy, cnt2 = tables_from_phy2log(phy2log, np.asarray(weight).shape[1])
    assert np.array_equal(cnt2, logcnt)
    return phy2log.astype(np.int32), log2phy, logcnt.astype(np.int32)


def tables_from_phy2log(phy2log: np.ndarray, num_logical: int) -> tuple[np.ndarray, np.ndarray]:
    """phy2log [L, P] -> (log2phy [L, E, P-E+1] with replicas in slot order, -1 padded; logcnt [L, E])."""
    phy2log = np.asarray(phy2log)
    L, Pn = phy2log.shape
    R = Pn - num_logical + 1
    log2phy = np.full((L, num_logical, R), -1, np.int32)
    logcnt = np.zeros((L, num_logical), np.int32)
    for l in range(L):
        for p in range(Pn):
            e = phy2log[l, p]
            log2phy[l, e, logcnt[l, e]] = p
            logcnt[l, e] += 1
    if (logcnt == 0).any():
        l, e = np.argwhere(logcnt == 0)[0]
        raise ValueError(f"EPLB: logical expert {e} of layer {l} has no physical replica")
    return log2phy, logcnt


def preserve_slots(old_phy2log: np.ndarray, new_phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """Permute ``new`` inside each rank so experts that stay on a rank keep their old slot (fewer copies;
    rank loads are unchanged because only the order inside a rank changes)."""
    old, new = np.asarray(old_phy2log), np.asarray(new_phy2log).copy()
    L, Pn = new.shape
    S = Pn // num_ranks
    for l in range(L):
        for r in range(num_ranks):
            sl = slice(r * S, (r + 1) * S)
            want = list(new[l, sl])
            placed = [-1] * S
            for i, e in enumerate(old[l, sl]):
                if e in want:
                    placed[i] = e
                    want.remove(e)
            it = iter(want)
            new[l, sl] = [p if p >= 0 else next(it) for p in placed]
    return new


def initial_phy2log(num_layers: int, num_logical: int, num_phy: int) -> np.ndarray:
    """vLLM's start layout: slot p holds logical ``p mod E`` in every layer."""
    return np.tile(np.arange(num_phy, dtype=np.int32) % num_logical, (num_layers, 1))


# ================================================================================ metrics
def rank_loads(phys_load, num_ranks: int):
    """[L, P] per-physical-expert load -> [L, ranks] (slot p on rank p // (P / ranks))."""
    L, Pn = phys_load.shape
    return np.asarray(phys_load, np.float64).reshape(L, num_ranks, Pn // num_ranks).sum(-1)


def balancedness(phys_load, num_ranks: int) -> float:
    """Σ_layers mean-over-ranks load / Σ_layers max-over-ranks load (1.0 = perfect)."""
    rl = rank_loads(phys_load, num_ranks)
    mx = rl.max(1).sum()
    return float(rl.mean(1).sum() / mx) if mx > 0 else 1.0


def physical_load(logical_load, phy2log, logcnt):
    """Expected per-slot load when each expert's load splits evenly over its replicas ([L, E] -> [L, P])."""
    ll = np.asarray(logical_load, np.float64)
    per = ll / np.asarray(logcnt)
    return np.take_along_axis(per, np.asarray(phy2log), axis=1)


# ================================================================================ device tables / router
@jax.tree_util.register_dataclass
@dataclass
class EplbTables:
    """Per-layer placement, numpy int32 on the host (passed into the jitted step as arguments; shapes never
    change, so a swap does not recompile)."""
    phy2log: np.ndarray   # [L, P] int32
    log2phy: np.ndarray   # [L, E, R] int32, -1 padded
    logcnt: np.ndarray    # [L, E] int32

    @classmethod
    def from_phy2log(cls, phy2log, num_logical: int) -> "EplbTables":
        log2phy, logcnt = tables_from_phy2log(phy2log, num_logical)
        return cls(np.array(phy2log, np.int32), np.asarray(log2phy, np.int32), np.asarray(logcnt, np.int32))

    def layer(self, l):
        return EplbTables(self.phy2log[l], self.log2phy[l], self.logcnt[l])

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[-1]


SPREADS = ("token", "position")


def route(idx, log2phy, logcnt, valid=None, num_physical: int | None = None, spread: str = "token"):
    """Logical top-k ids -> physical replica ids, and the per-physical-expert load of this pass.

    idx [T, k] logical ids; log2phy [E, R] / logcnt [E] of one layer; valid [T] (False = padding or
    dummy row: routed but not counted). Replica choice (``spread``):

    * ``"position"``: ``(t * k + j) mod logcnt[e]`` - vLLM's flattened position. With sorted top-k
      (``lax.top_k``) and replica counts dividing k (V4.1: k = 6, counts 2, 3, 6) this degenerates to
      ``j mod count``: an expert that usually wins slot 0 always lands on its first replica.
    * ``"token"`` (default): ``(t + j) mod logcnt[e]`` - the same cheap deterministic spread, but the
      token index always varies the replica, whatever the slot order.

    Returns (phys [T, k] int32, load [P] int32)."""
    T, k = idx.shape
    P = num_physical if num_physical is not None else log2phy.shape[1] + log2phy.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)[:, None]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    if spread == "position":
        pos = t * k + j
    elif spread == "token":
        pos = t + j
    else:
        raise ValueError(f"route: spread must be one of {SPREADS}, got {spread!r}")
    rep = pos % logcnt[idx]
    phys = log2phy[idx, rep]
    w = jnp.ones((T, k), jnp.int32) if valid is None else jnp.broadcast_to(valid[:, None], (T, k)).astype(jnp.int32)
    load = jnp.zeros((P,), jnp.int32).at[phys.reshape(-1)].add(w.reshape(-1))
    return phys.astype(jnp.int32), load


# ================================================================================ weight moves
@dataclass(frozen=True)
class Move:
    dst: int        # physical slot to fill
    src: int        # physical slot (old layout) to copy from
    logical: int
    local: bool     # src and dst on the same rank


def plan_moves(old_phy2log, new_phy2log, num_ranks: int) -> list[list[Move]]:
    """Per layer, the copies that turn the old layout into the new one (reads are from the old layout).

    Unchanged slots are skipped; a slot whose expert the same rank already holds is a local copy; the
    remaining receivers of one expert are split round-robin over all old holders (sorted by expert id,
    then destination slot, so every rank computes the same plan)."""
    old, new = np.asarray(old_phy2log), np.asarray(new_phy2log)
    L, Pn = new.shape
    S = Pn // num_ranks
    plan = []
    for l in range(L):
        moves: list[Move] = []
        remote: dict[int, list[int]] = {}
        for p in range(Pn):
            e = int(new[l, p])
            if old[l, p] == e:
                continue
            r = p // S
            local = [s for s in range(r * S, (r + 1) * S) if old[l, s] == e]
            if local:
                moves.append(Move(p, local[0], e, True))
            else:
                remote.setdefault(e, []).append(p)
        for e in sorted(remote):
            senders = [int(s) for s in np.flatnonzero(old[l] == e)]
            if not senders:
                raise ValueError(f"plan_moves: layer {l} needs expert {e} which no slot holds")
            for i, p in enumerate(sorted(remote[e])):
                moves.append(Move(p, senders[i % len(senders)], e, False))
        plan.append(sorted(moves, key=lambda m: m.dst))
    return plan


def source_index(moves: list[Move], num_physical: int) -> np.ndarray:
    """One layer's moves as a gather index: new_slot[p] = old_slot[src[p]]."""
    src = np.arange(num_physical, dtype=np.int32)
    for m in moves:
        src[m.dst] = m.src
    return src


def expert_prefix(layer: int, draft: bool = False) -> str:
    return f"mtp.{layer}.ffn.experts." if draft else f"layers.{layer}.ffn.experts."


def apply_layer_moves(params: dict, layer: int, moves: list[Move], num_physical: int, draft: bool = False) -> dict:
    """Return params with layer ``layer``'s stacked physical expert arrays re-laid out (a gather; the
    result keeps each array's sharding, XLA moves the bytes between devices)."""
    if not moves:
        return params
    src = jnp.asarray(source_index(moves, num_physical))
    out = dict(params)
    pre = expert_prefix(layer, draft)
    for t in EXPERT_TENSORS:
        a = params[pre + t]
        out[pre + t] = _take0(a, src)
    return out


@jax.jit
def _take0(a, src):
    return jnp.take(a, src, axis=0)


def expand_to_physical(params: dict, phy2log, num_layers: int, draft: bool = False) -> dict:
    """Logical stacked experts ``[E, ...]`` -> physical ``[P, ...]`` following ``phy2log [L, P]``; an array placed
    on a mesh keeps its sharding (the EP split of the expert dim)."""
    out = dict(params)
    for l in range(num_layers):
        pre = expert_prefix(l, draft)
        idx = jnp.asarray(np.asarray(phy2log)[l], jnp.int32)
        for t in EXPERT_TENSORS:
            a = params[pre + t]
            sh = getattr(a, "sharding", None)
            out[pre + t] = (_take_rows(sh)(a, idx) if isinstance(sh, jax.sharding.NamedSharding)
                            else jnp.take(a, idx, axis=0))
    return out


@functools.lru_cache(maxsize=None)
def _take_rows(sharding):
    """``take(a, idx, axis=0)`` with its output placed like ``a`` (one function per sharding: compiles per shape)."""
    return jax.jit(lambda a, idx: jnp.take(a, idx, axis=0), out_shardings=sharding)


# ================================================================================ state
@dataclass(frozen=True)
class EplbConfig:
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    num_groups: int = 1
    num_nodes: int = 1
    preserve_slots: bool = True
    log_balancedness: bool = False

    def __post_init__(self):
        if self.window_size < 1 or self.step_interval < 1:
            raise ValueError("EplbConfig: window_size and step_interval must be >= 1")
        if self.num_redundant_experts < 0:
            raise ValueError("EplbConfig.num_redundant_experts must be >= 0")


@dataclass
class RebalancePlan:
    old_phy2log: np.ndarray
    new_phy2log: np.ndarray
    moves: list[list[Move]]
    balancedness_before: float
    balancedness_after: float      # predicted from the window (loads split evenly over replicas)

    @property
    def num_copies(self) -> int:
        return sum(len(m) for m in self.moves)


class EplbState:
    """EPLB bookkeeping of one model (target or DSpark draft) on one EP group of ``num_ranks`` ranks."""

    def __init__(self, num_layers: int, num_logical: int, num_ranks: int, config: EplbConfig = EplbConfig(),
                 name: str = "target", draft: bool = False):
        """Window, tables and swaps are numpy on the host, so recording and rebalancing never trace or compile
        anything (the engine reads each step's load back anyway); the tables enter jitted code as arguments."""
        self.name, self.draft, self.config = name, draft, config
        self.L, self.E, self.num_ranks = num_layers, num_logical, num_ranks
        self.P = num_logical + config.num_redundant_experts
        if self.P % num_ranks:
            raise ValueError(f"EPLB[{name}]: {num_logical} experts + {config.num_redundant_experts} redundant = "
                             f"{self.P} physical slots do not divide over {num_ranks} EP ranks")
        self.phy2log = initial_phy2log(self.L, self.E, self.P)
        self.tables = EplbTables.from_phy2log(self.phy2log, self.E)
        self.window = np.zeros((config.window_size, self.L, self.P), np.int64)
        self._window_sum = np.zeros((self.L, self.P), np.int64)
        self.window_pos = 0
        self.recorded_steps = 0
        self.step = 0
        self.steps_since = config.step_interval - config.step_interval // 4
        self.history: list[dict] = []

    @classmethod
    def for_model(cls, cfg, num_ranks: int, config: EplbConfig = EplbConfig(), draft: bool = False) -> "EplbState":
        """Separate states: target (n_routed_experts, every backbone layer) and draft (dspark_n_routed_experts,
        every DSpark stage)."""
        if draft:
            return cls(cfg.n_stages, cfg.dspark_n_routed_experts, num_ranks, config, "draft", True)
        return cls(cfg.num_hidden_layers, cfg.n_routed_experts, num_ranks, config, "target", False)

    # ---------------------------------------------------------------- per step
    def record(self, load, dummy: bool = False) -> bool:
        """Add one engine step's load ``[L, P]`` (from :func:`route`); dummy steps only advance the
        counter. Returns True when a rebalance is due (call :meth:`rebalance`)."""
        if not dummy:
            load = np.rint(np.asarray(load)).astype(np.int64)
            self._window_sum += load - self.window[self.window_pos]
            self.window[self.window_pos] = load
            self.window_pos = (self.window_pos + 1) % self.config.window_size
            self.recorded_steps += 1
        self.step += 1
        self.steps_since += 1
        return self.steps_since >= self.config.step_interval

    @property
    def steps_until_rebalance(self) -> int:
        return max(0, self.config.step_interval - self.steps_since)

    def window_load(self) -> np.ndarray:
        """Per-physical-slot load summed over the window [L, P] (a copy)."""
        return self._window_sum.copy()

    def logical_window_load(self) -> np.ndarray:
        pl = self.window_load()
        out = np.zeros((self.L, self.E), np.int64)
        for l in range(self.L):
            np.add.at(out[l], self.phy2log[l], pl[l])
        return out

    def balancedness(self) -> float:
        return balancedness(self.window_load(), self.num_ranks)

    def metrics(self) -> dict:
        """What the engine logs / exports (Prometheus gauges): balancedness and rank token loads."""
        rl = rank_loads(self.window_load(), self.num_ranks)
        return {"model": self.name, "step": self.step, "balancedness": balancedness(self.window_load(), self.num_ranks),
                "avg_tokens": float(rl.mean(1).sum()), "max_tokens": float(rl.max(1).sum()),
                "steps_until_rebalance": self.steps_until_rebalance, "rebalances": len(self.history)}

    # ---------------------------------------------------------------- rebalance
    def rebalance(self) -> RebalancePlan:
        """Run the policy on the window's load; returns the plan (tables are not swapped yet: apply it with
        :class:`LayerMover` layer by layer, or :meth:`commit` all at once)."""
        c = self.config
        logical = self.logical_window_load()
        new, _, logcnt = rebalance_experts(logical, self.P, c.num_groups, c.num_nodes, self.num_ranks)
        if c.preserve_slots:
            new = preserve_slots(self.phy2log, new, self.num_ranks)
        before = self.balancedness()
        after = balancedness(physical_load(logical, new, logcnt), self.num_ranks)
        self.steps_since = 0
        plan = RebalancePlan(self.phy2log.copy(), new, plan_moves(self.phy2log, new, self.num_ranks), before, after)
        self.history.append({"step": self.step, "before": before, "predicted_after": after, "copies": plan.num_copies})
        return plan

    def set_layer(self, layer: int, phy2log_row) -> None:
        """Swap one layer's tables in place (shapes never change: the jitted step does not recompile)."""
        self.phy2log[layer] = np.asarray(phy2log_row)
        log2phy, logcnt = tables_from_phy2log(self.phy2log[layer:layer + 1], self.E)
        t = self.tables
        t.phy2log[layer], t.log2phy[layer], t.logcnt[layer] = self.phy2log[layer], log2phy[0], logcnt[0]

    def commit(self, plan: RebalancePlan, params: dict | None = None) -> dict | None:
        """Apply every layer at once (stop-the-world variant; tests and offline use)."""
        mover = LayerMover(self, plan)
        while not mover.done:
            params = mover.step(params)
        return params

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "phy2log": self.phy2log.tolist(), "history": self.history})


class LayerMover:
    """Applies a :class:`RebalancePlan` one MoE layer per call, between decode steps: the layer's
    physical expert arrays are re-laid out and its tables swapped in the same call, so every forward sees
    each layer either fully old or fully new (SERVING §2.3 async mode, with one layer of staging)."""

    def __init__(self, state: EplbState, plan: RebalancePlan):
        self.state, self.plan = state, plan
        self.layers = [l for l in range(state.L) if plan.moves[l] or
                       not np.array_equal(plan.old_phy2log[l], plan.new_phy2log[l])]
        self.pos = 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.layers)

    def step(self, params: dict | None = None) -> dict | None:
        if self.done:
            return params
        l = self.layers[self.pos]
        if params is not None:
            params = apply_layer_moves(params, l, self.plan.moves[l], self.state.P, self.state.draft)
        self.state.set_layer(l, self.plan.new_phy2log[l])
        self.pos += 1
        return params


# ================================================================================ synthetic routing
def zipf_popularity(num_layers: int, num_experts: int, a: float = 1.2, seed: int = 0) -> np.ndarray:
    """Per-layer expert popularity ∝ rank^-a with an independent random permutation per layer."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, num_experts + 1) ** a
    base /= base.sum()
    return np.stack([base[rng.permutation(num_experts)] for _ in range(num_layers)])


def sample_topk(popularity_row: np.ndarray, num_tokens: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[T, k] distinct expert ids per token drawn by popularity (Gumbel top-k)."""
    g = rng.gumbel(size=(num_tokens, popularity_row.shape[0]))
    return np.argsort(-(np.log(popularity_row)[None] + g), axis=1)[:, :k].astype(np.int32)
