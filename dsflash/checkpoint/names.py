"""Official checkpoint names <-> the parameter table.

The official layout (SPEC_V41 §13.2-13.3) stores one tensor per routed expert,
``{block}.ffn.experts.{e}.w{1,2,3}.{weight,scale}``; the parameter table stacks them per block,
``{block}.ffn.experts.w{1,2,3}.{weight,scale}`` ``[E, ...]``. Every other name is the same on both
sides. This module derives the expected official inventory (name, shape, stored dtype) from
``param_specs(cfg)`` so the loader and the synthetic writer share one description.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from dsflash.config import ModelConfig
from dsflash.model.params import ParamSpec, param_specs

_STACKED = re.compile(r"^(?P<block>.+\.ffn\.experts)\.(?P<w>w[123])\.(?P<kind>weight|scale)$")
_OFFICIAL_EXPERT = re.compile(r"^(?P<block>.+\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<kind>weight|scale)$")

# Vision tower / projector tensors of the official checkpoint (not used by the text model).
VISION_PREFIXES = ("vision.", "aligner.", "image_")


def stored_dtype(spec: ParamSpec) -> str:
    """The safetensors dtype string the official checkpoint uses for this tensor."""
    dt = jnp.dtype(spec.dtype)
    if spec.fmt == "scale":
        return "F8_E8M0"
    return {
        jnp.dtype(jnp.float8_e4m3fn): "F8_E4M3",
        jnp.dtype(jnp.int8): "I8",
        jnp.dtype(jnp.bfloat16): "BF16",
        jnp.dtype(jnp.float32): "F32",
        jnp.dtype(jnp.uint8): "U8",
        jnp.dtype(jnp.int32): "I32",
    }[dt]


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def is_stacked(name: str) -> bool:
    return _STACKED.match(name) is not None


def expert_name(stacked_name: str, e: int) -> str:
    """``X.ffn.experts.w1.weight``, 3 -> ``X.ffn.experts.3.w1.weight``."""
    m = _STACKED.match(stacked_name)
    if m is None:
        raise ValueError(f"{stacked_name!r} is not a stacked expert tensor")
    return f"{m['block']}.{e}.{m['w']}.{m['kind']}"


def split_official(name: str) -> tuple[str, int | None]:
    """Official name -> (param-table name, expert index or None)."""
    m = _OFFICIAL_EXPERT.match(name)
    if m is None:
        return name, None
    return f"{m['block']}.{m['w']}.{m['kind']}", int(m['e'])


@dataclass(frozen=True)
class OfficialTensor:
    name: str             # official checkpoint name
    param: str            # param-table name
    expert: int | None    # index along the stacked axis, or None for a plain tensor
    shape: tuple          # stored shape
    dtype: str            # stored safetensors dtype string
    spec: ParamSpec

    @property
    def nbytes(self) -> int:
        from dsflash.checkpoint.safetensors_io import ITEMSIZE
        return int(np.prod(self.shape, dtype=np.int64)) * ITEMSIZE[self.dtype]


def official_inventory(cfg: ModelConfig, specs: list[ParamSpec] | None = None) -> dict[str, OfficialTensor]:
    """Every tensor of the official text checkpoint for ``cfg``, in param-table order."""
    out: dict[str, OfficialTensor] = {}
    for s in specs if specs is not None else param_specs(cfg):
        st = stored_dtype(s)
        if is_stacked(s.name):
            for e in range(s.shape[0]):
                n = expert_name(s.name, e)
                out[n] = OfficialTensor(n, s.name, e, s.shape[1:], st, s)
        else:
            out[s.name] = OfficialTensor(s.name, s.name, None, s.shape, st, s)
    return out
