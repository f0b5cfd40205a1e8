"""Logical-axis -> mesh-axis rule tables, one per strategy, and the shardings they give.

Every parameter carries logical axis names (``ParamSpec.axes`` in :mod:`dsflash.model.params`);
state and batch arrays get theirs here (``slots``, ``pages``, ``batch``). A strategy is a rule table
in the MaxText style: an ordered tuple of ``(logical_axis, mesh_axes)`` where ``mesh_axes`` is a tuple
of mesh axis names (or ``None`` = replicated). Mesh axes the mesh does not have are dropped, so one
table serves ``dep=8`` and ``dep=8,tp=2`` alike. The tables are also valid flax logical-axis rules
(``flax.linen.logical_to_mesh_sharding(..., rules=strategy.rules)``), but resolution here is strict:
a mesh axis used twice in one tensor is an error (flax would silently skip it).

Strategies (SERVING §2-3, DESIGN §6):

* ``dep`` - attention data-parallel over the devices (batch rows, state slots and KV pages over
  ``dp``/``dep``), routed experts expert-parallel over the same devices (``dep`` x ``ep`` x ``tp``),
  dense weights replicated; with a ``tp`` axis, heads / vocab / shared-expert mlp also split over it.
* ``wide_ep`` - the same table at 32-72 devices with redundant experts (EPLB replicas): the stacked
  expert arrays hold ``E + redundant`` physical slots, which must divide over the EP axes.
* ``tp`` - tensor parallel: attention heads, vocab, dense and routed-expert intermediate dims over ``tp``.

Validation (:func:`param_partition_specs`) runs before any array exists and raises ValueError naming
the tensor for: unknown logical axes, a mesh axis used twice in one tensor, a dimension that does not
divide over its mesh axes, and any shard that would split a quantisation block (FP8 32x32 weight
blocks, MXFP4 32-element K groups - 16 packed bytes -, Engram FP8 rows per 32, and their UE8M0 scales).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dsflash.config import ModelConfig
from dsflash.model.params import ParamSpec, is_draft, param_specs
from dsflash.sharding.mesh import MESH_AXES, mesh_sizes, mesh_spec

# Logical axes of activations / state / batch (parameters' axes come from params.py).
STATE_AXES = ("batch", "slots", "pages", "tokens")
PARAM_AXES = ("vocab", "embed", "q_lora", "q_heads", "kv_latent", "o_lora", "mlp", "moe_mlp", "expert",
              "index_heads", "engram_rows", "engram_kv", "heads", "embed_hc")

_DP = ("dp", "dep")
_TP = ("tp",)

DEP_RULES = (
    # data-parallel attention: rows of a call, per-sequence state and KV pages live on one DP rank
    ("batch", _DP), ("tokens", _DP), ("slots", _DP), ("pages", _DP),
    # expert parallel over every non-pure-DP device (EP group = dep x ep x tp, as vLLM's DP x TP)
    ("expert", ("dep", "ep", "tp")),
    # inside a DEP rank a tp axis splits attention heads, the O-LoRA groups, vocab and the shared expert
    ("heads", _TP), ("q_heads", _TP), ("index_heads", _TP), ("o_lora", _TP), ("vocab", _TP), ("mlp", _TP),
    # replicated
    ("embed", None), ("q_lora", None), ("kv_latent", None), ("moe_mlp", None), ("engram_rows", None),
    ("engram_kv", None), ("embed_hc", None),
)

WIDE_EP_RULES = DEP_RULES  # same placement; wide-EP differs by redundant expert slots (Strategy fields)

TP_RULES = (
    ("batch", _DP), ("tokens", _DP), ("slots", _DP), ("pages", _DP),
    ("expert", ("dep", "ep")),
    ("heads", _TP), ("q_heads", _TP), ("index_heads", _TP), ("o_lora", _TP), ("vocab", _TP), ("mlp", _TP),
    ("moe_mlp", _TP),
    ("embed", None), ("q_lora", None), ("kv_latent", None), ("engram_rows", None), ("engram_kv", None),
    ("embed_hc", None),
)

RULE_TABLES = {"dep": DEP_RULES, "wide_ep": WIDE_EP_RULES, "tp": TP_RULES}


@dataclass(frozen=True)
class Strategy:
    """A named rule table plus the expert-slot counts it implies (hashable: usable as a static arg).

    redundant_experts        extra physical expert slots of every backbone MoE layer (EPLB replicas)
    draft_redundant_experts  the same for the DSpark draft's MoE (separate EPLB state, 128 experts)
    draft_expert_parallel    False: the draft's routed experts are replicated (data-parallel draft MoE),
                             e.g. when its expert count does not divide the EP group and no replicas are set
    """
    name: str
    rules: tuple
    redundant_experts: int = 0
    draft_redundant_experts: int = 0
    draft_expert_parallel: bool = True

    def __post_init__(self):
        object.__setattr__(self, "rules", _normalise_rules(self.rules, self.name))
        if self.redundant_experts < 0 or self.draft_redundant_experts < 0:
            raise ValueError(f"Strategy {self.name!r}: redundant expert counts must be >= 0")

    def rule(self, logical: str):
        for k, v in self.rules:
            if k == logical:
                return v
        raise ValueError(f"Strategy {self.name!r}: no rule for logical axis {logical!r}")

    def physical_experts(self, cfg: ModelConfig, draft: bool = False) -> int:
        if draft:
            return cfg.dspark_n_routed_experts + self.draft_redundant_experts
        return cfg.n_routed_experts + self.redundant_experts

    def replace(self, **kw) -> "Strategy":
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        s = self.name
        if self.redundant_experts or self.draft_redundant_experts:
            s += f"+r{self.redundant_experts}-{self.draft_redundant_experts}"
        if not self.draft_expert_parallel:
            s += "+draft_dp"
        return s


def _normalise_rules(rules, name):
    out = []
    seen = set()
    for item in rules:
        if len(item) != 2:
            raise ValueError(f"Strategy {name!r}: rule {item!r} is not (logical_axis, mesh_axes)")
        logical, axes = item
        if logical in seen:
            raise ValueError(f"Strategy {name!r}: logical axis {logical!r} has two rules")
        seen.add(logical)
        if axes is None:
            out.append((logical, None))
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            if a not in MESH_AXES:
                raise ValueError(f"Strategy {name!r}: rule for {logical!r} names unknown mesh axis {a!r}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"Strategy {name!r}: rule for {logical!r} uses a mesh axis twice: {axes}")
        out.append((logical, axes))
    return tuple(out)


def get_strategy(strategy: "str | Strategy", **kw) -> Strategy:
    """``"dep"``, ``"wide_ep"``, ``"tp"`` (keyword overrides: redundant_experts=..., ...) or a Strategy."""
    if isinstance(strategy, Strategy):
        return strategy.replace(**kw) if kw else strategy
    if strategy not in RULE_TABLES:
        raise ValueError(f"unknown sharding strategy {strategy!r}; known: {', '.join(RULE_TABLES)}")
    return Strategy(strategy, RULE_TABLES[strategy], **kw)


# ---------------------------------------------------------------------------------- resolution
def resolve_axes(logical: str | None, sizes: Mapping[str, int], strategy: Strategy):
    """Mesh axes (a tuple, possibly empty) that one logical axis maps to on this mesh."""
    if logical is None:
        return ()
    axes = strategy.rule(logical)
    if axes is None:
        return ()
    return tuple(a for a in axes if a in sizes)


def _spec_entry(axes):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def logical_to_spec(axes: tuple, sizes: Mapping[str, int], strategy: Strategy, tensor: str = "<array>") -> P:
    """PartitionSpec of a tensor with logical ``axes``; ValueError naming ``tensor`` on a collision."""
    used: dict[str, str] = {}
    entries = []
    for logical in axes:
        mesh_axes = resolve_axes(logical, sizes, strategy)
        for a in mesh_axes:
            if a in used:
                raise ValueError(f"{tensor}: mesh axis {a!r} is used by both logical axes {used[a]!r} and "
                                 f"{logical!r} under strategy {strategy.name!r} (colliding mesh axes)")
            used[a] = logical
        entries.append(_spec_entry(mesh_axes))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _ways(entry, sizes) -> int:
    if entry is None:
        return 1
    axes = (entry,) if isinstance(entry, str) else entry
    return int(np.prod([sizes[a] for a in axes]))


def physical_shape(spec: ParamSpec, cfg: ModelConfig, strategy: Strategy) -> tuple:
    """The stored shape under ``strategy``: stacked expert arrays hold the physical (replica) slots."""
    shape = list(spec.shape)
    if "expert" in spec.axes:
        shape[spec.axes.index("expert")] = strategy.physical_experts(cfg, draft=is_draft(spec.name))
    return tuple(shape)


def check_divisible(name: str, shape: tuple, fmt: str, axes: tuple, pspec: P, sizes: Mapping[str, int]) -> None:
    """Raise ValueError naming ``name`` when a shard does not divide a dim or splits a quant block."""
    entries = list(pspec) + [None] * (len(shape) - len(pspec))
    nd = len(shape)
    for i, (dim, entry) in enumerate(zip(shape, entries)):
        n = _ways(entry, sizes)
        if n == 1:
            continue
        where = f"dim {i} (logical {axes[i]!r}, size {dim}) over mesh axes {entry!r} = {n} ways"
        if dim % n:
            hint = (" (use wide_ep with redundant experts so that experts + redundant divide the EP group, "
                    "or draft_expert_parallel=False for the draft)" if axes[i] == "expert" else "")
            raise ValueError(f"{name}: {where} does not divide evenly{hint}")
        local = dim // n
        if fmt == "fp8" and i >= nd - 2 and local % 32:
            raise ValueError(f"{name}: {where} gives {local} per shard, which splits the FP8 32x32 weight "
                             f"blocks (and their UE8M0 scales); need a multiple of 32")
        if fmt == "mxfp4" and i == nd - 1 and local % 16:
            raise ValueError(f"{name}: {where} gives {local} packed bytes ({2 * local} elements) per shard, "
                             f"which splits the MXFP4 32-element K groups; need a multiple of 16 bytes")
        if fmt == "fp8rows" and i == nd - 1 and local % 32:
            raise ValueError(f"{name}: {where} gives {local} per shard, which splits the FP8 row scale groups "
                             f"of 32")


def _tensor_axes(spec: ParamSpec, cfg: ModelConfig, strategy: Strategy) -> tuple:
    if not strategy.draft_expert_parallel and is_draft(spec.name) and "expert" in spec.axes:
        return tuple(None if a == "expert" else a for a in spec.axes)
    return spec.axes


def param_partition_specs(cfg: ModelConfig, mesh, strategy: "str | Strategy" = "dep",
                          include_host: bool = True) -> dict[str, P]:
    """Validated PartitionSpec of every parameter. ``mesh``: Mesh, AbstractMesh, spec string or sizes dict."""
    strategy = get_strategy(strategy)
    sizes = mesh_sizes(mesh)
    specs = param_specs(cfg)
    by_name = {s.name: s for s in specs}
    out: dict[str, P] = {}
    for s in specs:
        if s.host and not include_host:
            continue
        axes = _tensor_axes(s, cfg, strategy)
        ps = logical_to_spec(axes, sizes, strategy, s.name)
        fmt = s.fmt
        if fmt == "scale":  # a scale shards like its weight; check the weight's block rule on the weight shape
            w = by_name.get(s.name[: -len(".scale")] + ".weight")
            if w is not None:
                check_divisible(w.name + " (via its scale " + s.name + ")", physical_shape(w, cfg, strategy),
                                w.fmt, axes, ps, sizes)
        check_divisible(s.name, physical_shape(s, cfg, strategy), fmt, axes, ps, sizes)
        out[s.name] = ps
    return out


def param_shardings(cfg: ModelConfig, mesh, strategy: "str | Strategy" = "dep",
                    include_host: bool = True) -> dict[str, NamedSharding]:
    """``{name: NamedSharding}`` for every parameter (validated first; see module docstring)."""
    return {k: NamedSharding(mesh, v) for k, v in param_partition_specs(cfg, mesh, strategy, include_host).items()}


# ---------------------------------------------------------------------------------- state / batch
def _state_leaf_axis(path) -> str:
    top = path[0].key if hasattr(path[0], "key") else str(path[0])
    if top in ("main_kv", "index_k"):
        return "pages"
    if top in ("swa", "comp", "engram_hist"):
        return "slots"
    raise ValueError(f"state leaf {jax.tree_util.keystr(path)}: no logical axis known for {top!r}")


def state_partition_specs(state, mesh, strategy: "str | Strategy" = "dep"):
    """PartitionSpecs for an ``init_state`` pytree (arrays or ShapeDtypeStructs): per-slot leaves shard
    their slot axis, paged leaves their entry axis, over the DP axes. Each DP rank then owns a contiguous
    range of slots and of KV entries (pages); the engine's per-rank allocators must hand out only those."""
    strategy = get_strategy(strategy)
    sizes = mesh_sizes(mesh)

    def one(path, leaf):
        name = "state" + jax.tree_util.keystr(path)
        axis = _state_leaf_axis(path)
        ps = logical_to_spec((axis,) + (None,) * (len(leaf.shape) - 1), sizes, strategy, name)
        check_divisible(name, tuple(leaf.shape), "plain", (axis,) + (None,) * (len(leaf.shape) - 1), ps, sizes)
        return ps

    return jax.tree_util.tree_map_with_path(one, state)


def state_shardings(state, mesh, strategy: "str | Strategy" = "dep"):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), state_partition_specs(state, mesh, strategy),
                        is_leaf=lambda x: isinstance(x, P))


def batch_partition_specs(batch, mesh, strategy: "str | Strategy" = "dep"):
    """Every Batch field shards its leading (row) axis over the DP axes."""
    strategy = get_strategy(strategy)
    sizes = mesh_sizes(mesh)

    def one(path, leaf):
        name = "batch" + jax.tree_util.keystr(path)
        axes = ("batch",) + (None,) * (len(leaf.shape) - 1)
        ps = logical_to_spec(axes, sizes, strategy, name)
        check_divisible(name, tuple(leaf.shape), "plain", axes, ps, sizes)
        return ps

    return jax.tree_util.tree_map_with_path(one, batch)


def batch_shardings(batch, mesh, strategy: "str | Strategy" = "dep"):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), batch_partition_specs(batch, mesh, strategy),
                        is_leaf=lambda x: isinstance(x, P))


def token_axes(mesh, strategy: "str | Strategy" = "dep") -> tuple:
    """Mesh axes that split token rows (attention DP)."""
    return resolve_axes("batch", mesh_sizes(mesh), get_strategy(strategy))


def expert_axes(mesh, strategy: "str | Strategy" = "dep") -> tuple:
    """Mesh axes that split the stacked expert dim (the EP group)."""
    return resolve_axes("expert", mesh_sizes(mesh), get_strategy(strategy))


# ---------------------------------------------------------------------------------- golden snapshots
GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "golden")
UPDATE_ENV = "DSFLASH_UPDATE_GOLDEN"


def _spec_str(ps: P) -> str:
    def e(x):
        if x is None:
            return "_"
        return x if isinstance(x, str) else "(" + ",".join(x) + ")"
    return "P(" + ",".join(e(x) for x in ps) + ")"


def _ranges(ids: list[int]) -> str:
    ids = sorted(ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def sharding_snapshot(cfg: ModelConfig, mesh, strategy: "str | Strategy", config_name: str = "") -> dict:
    """A compact, diffable record of every parameter's stored shape and PartitionSpec.

    Tensors that differ only by layer index are folded: ``layers.*.attn.wq_a.weight`` with the layer
    list as ranges ("0-7")."""
    strategy = get_strategy(strategy)
    specs = {s.name: s for s in param_specs(cfg)}
    pspecs = param_partition_specs(cfg, mesh, strategy)
    groups: dict[str, list[int]] = {}
    for name, ps in pspecs.items():
        m = re.match(r"layers\.(\d+)\.(.*)$", name)
        key_name, layer = (f"layers.*.{m.group(2)}", int(m.group(1))) if m else (name, None)
        shape = physical_shape(specs[name], cfg, strategy)
        key = f"{key_name} {list(shape)} {_spec_str(ps)}"
        groups.setdefault(key, [])
        if layer is not None:
            groups[key].append(layer)
    entries = sorted(k + (f" layers={_ranges(v)}" if v else "") for k, v in groups.items())
    return {"config": config_name or cfg.hash(), "mesh": mesh_spec(mesh), "strategy": strategy.describe(),
            "rules": [f"{k} -> {'(' + ','.join(v) + ')' if v else '_'}" for k, v in strategy.rules], "params": entries}


def golden_path(config_name: str, mesh, strategy: "str | Strategy") -> str:
    strategy = get_strategy(strategy)
    m = mesh_spec(mesh).replace("=", "").replace(",", "_")
    return os.path.normpath(os.path.join(GOLDEN_DIR, f"sharding_{config_name}_{m}_{strategy.describe()}.json"))


def check_golden(cfg: ModelConfig, config_name: str, mesh, strategy: "str | Strategy",
                 update: bool | None = None) -> tuple[bool, str]:
    """Compare the snapshot with ``tests/golden``; write it when ``update`` (default: env DSFLASH_UPDATE_GOLDEN=1)
    or when the file does not exist yet. Returns (matched, message)."""
    if update is None:
        update = os.environ.get(UPDATE_ENV, "") not in ("", "0")
    snap = sharding_snapshot(cfg, mesh, strategy, config_name)
    path = golden_path(config_name, mesh, strategy)
    text = json.dumps(snap, indent=1) + "\n"
    if update or not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return True, f"wrote {path}"
    with open(path) as f:
        old = json.load(f)
    if old == snap:
        return True, "match"
    diff = []
    a, b = set(old.get("params", [])), set(snap["params"])
    diff += [f"- {x}" for x in sorted(a - b)[:20]] + [f"+ {x}" for x in sorted(b - a)[:20]]
    for k in ("config", "mesh", "strategy", "rules"):
        if old.get(k) != snap[k]:
            diff.append(f"{k}: {old.get(k)!r} -> {snap[k]!r}")
    return False, f"{path} differs (set {UPDATE_ENV}=1 to accept):\n" + "\n".join(diff)
