"""orbax-checkpoint save/restore of converted (possibly sharded) params, for fast restarts.

Float8 tensors are stored as their ``uint8`` bit patterns (a bitcast, not a conversion) so the bytes
round-trip on every orbax/tensorstore version; ``restore_params`` takes the dtype back from the
parameter table. Entries outside the table (e.g. the derived ``engram.token_map``) are kept as stored.
"""
from __future__ import annotations

import os
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dsflash.checkpoint.names import is_stacked
from dsflash.config import ModelConfig
from dsflash.model.params import spec_map

_FLOAT8 = {jnp.dtype(getattr(jnp, n)) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                 "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(jnp, n)}


def _to_storable(x):
    if not isinstance(x, jax.Array):
        x = np.asarray(x)                                   # np.memmap views (host tables) -> plain ndarray
    if jnp.dtype(x.dtype) not in _FLOAT8:
        return x
    if isinstance(x, jax.Array):
        return jax.lax.bitcast_convert_type(x, jnp.uint8)   # elementwise: keeps the sharding
    return x.view(np.uint8)


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def save_params(path: str | os.PathLike, params: Mapping, *, overwrite: bool = False) -> str:
    """Save a flat params dict (jax arrays, sharded or not, and/or numpy arrays) to ``path``; -> path."""
    import orbax.checkpoint as ocp
    path = os.path.abspath(os.fspath(path))
    tree = {k: _to_storable(v) for k, v in params.items()}
    ck = _checkpointer()
    ck.save(path, args=ocp.args.PyTreeSave(tree), force=overwrite)
    return path


def restore_params(path: str | os.PathLike, cfg: ModelConfig,
                   shardings: Mapping[str, jax.sharding.Sharding] | None = None, *,
                   host_tables: str = "device") -> dict:
    """Restore params saved by :func:`save_params`, each into ``shardings[name]`` when given (else the
    default device). Float8 dtypes come back from the parameter table of ``cfg``.

    ``host_tables="host"`` restores Engram tables (``host=True`` specs) as numpy arrays in host memory.
    Raises ``ValueError`` naming the tensor if the checkpoint lacks a (non-host) parameter of ``cfg`` or
    holds one with another shape (stacked experts may hold any number of physical slots: wide-EP)."""
    import orbax.checkpoint as ocp
    if host_tables not in ("device", "host"):
        raise ValueError(f"host_tables must be 'device' or 'host', got {host_tables!r}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"orbax checkpoint {path!r} does not exist")
    specs = spec_map(cfg)
    shardings = dict(shardings or {})
    ck = _checkpointer()
    meta = ck.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    if not isinstance(tree, Mapping):
        raise ValueError(f"{path}: not a flat params checkpoint written by save_params")
    missing = [n for n, s in specs.items() if n not in tree and not s.host]
    if missing:
        raise ValueError(f"{path}: missing parameter {missing[0]!r}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restore_args = {}
    for name, m in tree.items():
        s = specs.get(name)
        if s is not None:
            stored = np.dtype(np.uint8) if jnp.dtype(s.dtype) in _FLOAT8 else jnp.dtype(s.dtype)
            want = tuple(s.shape)
            if is_stacked(name) and len(m.shape) == len(want):    # physical expert slots (wide-EP) may differ
                want = (m.shape[0], *want[1:])
            if tuple(m.shape) != want or jnp.dtype(m.dtype) != stored:
                raise ValueError(f"{path}: parameter {name!r} is stored as {jnp.dtype(m.dtype).name} "
                                 f"{list(m.shape)}, expected {stored.name} {list(s.shape)}")
        if s is not None and s.host and host_tables == "host" and name not in shardings:
            restore_args[name] = ocp.RestoreArgs(restore_type=np.ndarray)
        else:
            restore_args[name] = ocp.ArrayRestoreArgs(sharding=shardings.get(name, default),
                                                      global_shape=tuple(m.shape), dtype=m.dtype)
    out = ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    params = {}
    for name in list(specs) + sorted(n for n in out if n not in specs):
        if name not in out:
            continue
        x, s = out[name], specs.get(name)
        if s is not None and jnp.dtype(s.dtype) in _FLOAT8:
            x = (jax.lax.bitcast_convert_type(x, s.dtype) if isinstance(x, jax.Array)
                 else np.asarray(x).view(jnp.dtype(s.dtype)))
        params[name] = x
    return params
