"""Write tiny random checkpoints in exactly the official Hugging Face layout (SPEC_V41 §13, §13.6).

    python -m dsflash.checkpoint.synth OUT_DIR --preset tiny --seed 0

writes ``config.json`` (``cfg.to_hf_dict()``), ``model-0000k-of-0000n.safetensors`` shards with the
official names and stored dtypes (dense FP8 as ``F8_E4M3``, UE8M0 scales as ``F8_E8M0``, MXFP4 experts
as ``I8``, one tensor per routed expert), ``model.safetensors.index.json`` (``metadata.total_size`` +
``weight_map``) and a synthetic tokenizer. The loader reads it through the same code path as the real
checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Iterator

import ml_dtypes
import numpy as np

from dsflash.checkpoint.loader import CONFIG_FILE, INDEX_FILE
from dsflash.checkpoint.names import official_inventory
from dsflash.checkpoint.safetensors_io import ITEMSIZE, write_safetensors
from dsflash.config import ModelConfig

DEFAULT_MAX_SHARD_BYTES = 1 << 20  # the tiny preset (~6.7 MB) then spans several shards


def _vision_tensors(cfg: ModelConfig, seed: int) -> list[tuple[str, np.ndarray, str]]:
    """A few stand-ins for the (text-irrelevant) vision tensors the official checkpoint carries."""
    rng = np.random.default_rng(seed + 7919)
    d = cfg.hidden_size

    def bf16(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)

    return [("vision.blocks.0.attn.wqkv.weight", bf16(96, 32), "BF16"),
            ("aligner.w1.weight", bf16(d, 32), "BF16"),
            ("image_start", bf16(d), "BF16"), ("image_end", bf16(d), "BF16"),
            ("image_newline", bf16(d), "BF16")]


def random_stored_params(cfg: ModelConfig, seed: int = 0, *, scale_range: tuple = (112, 136)) -> dict:
    """Params of ``cfg`` with random *stored bytes* (numpy only, fast): every FP8 code except NaN, every
    E2M1 nibble pair, UE8M0 scales in ``scale_range``, normal bf16/f32 values.

    Meant for format tests (loader, dequantisation); a model with these weights is not a sensible LM,
    use ``init_params`` for that."""
    from dsflash.model.params import param_specs

    rng = np.random.default_rng(seed)
    out = {}
    for s in param_specs(cfg):
        dt = np.dtype(s.dtype)
        if s.fmt == "scale":
            out[s.name] = rng.integers(scale_range[0], scale_range[1], s.shape, dtype=np.uint8)
        elif dt == np.dtype(ml_dtypes.float8_e4m3fn):
            b = rng.integers(0, 256, s.shape, dtype=np.uint8)
            b[(b & 0x7F) == 0x7F] ^= 0x01  # no NaN codes
            out[s.name] = b.view(dt)
        elif dt == np.dtype(np.int8):
            out[s.name] = rng.integers(-128, 128, s.shape, dtype=np.int8)
        else:
            out[s.name] = (rng.standard_normal(s.shape, dtype=np.float32) / np.sqrt(s.shape[-1])).astype(dt)
    return out


def fast_init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Numpy params in the stored formats (kept for callers; ``init_params`` itself is numpy-built)."""
    from dsflash.model.params import init_params
    return init_params(cfg, seed, as_numpy=True)


def official_tensors(cfg: ModelConfig, params: dict) -> Iterator[tuple[str, np.ndarray, str]]:
    """``(official name, numpy array, stored dtype)`` for every text tensor, experts split per expert.

    Arrays are produced one parameter at a time (a stacked expert tensor is fetched once and sliced)."""
    inv = official_inventory(cfg)
    current, host = None, None
    for name, t in inv.items():
        if t.param != current:
            current, host = t.param, np.asarray(params[t.param])
            want = np.dtype(t.spec.dtype)
            if host.dtype != want or tuple(host.shape) != tuple(t.spec.shape):
                raise ValueError(f"params[{t.param!r}] is {host.dtype} {list(host.shape)}, expected {want} "
                                 f"{list(t.spec.shape)}")
        arr = host if t.expert is None else host[t.expert]
        yield name, arr, t.dtype


def write_synthetic_checkpoint(folder: str | os.PathLike, cfg: ModelConfig, *, seed: int = 0,
                               params: dict | None = None,
                               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                               include_vision: bool = True, tokenizer: bool = True) -> str:
    """Write ``cfg`` with ``params`` (default ``init_params(cfg, seed)``) in the official layout; -> folder.

    Shards are filled in parameter-table order (vision stand-ins first, like the official shard 1) and a
    new shard starts when the next tensor would push the current one past ``max_shard_bytes``. Shard files
    of an earlier write into the same folder (``model-*-of-*.safetensors``) are replaced."""
    from dsflash.model.params import check_params, init_params

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    if params is None:
        params = init_params(cfg, seed)
    check_params(cfg, params, allow_missing_host=False)

    inv = official_inventory(cfg)
    sizes = [(n, t.nbytes) for n, t in inv.items()]
    vision = _vision_tensors(cfg, seed) if include_vision else []
    sizes = [(n, a.nbytes) for n, a, _ in vision] + sizes
    # plan shards from sizes alone (the file names need the shard count up front)
    shard_of: dict[str, int] = {}
    k, used = 0, 0
    for n, nb in sizes:
        if used and used + nb > max_shard_bytes:
            k, used = k + 1, 0
        shard_of[n] = k
        used += nb
    n_shards = k + 1
    fname = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]

    def stream():
        yield from vision
        yield from official_tensors(cfg, params)

    total, batch, cur = 0, [], 0

    def flush():
        nonlocal total, batch
        if batch:
            total += write_safetensors(os.path.join(folder, fname[cur]), batch, metadata={"format": "pt"})
        batch = []

    for name, arr, st in stream():
        assert arr.dtype.itemsize == ITEMSIZE[st], name
        if shard_of[name] != cur:
            flush()
            cur = shard_of[name]
        batch.append((name, arr, st))
    flush()

    stale = [f for f in os.listdir(folder) if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) and f not in fname]
    for f in stale:  # shards of an earlier write with another shard count
        os.remove(os.path.join(folder, f))
    index = {"metadata": {"total_size": total},
             "weight_map": {n: fname[shard_of[n]] for n in sorted(shard_of)}}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    cfg.save_json(os.path.join(folder, CONFIG_FILE))
    if tokenizer:
        from dsflash.tokenizer import write_synthetic_tokenizer
        write_synthetic_tokenizer(folder, cfg)
    return folder


def main(argv=None) -> None:
    from dsflash.config import PRESETS, preset

    ap = argparse.ArgumentParser(prog="python -m dsflash.checkpoint.synth",
                                 description="Write a random checkpoint in the official DeepSeek-V4.1 layout.")
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--config", help="a config.json to use instead of --preset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fast-init", action="store_true",
                    help="numpy-only weights (fast_init_params) instead of init_params: for big presets")
    ap.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    ap.add_argument("--no-vision", action="store_true", help="do not write the vision stand-in tensors")
    ap.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    a = ap.parse_args(argv)
    cfg = ModelConfig.load_json(a.config) if a.config else preset(a.preset)
    params = fast_init_params(cfg, a.seed) if a.fast_init else None
    out = write_synthetic_checkpoint(a.out_dir, cfg, seed=a.seed, params=params, max_shard_bytes=a.max_shard_bytes,
                                     include_vision=not a.no_vision, tokenizer=not a.no_tokenizer)
    with open(os.path.join(out, INDEX_FILE)) as f:
        idx = json.load(f)
    n_files = len(set(idx["weight_map"].values()))
    print(f"wrote {out}: {len(idx['weight_map'])} tensors in {n_files} shards, "
          f"{idx['metadata']['total_size']:,} bytes (config {cfg.hash()})")


if __name__ == "__main__":
    main()
