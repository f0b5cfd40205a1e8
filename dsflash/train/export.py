"""Float master weights -> the stored formats -> the official Hugging Face layout.

FP8 E4M3 with UE8M0 32x32 block scales for dense linears, MXFP4 (E2M1 nibble pairs + UE8M0 per 32) for
routed experts, FP8 rows with a UE8M0 scale per 32 for Engram tables, bf16 / f32 as the table stores.
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from dsflash.config import ModelConfig
from dsflash import quant
from dsflash.model.params import DERIVED, param_specs
from dsflash.train.data import copy_tokenizer


def _quantize(fmt: str, w):
    """One float weight -> (stored values, UE8M0 scales) in ``fmt``'s format (jnp; traceable)."""
    if fmt == "fp8":
        return quant.quantize_fp8_weight(w)
    if fmt == "mxfp4":
        return quant.quantize_mxfp4_weight(w)
    q, sf = quant.fp8_quant(w, 32)                 # fp8rows
    return q, quant.f32_pow2_to_e8m0(sf)


_QUANTISED = ("fp8", "mxfp4", "fp8rows")


def quantize_params(cfg: ModelConfig, fparams: dict, skip=()) -> dict:
    """Float params (as ``float_params`` gives) -> stored-format params (numpy), derived constants and the names
    in ``skip`` dropped."""
    out = {}
    for s in param_specs(cfg):
        if s.fmt == "scale" or s.name in skip:
            continue
        w = jnp.asarray(fparams[s.name])
        if s.fmt in _QUANTISED:
            q, sc = _quantize(s.fmt, w)
            out[s.name] = np.asarray(q)
            out[s.name[: -len(".weight")] + ".scale"] = np.asarray(sc)
        else:
            out[s.name] = np.asarray(w.astype(s.dtype))
    return out


def stored_roundtrip(cfg: ModelConfig, fparams: dict) -> dict:
    """The float weights an export of ``fparams`` loads back as (``float_params(quantize_params(...))``), traced
    with jnp so a training step can use it (quantisation-aware fine-tuning, ``loop.sft_loss``); names without a
    stored format (not in the parameter table, derived, not float) pass through."""
    specs = {s.name: s for s in param_specs(cfg)}
    out = {}
    for name, w in fparams.items():
        s = specs.get(name)
        if s is None or name in DERIVED or not jnp.issubdtype(w.dtype, jnp.floating):
            out[name] = w
        elif s.fmt == "fp8":
            out[name] = quant.dequant_fp8_weight(*_quantize("fp8", w), w.dtype)
        elif s.fmt == "mxfp4":
            out[name] = quant.dequant_mxfp4_weight(*_quantize("mxfp4", w), w.dtype)
        elif s.fmt == "fp8rows":
            q, sc = _quantize("fp8rows", w)
            out[name] = quant.fp8_dequant(q, quant.e8m0_to_f32(sc), 32, w.dtype)
        else:
            out[name] = w.astype(s.dtype).astype(w.dtype)
    return out


def export_checkpoint(folder: str, cfg: ModelConfig, fparams: dict, tokenizer_folder: str,
                      extra_meta: dict | None = None, keep: dict | None = None) -> dict:
    """Quantise, write the official layout, copy the trained tokenizer; -> the stored params.

    ``keep``: stored tensors written as they are (with their ``.scale`` partners), e.g. a served target whose
    bytes must not change; the rest of ``fparams`` is quantised."""
    from dsflash.checkpoint.synth import write_synthetic_checkpoint

    keep = {k: v for k, v in (keep or {}).items() if k not in DERIVED}
    stored = quantize_params(cfg, {k: v for k, v in fparams.items() if k not in DERIVED}, skip=keep)
    stored.update({k: np.asarray(v) for k, v in keep.items()})
    write_synthetic_checkpoint(folder, cfg, params=stored, tokenizer=False, include_vision=False,
                               max_shard_bytes=8 << 20)
    copy_tokenizer(tokenizer_folder, folder)
    if extra_meta is not None:
        with open(os.path.join(folder, "training.json"), "w") as f:
            json.dump(extra_meta, f, indent=2)
    return stored
