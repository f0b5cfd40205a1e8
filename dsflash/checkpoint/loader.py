"""Load the official Hugging Face checkpoint layout (SPEC_V41 §13) into the parameter table.

``load_checkpoint(folder)`` reads ``config.json``, the index ``model.safetensors.index.json`` (or a
single ``model.safetensors``), validates *everything* it can from the headers before reading any
tensor data (so a bad 500 GB checkpoint fails in seconds, not after an hour), then streams the
shards in order, memory-mapped, putting each tensor on device (into its sharding when one is given)
as it is read. Routed experts stored one tensor per expert are joined into the stacked
``[E, ...]`` tensors of the parameter table.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Mapping, Sequence

import jax
import numpy as np

from dsflash.checkpoint.names import OfficialTensor, is_stacked, is_vision, official_inventory
from dsflash.checkpoint.safetensors_io import SafetensorsError, SafetensorsFile
from dsflash.config import ModelConfig
from dsflash.model.params import ParamSpec, param_specs
from dsflash.progress import progress_bar as _progress_bar

log = logging.getLogger("dsflash.checkpoint")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HOST_TABLE_MODES = ("device", "host", "skip")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the tensor (official name) or file."""


def _first(names, what: str) -> str:
    names = sorted(names, key=_natural_key)
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{what} {names[0]!r}{more}"


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in name.replace(".", " . ").split()]


def read_weight_map(folder: str) -> dict[str, str]:
    """Official name -> shard file (relative to ``folder``), from the index or a single file."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: cannot read the index ({e})") from e
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index_path}: no 'weight_map' object of name -> file")
        return dict(wm)
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.exists(single):
        return {n: SINGLE_FILE for n in SafetensorsFile(single).keys()}
    raise CheckpointError(f"{folder}: neither {INDEX_FILE} nor {SINGLE_FILE} found (not a checkpoint folder?)")


def _check_index(folder: str, weight_map: dict[str, str], inventory: dict[str, OfficialTensor],
                 wanted: set[str]) -> dict[str, SafetensorsFile]:
    """Validate names, files and headers; return the opened shard headers by file name."""
    vision = [n for n in weight_map if is_vision(n)]
    if vision:
        log.info("ignoring %d vision tensors (vision.*, aligner.*, image_*): dsflash is a text-only model",
                 len(vision))
    extra = [n for n in weight_map if n not in inventory and not is_vision(n)]
    if extra:
        raise CheckpointError(f"{folder}: {_first(extra, 'unexpected tensor')}: not part of the model for "
                              "this config (wrong config.json or a different model?)")
    missing = [n for n in inventory if n not in weight_map]
    if missing:
        t = inventory[min(missing, key=_natural_key)]
        raise CheckpointError(f"{folder}: {_first(missing, 'missing tensor')} (expected {t.dtype} "
                              f"{list(t.shape)})")
    files: dict[str, SafetensorsFile] = {}
    for name in sorted(wanted, key=lambda n: (weight_map[n], _natural_key(n))):
        fname = weight_map[name]
        if fname not in files:
            path = os.path.join(folder, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{folder}: shard file {fname!r} is missing (the index maps tensor "
                                      f"{name!r} to it)")
            try:
                files[fname] = SafetensorsFile(path)
            except SafetensorsError as e:
                raise CheckpointError(f"corrupt shard: {e}") from e
        st = files[fname]
        if name not in st:
            raise CheckpointError(f"{folder}: the index maps tensor {name!r} to {fname!r}, but that file has no "
                                  "such tensor")
        info, t = st.tensors[name], inventory[name]
        if info.dtype != t.dtype:
            raise CheckpointError(f"tensor {name!r} in {fname!r} is stored as {info.dtype}, expected {t.dtype}")
        if tuple(info.shape) != tuple(t.shape):
            raise CheckpointError(f"tensor {name!r} in {fname!r} has shape {list(info.shape)}, expected "
                                  f"{list(t.shape)}")
    return files


def read_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{folder}: no {CONFIG_FILE} (pass cfg= to load without one)")
    try:
        return ModelConfig.load_json(path)
    except (OSError, ValueError, TypeError) as e:   # JSONDecodeError and ModelConfig validation are ValueErrors
        raise CheckpointError(f"{path}: {e}") from e


def check_checkpoint(folder: str | os.PathLike, cfg: ModelConfig | None = None) -> dict:
    """Validate a checkpoint folder from its headers alone (no tensor data is read): the checks
    ``load_checkpoint`` runs before streaming. Returns a summary; raises ``CheckpointError`` like the loader."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder!r} does not exist")
    if cfg is None:
        cfg = read_config(folder)
    inventory = official_inventory(cfg)
    weight_map = read_weight_map(folder)
    files = _check_index(folder, weight_map, inventory, set(inventory))
    by_dtype: dict[str, int] = {}
    for t in inventory.values():
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
    return {"config": cfg.hash(), "tensors": len(inventory), "params": len({t.param for t in inventory.values()}),
            "shards": len(files), "bytes": sum(by_dtype.values()), "bytes_by_dtype": by_dtype,
            "ignored_vision": sum(1 for n in weight_map if is_vision(n))}


def load_checkpoint(folder: str | os.PathLike, cfg: ModelConfig | None = None, *,
                    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
                    host_tables: str = "device", progress: bool = True,
                    expert_slots: Mapping[str, Sequence[int]] | None = None) -> tuple[ModelConfig, dict]:
    """Load an official-layout checkpoint -> ``(cfg, params)`` in the stored formats of the param table.

    folder:      directory with ``config.json`` and ``model.safetensors.index.json`` + shards (or one
                 ``model.safetensors``).
    cfg:         the model config; default: ``ModelConfig.load_json(folder)``.
    shardings:   optional ``{param name: jax.sharding.Sharding}``; each tensor is assembled directly
                 into its sharding (every device reads only its slice of the memory-mapped shard).
                 Params without an entry go to the default device.
    host_tables: Engram tables (``host=True`` specs): ``"device"`` (like any other tensor), ``"host"``
                 (read-only ``np.memmap`` views of the shard, nothing read up front) or ``"skip"``.
    progress:    tqdm progress bar over the bytes read.
    expert_slots: optional physical expert layout (wide-EP with redundant experts, EPLB):
                 ``{"layers.{l}.ffn.experts" | "mtp.{s}.ffn.experts": logical expert of each physical slot}``
                 (a row of ``phy2log``; see :func:`expert_slots_from_phy2log`). The stacked tensors of
                 that block are then ``[len(slots), ...]`` and each device reads only the experts of its
                 slots. Blocks not named keep the logical layout ``[E, ...]``.

    Raises ``ValueError`` (``CheckpointError``) naming the tensor (official name) or file for a missing,
    extra, mis-shaped or wrongly typed tensor, a missing shard file, a truncated/corrupt shard, or an
    index entry whose file lacks the tensor. Vision tensors are ignored (info log).
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder!r} does not exist")
    if host_tables not in HOST_TABLE_MODES:
        raise ValueError(f"host_tables must be one of {HOST_TABLE_MODES}, got {host_tables!r}")
    cfg_path = os.path.join(folder, CONFIG_FILE)
    if cfg is None:
        cfg = read_config(folder)
    elif os.path.exists(cfg_path):
        try:
            on_disk = ModelConfig.load_json(cfg_path)
            if on_disk != cfg:
                log.warning("%s differs from the cfg passed to load_checkpoint; using the passed cfg", cfg_path)
        except (ValueError, TypeError) as e:
            log.warning("%s could not be parsed (%s); using the passed cfg", cfg_path, e)

    specs = {s.name: s for s in param_specs(cfg)}
    shardings = dict(shardings or {})
    unknown = [n for n in shardings if n not in specs]
    if unknown:
        raise ValueError(f"shardings names {_first(unknown, 'unknown parameter')}")
    inventory = official_inventory(cfg, list(specs.values()))
    slots = _check_expert_slots(expert_slots, specs)
    weight_map = read_weight_map(folder)
    skip = {n for n, s in specs.items() if s.host and host_tables == "skip"}
    wanted = {n for n, t in inventory.items() if t.param not in skip}
    files = _check_index(folder, weight_map, inventory, wanted)

    # group official tensors by parameter; order parameters by the last shard they need so that
    # shards are consumed in order and each can be released once nothing pending needs it
    file_order = {f: i for i, f in enumerate(sorted(files, key=_natural_key))}
    parts: dict[str, list[OfficialTensor]] = {}
    for n, t in inventory.items():
        if n in wanted:
            parts.setdefault(t.param, []).append(t)
    order = sorted(parts, key=lambda p: (max(file_order[weight_map[t.name]] for t in parts[p]),
                                         min(files[weight_map[t.name]].tensors[t.name].begin for t in parts[p])))
    last_use: dict[str, int] = {}
    for i, p in enumerate(order):
        for t in parts[p]:
            last_use[weight_map[t.name]] = i
    total = sum(t.nbytes for n, t in inventory.items() if n in wanted)

    bar = _progress_bar(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading checkpoint",
               disable=not progress, dynamic_ncols=True)
    params: dict = {}
    try:
        for i, pname in enumerate(order):
            spec, tensors = specs[pname], parts[pname]
            bar.set_postfix_str(weight_map[tensors[-1].name], refresh=False)
            params[pname] = _materialise(spec, tensors, files, weight_map, shardings.get(pname), host_tables,
                                         slots.get(pname.rsplit(".", 2)[0]))
            bar.update(sum(t.nbytes for t in tensors))
            for f, last in last_use.items():
                if last == i:
                    files[f].close()
    finally:
        bar.close()
    if skip:
        log.info("host_tables='skip': not loading %s", ", ".join(sorted(skip)))
    return cfg, {s: params[s] for s in specs if s in params}


def expert_slots_from_phy2log(phy2log=None, draft_phy2log=None) -> dict[str, list[int]]:
    """``expert_slots`` for :func:`load_checkpoint` from EPLB tables ``phy2log [layers, P]`` (backbone)
    and ``draft_phy2log [stages, P']`` (DSpark draft)."""
    out: dict[str, list[int]] = {}
    for prefix, table in (("layers", phy2log), ("mtp", draft_phy2log)):
        if table is not None:
            for i, row in enumerate(np.asarray(table)):
                out[f"{prefix}.{i}.ffn.experts"] = [int(v) for v in row]
    return out


def _check_expert_slots(expert_slots, specs: dict[str, ParamSpec]) -> dict[str, tuple]:
    out = {}
    for block, row in (expert_slots or {}).items():
        w = specs.get(f"{block}.w1.weight")
        if w is None or not is_stacked(w.name):
            raise ValueError(f"expert_slots: {block!r} is not a routed-expert block of this model "
                             "(expected e.g. 'layers.3.ffn.experts')")
        row = tuple(int(v) for v in row)
        E = w.shape[0]
        if not row or min(row) < 0 or max(row) >= E:
            raise ValueError(f"expert_slots[{block!r}]: logical expert ids must be in [0, {E}), got {list(row)}")
        out[block] = row
    return out


def _materialise(spec: ParamSpec, tensors: list[OfficialTensor], files: dict[str, SafetensorsFile],
                 weight_map: dict[str, str], sharding, host_tables: str, slots: tuple | None = None):
    dt = np.dtype(spec.dtype)

    def view(t: OfficialTensor) -> np.ndarray:
        a = files[weight_map[t.name]].get(t.name)
        return a if a.dtype == dt else a.view(dt)  # F8_E8M0 bytes are held as uint8 already

    stacked = tensors[0].expert is not None
    shape = spec.shape
    if stacked:
        by_e = {t.expert: t for t in tensors}
        assert sorted(by_e) == list(range(spec.shape[0])), spec.name
        slots = slots if slots is not None else tuple(range(spec.shape[0]))   # physical row -> logical expert
        shape = (len(slots), *spec.shape[1:])
    if spec.host and host_tables == "host":
        if not stacked:
            return view(tensors[0])
        return np.stack([view(by_e[e]) for e in slots])

    # On an accelerator the host->device transfer copies anyway, so memmap views go straight in. On the
    # CPU backend a numpy buffer may be aliased (zero-copy) by the jax.Array, so we hand over a private
    # copy instead of a view of the shard file.
    devices = sharding.device_set if sharding is not None else {jax.devices()[0]}
    copy = any(d.platform == "cpu" for d in devices)
    own = np.array if copy else np.asarray

    if sharding is not None:
        def cb(index):
            if not stacked:
                return own(view(tensors[0])[index])
            rows = range(*index[0].indices(shape[0])) if isinstance(index[0], slice) else [index[0]]
            return np.stack([view(by_e[slots[r]])[index[1:]] for r in rows])
        return jax.make_array_from_callback(shape, sharding, cb)

    if not stacked:
        return jax.device_put(own(view(tensors[0])))
    host = np.empty(shape, dt)           # one [E, ...] buffer for this tensor only, freed after the transfer
    for r, e in enumerate(slots):
        host[r] = view(by_e[e])
    return jax.device_put(host)
