"""The parameter table: every tensor of the model described once.

``param_specs(cfg)`` lists ``ParamSpec(name, shape, dtype, axes, init)`` in the official checkpoint
naming (SPEC_V41 §13.2-13.3) with one deliberate change: routed experts are stacked per layer
(``layers.{i}.ffn.experts.w1.weight [E, out, in/2]``) instead of one tensor per expert, so the
MoE runs as one grouped GEMM; the loader splits/joins names. Abstract init, random init,
checkpoint loading, sharding and the parameter-count test all read this one table.

Params are a flat ``dict[name, array]`` holding the stored formats: FP8 E4M3 weights with UE8M0
(uint8) 32x32 block scales, MXFP4 experts as int8 nibble pairs with UE8M0 per-32 scales, bf16 and
f32 tensors as stored. Dequantisation happens where a weight is used.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dsflash.config import ModelConfig

BF16, F32, FP8, U8, I8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.uint8, jnp.int8


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple
    dtype: object
    axes: tuple          # logical axis per dim (None = replicated); read by dsflash.sharding
    init: str            # "normal" | "ones" | "zeros" | "fp8" | "mxfp4" | "scale" (of the preceding weight)
    fmt: str = "plain"   # "plain" | "fp8" | "mxfp4" | "scale"
    host: bool = False   # kept in host memory at real size (Engram tables)
    logical_numel: int = 0

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


def _spec(name, shape, dtype, axes, init, **kw):
    n = int(np.prod(shape))
    return ParamSpec(name, tuple(int(s) for s in shape), dtype, tuple(axes), init,
                     logical_numel=kw.pop("logical_numel", n), **kw)


def _fp8_linear(name, out, inp, out_axis, in_axis, lead=(), lead_axes=()):
    """FP8 E4M3 weight [.., out, in] + UE8M0 scale [.., out/32, in/32]."""
    return [
        _spec(f"{name}.weight", (*lead, out, inp), FP8, (*lead_axes, out_axis, in_axis), "fp8", fmt="fp8"),
        _spec(f"{name}.scale", (*lead, out // 32, inp // 32), U8, (*lead_axes, out_axis, in_axis), "scale",
              fmt="scale", logical_numel=0),
    ]


def _mxfp4_linear(name, out, inp, out_axis, in_axis, lead, lead_axes):
    return [
        _spec(f"{name}.weight", (*lead, out, inp // 2), I8, (*lead_axes, out_axis, in_axis), "mxfp4",
              fmt="mxfp4", logical_numel=int(np.prod(lead)) * out * inp),
        _spec(f"{name}.scale", (*lead, out, inp // 32), U8, (*lead_axes, out_axis, in_axis), "scale",
              fmt="scale", logical_numel=0),
    ]


def _norm(name, dim, axis="embed"):
    return [_spec(f"{name}.weight", (dim,), BF16, (axis,), "ones")]


def _block_specs(cfg: ModelConfig, p: str, n_experts: int) -> list[ParamSpec]:
    """Tensors every block has (backbone layer or DSpark stage)."""
    d, H, Dh, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    I, ql = cfg.moe_intermediate_size, cfg.q_lora_rank
    mix = (2 + n) * n
    s: list[ParamSpec] = []
    s += _norm(f"{p}.attn_norm", d) + _norm(f"{p}.ffn_norm", d)
    for side in ("attn", "ffn"):
        s += [
            _spec(f"{p}.hc_{side}_fn", (mix, n * d), F32, (None, "embed_hc"), "normal"),
            _spec(f"{p}.hc_{side}_base", (mix,), F32, (None,), "zeros"),
            _spec(f"{p}.hc_{side}_scale", (3,), F32, (None,), "ones"),
        ]
    s.append(_spec(f"{p}.attn.attn_sink", (H,), F32, ("heads",), "zeros"))
    s += _fp8_linear(f"{p}.attn.wq_a", ql, d, "q_lora", "embed")
    s += _norm(f"{p}.attn.q_norm", ql, "q_lora")
    s += _fp8_linear(f"{p}.attn.wq_b", H * Dh, ql, "q_heads", "q_lora")
    s += _fp8_linear(f"{p}.attn.wkv", Dh, d, "kv_latent", "embed")
    s += _norm(f"{p}.attn.kv_norm", Dh, "kv_latent")
    s += _fp8_linear(f"{p}.attn.wo_a", cfg.o_groups * cfg.o_lora_rank, H * Dh // cfg.o_groups, "o_lora", None)
    s += _fp8_linear(f"{p}.attn.wo_b", d, cfg.o_groups * cfg.o_lora_rank, "embed", "o_lora")
    s += [
        _spec(f"{p}.ffn.gate.weight", (n_experts, d), BF16, (None, "embed"), "normal"),
        _spec(f"{p}.ffn.gate.bias", (n_experts,), F32, (None,), "zeros"),
        _spec(f"{p}.ffn.gate.bias_vl", (n_experts,), F32, (None,), "zeros"),
    ]
    for w, (o, i, oa, ia) in {"w1": (I, d, "mlp", "embed"), "w3": (I, d, "mlp", "embed"),
                              "w2": (d, I, "embed", "mlp")}.items():
        s += _fp8_linear(f"{p}.ffn.shared_experts.{w}", o, i, oa, ia)
    for w, (o, i, oa, ia) in {"w1": (I, d, "moe_mlp", None), "w3": (I, d, "moe_mlp", None),
                              "w2": (d, I, None, "moe_mlp")}.items():
        s += _mxfp4_linear(f"{p}.ffn.experts.{w}", o, i, oa, ia, (n_experts,), ("expert",))
    return s


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, V = cfg.hidden_size, cfg.vocab_size
    specs: list[ParamSpec] = []
    specs.append(_spec("embed.weight", (V, d), BF16, ("vocab", "embed"), "normal"))
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}"
        if i in cfg.engram_layer_ids:
            k = cfg.engram_index(i)
            De, cols = cfg.engram_head_dim, cfg.engram_cols
            R = cfg.engram_num_embeddings[k]
            specs += [
                _spec(f"{p}.engram.embed.weight", (R, De), FP8, ("engram_rows", None), "fp8rows", fmt="fp8rows",
                      host=True),
                _spec(f"{p}.engram.embed.scale", (R, De // 32), U8, ("engram_rows", None), "scale", fmt="scale",
                      host=True, logical_numel=0),
            ]
            specs += _fp8_linear(f"{p}.engram.wkv", (cfg.hc_mult + 1) * d, cols * De, "engram_kv", None)
            specs += [
                _spec(f"{p}.engram.q_weight", (cfg.hc_mult, d), BF16, (None, "embed"), "ones"),
                _spec(f"{p}.engram.k_weight", (cfg.hc_mult, d), BF16, (None, "embed"), "ones"),
            ]
        specs += _block_specs(cfg, p, cfg.n_routed_experts)
        r = cfg.ratio(i)
        if i in cfg.kv_source_layer_ids:
            specs.append(_spec(f"{p}.attn.compressor.wkv.weight", (cfg.head_dim, d), BF16, ("kv_latent", "embed"),
                               "normal"))
            if r == 2:
                specs.append(_spec(f"{p}.attn.compressor.wgate.weight", (cfg.head_dim, d), BF16,
                                   ("kv_latent", "embed"), "normal"))
            specs += _norm(f"{p}.attn.compressor.norm", cfg.head_dim, "kv_latent")
            specs.append(_spec(f"{p}.attn.indexer.wk.weight", (cfg.index_head_dim, cfg.head_dim), BF16,
                               (None, "kv_latent"), "normal"))
            specs += _norm(f"{p}.attn.indexer.k_norm", cfg.index_head_dim, None)
        if i in cfg.index_source_layer_ids:
            specs += _fp8_linear(f"{p}.attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank,
                                 "index_heads", "q_lora")
            specs.append(_spec(f"{p}.attn.indexer.weights_proj.weight", (cfg.index_n_heads, d), BF16,
                               ("index_heads", "embed"), "normal"))
    specs += _norm("norm", d)
    specs.append(_spec("head.weight", (V, d), BF16, ("vocab", "embed"), "normal"))
    for s in range(cfg.n_stages):
        p = f"mtp.{s}"
        if s == 0:
            T = len(cfg.dspark_target_layer_ids)
            specs += _fp8_linear(f"{p}.main_proj", d, T * d, "embed", None)
            specs += _norm(f"{p}.main_norm", d)
        specs += _block_specs(cfg, p, cfg.dspark_n_routed_experts)
        if s == cfg.n_stages - 1:
            r = cfg.dspark_markov_rank
            specs += _norm(f"{p}.norm", d)
            specs += [
                _spec(f"{p}.markov_head.embed.weight", (V, r), BF16, ("vocab", None), "normal"),
                _spec(f"{p}.markov_head.head.weight", (V, r), BF16, ("vocab", None), "normal"),
                _spec(f"{p}.confidence_head.proj.weight", (1, d + r), BF16, (None, None), "normal"),
            ]
    return specs


def spec_map(cfg: ModelConfig) -> dict[str, ParamSpec]:
    return {s.name: s for s in param_specs(cfg)}


def is_draft(name: str) -> bool:
    return name.startswith("mtp.")


def is_engram_table(name: str) -> bool:
    return ".engram.embed." in name


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Logical parameter counts (FP4 elements counted once each, scales not counted), SPEC §0 split."""
    out = {"backbone": 0, "engram": 0, "dspark": 0}
    for s in param_specs(cfg):
        if is_engram_table(s.name):
            out["engram"] += s.logical_numel
        elif is_draft(s.name):
            out["dspark"] += s.logical_numel
        else:
            out["backbone"] += s.logical_numel
    out["total"] = sum(out.values())
    return out


def abstract_params(cfg: ModelConfig, include_host: bool = True) -> dict:
    return {s.name: jax.ShapeDtypeStruct(s.shape, s.dtype) for s in param_specs(cfg)
            if include_host or not s.host}


def init_params(cfg: ModelConfig, seed: int = 0, include_host: bool = True,
                names: Iterable[str] | None = None, as_numpy: bool = False) -> dict:
    """Deterministic random weights built directly in the stored formats with numpy (no compile, seconds even
    at real widths); a model with these weights gives finite, varied logits.

    * "normal": uniform with the fan-in variance (hc_* x 0.1);
    * FP8 linears: E4M3 codes with magnitudes in [1/8, 2) and a UE8M0 block scale ~ 1/sqrt(fan_in);
    * MXFP4 experts: random nibbles with a per-32 scale ~ 1/(3 sqrt(fan_in)); Engram rows: unit-scale FP8.
    Each tensor draws from its own generator seeded by (seed, name), so a subset init gives the same values.
    At real size (~300 GB) use :func:`init_params_placed`, which never holds more than one tensor on the host."""
    wanted = set(names) if names is not None else None
    out: dict = {}
    for s in param_specs(cfg):
        if s.fmt == "scale" or (not include_host and s.host) or (wanted is not None and s.name not in wanted):
            continue
        out.update(_draw(s, seed))
    return out if as_numpy else {k: jnp.asarray(v) for k, v in out.items()}


def place_value(value, target):
    """``jax.device_put(value, target)``, except for a host value bound for a sharding that spans several
    processes (a ``jax.distributed`` job, where every process holds the same value): each process then builds
    its own shards from it (``device_put`` would first all-gather the value to check that the processes agree,
    one collective and one compile per shape)."""
    if jax.process_count() > 1 and isinstance(target, jax.sharding.Sharding) and not target.is_fully_addressable:
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, target, lambda i: host[i])
    return jax.device_put(value, target)


def init_params_placed(cfg: ModelConfig, seed: int = 0, shardings: dict | None = None, device=None,
                       host_tables: bool = False, progress: bool = False, on_device: bool = False) -> tuple[dict, dict]:
    """:func:`init_params`'s values, each tensor placed (``shardings[name]``, else ``device``, else the default
    device) before the next one is drawn: the host holds one tensor at a time (the real model's largest, one
    layer's routed experts, is ~6.5 GB) instead of the whole ~300 GB.

    ``host_tables``: the Engram tables (``host=True`` specs) stay numpy in host memory and come back separately,
    ready for :func:`dsflash.model.engram.register_host_tables`. -> ``(params, {layer: (weight, scale)})``.
    ``on_device`` (benchmarks at real size, where drawing ~300 GB with numpy takes minutes): each device tensor is
    generated in place by ``jax.random`` instead -- same kinds, formats, scales and placement, other values -- and
    host tables repeat one random block of 64K rows (the gathers still touch distinct addresses)."""
    from dsflash.progress import progress_bar as _progress_bar
    specs = [s for s in param_specs(cfg) if s.fmt != "scale"]
    bar = _progress_bar(total=len(specs), desc="init params", disable=not progress, dynamic_ncols=True)
    key = jax.random.PRNGKey(seed)

    def place(k):
        target = shardings.get(k) if shardings else None
        return target if target is not None else (device or jax.devices()[0])

    params, tables = {}, {}
    for i, s in enumerate(specs):
        if s.host and host_tables:
            drawn = _tiled_host_table(s, seed) if on_device else _draw(s, seed)
            tables[int(s.name.split(".")[1])] = (drawn[s.name], drawn[s.name[: -len(".weight")] + ".scale"])
        elif on_device:
            params[s.name] = _device_tensor(s.init, s.shape, np.dtype(s.dtype).name, _std(s),
                                            place(s.name))(jax.random.fold_in(key, i))
            params.update({k: place_value(v, place(k)) for k, v in _scale(s).items()})
        else:
            drawn = _draw(s, seed)
            params.update({k: place_value(v, place(k)) for k, v in drawn.items()})
            jax.block_until_ready([params[k] for k in drawn])      # before the host copy is dropped
        bar.update(1)
    bar.close()
    jax.block_until_ready(params)
    return params, tables


def _std(s: ParamSpec) -> float:
    return (0.1 if "hc_" in s.name else 1.0) / float(np.sqrt(s.shape[-1])) if s.shape else 1.0


@functools.lru_cache(maxsize=None)
def _device_tensor(init: str, shape: tuple, dtype: str, std: float, target):
    """A jitted generator of one tensor kind, placed by ``target`` (a sharding or device); cached per signature."""
    sharding = target if isinstance(target, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(target)

    def gen(k):
        if init in ("fp8", "fp8rows"):                   # E4M3 codes, magnitudes in [1/8, 2) as _fp8_codes
            b = jax.random.bits(k, shape, jnp.uint8)
            return ((b & 0x87) | ((4 + ((b >> 3) & 3)) << 3)).astype(jnp.uint8).view(jnp.float8_e4m3fn)
        if init == "mxfp4":
            return jax.random.bits(k, shape, jnp.uint8).view(jnp.int8)
        if init == "normal":
            return (jax.random.uniform(k, shape, jnp.float32, -1.0, 1.0) * (std * 3 ** 0.5)).astype(dtype)
        if init == "ones":
            return jnp.ones(shape, dtype)
        if init == "zeros":
            return jnp.zeros(shape, dtype)
        raise ValueError(f"unknown init {init!r}")
    return jax.jit(gen, out_shardings=sharding)


def _tiled_host_table(s: ParamSpec, seed: int, period: int = 1 << 16) -> dict:
    """:func:`_draw`'s dict for a big table, its rows repeating one random block of ``period`` rows."""
    rows = s.shape[0]
    block = _draw(ParamSpec(s.name, (min(rows, period), *s.shape[1:]), s.dtype, s.axes, s.init, s.fmt), seed)[s.name]
    w = np.empty(s.shape, block.dtype)
    for r0 in range(0, rows, period):
        n = min(period, rows - r0)
        w[r0:r0 + n] = block[:n]
    return {s.name: w, **_scale(s)}


def _draw(s: ParamSpec, seed: int) -> dict:
    """One tensor (and its ``.scale``) of :func:`init_params`, numpy."""
    rng = np.random.default_rng([seed, _name_hash(s.name)])
    if s.init in ("fp8", "fp8rows"):
        w = _fp8_codes(rng, s.shape)
    elif s.init == "mxfp4":
        w = _rand_u8(rng, s.shape).view(np.int8)
    elif s.init == "normal":
        u = _rand_u8(rng, s.shape).view(np.int8).astype(np.float32)
        w = (u * np.float32(_std(s) * np.sqrt(3.0) / 128.0)).astype(np.dtype(s.dtype))
    elif s.init == "ones":
        w = np.ones(s.shape, np.dtype(s.dtype))
    elif s.init == "zeros":
        w = np.zeros(s.shape, np.dtype(s.dtype))
    else:
        raise ValueError(f"unknown init {s.init!r} for {s.name}")
    return {s.name: w, **_scale(s)}


def _scale(s: ParamSpec) -> dict:
    """The constant UE8M0 scale tensor of a quantised weight (``{}`` for plain tensors)."""
    name = s.name[: -len(".weight")] + ".scale"
    if s.init == "fp8":
        return {name: np.full((*s.shape[:-2], s.shape[-2] // 32, s.shape[-1] // 32), _e8m0(1 / np.sqrt(s.shape[-1])),
                              np.uint8)}
    if s.init == "fp8rows":
        return {name: np.full((*s.shape[:-1], s.shape[-1] // 32), 127, np.uint8)}
    if s.init == "mxfp4":
        fan_in = 2 * s.shape[-1]
        return {name: np.full((*s.shape[:-1], fan_in // 32), _e8m0(1 / (3 * np.sqrt(fan_in))), np.uint8)}
    return {}


def _e8m0(x: float) -> int:
    return int(np.clip(127 + np.round(np.log2(x)), 1, 254))


def _rand_u8(rng, shape):
    return np.frombuffer(rng.bytes(int(np.prod(shape))), np.uint8).reshape(shape)


def _fp8_codes(rng, shape):
    """Random E4M3 codes: random sign and mantissa, exponent field 4..7 (magnitudes in [1/8, 2))."""
    import ml_dtypes
    b = _rand_u8(rng, shape)
    return ((b & 0x87) | ((4 + ((b >> 3) & 3)) << 3)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)


def _name_hash(name: str) -> int:
    import zlib
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def float_params(cfg: ModelConfig, params: dict, dtype=jnp.float32) -> dict:
    """Stored formats -> float "master" weights (no ``.scale`` entries), e.g. to train or fine-tune.

    The model accepts these wherever it reads a stored weight (a missing scale means "use as is");
    ``dsflash.checkpoint`` quantises them back to the official formats on export."""
    from dsflash import quant
    specs = spec_map(cfg)
    out = {}
    for name, w in params.items():
        s = specs.get(name)
        if s is None or s.fmt == "scale":
            if s is None:
                out[name] = w
            continue
        scale = params.get(name[: -len(".weight")] + ".scale")
        if s.fmt == "fp8":
            out[name] = quant.dequant_fp8_weight(w, scale, dtype)
        elif s.fmt == "mxfp4":
            out[name] = quant.dequant_mxfp4_weight(w, scale, dtype)
        elif s.fmt == "fp8rows":
            out[name] = quant.fp8_dequant(w, quant.e8m0_to_f32(scale), 32, dtype)
        else:
            out[name] = w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w
    return out


_float_params_jit = jax.jit(float_params, static_argnums=(0,))     # one compile per config, reused by every engine


def dequantized_weights(cfg: ModelConfig, params: dict, max_bytes: int = 2 << 30) -> dict | None:
    """The FP8 (dense) and MXFP4 (routed-expert) weights dequantised once (by :func:`float_params`), scales
    dropped; None if that would take more than ``max_bytes`` for those weights.

    For a backend that would otherwise dequantise every weight in every call (XLA on CPU; demo engine: plain
    366 -> 419 tok/s at 8 sequences). Each weight is the float the forward's own dequantisation makes (the f32
    product of the stored values and their power-of-two scales), stored in bf16 where every value is exactly
    representable there (always, short of scales near the f32 range limits) and f32 otherwise. The forward reads a
    missing scale as "use the weight as is" (as for training's float weights), so the outputs are bit-identical
    (tested). Engram tables (FP8 rows, gathered per token) keep their stored format."""
    specs = spec_map(cfg)
    todo = [n for n in params if n in specs and specs[n].fmt in ("fp8", "mxfp4")]
    need = sum(int(np.prod(specs[n].shape)) * 2 for n in todo)
    if need > max_bytes:
        return None
    scale_of = {n: n[: -len(".weight")] + ".scale" for n in todo}
    sub = {m: params[m] for n in todo for m in (n, scale_of[n]) if m in params}
    floats = _float_params_jit(cfg, sub)
    out = dict(params)
    for name in todo:
        f = floats[name]
        b = f.astype(jnp.bfloat16)
        out[name] = b if bool(jnp.array_equal(b.astype(jnp.float32), f)) else f
        out.pop(scale_of[name], None)
    return out


def moe_il_weights(cfg: ModelConfig, params: dict, check: bool = True) -> dict:
    """The routed experts' MXFP4 weights and scales in the load-time "il" layout (``dsflash.kernels.moe_layout``;
    opt-in, 2026-12-03, not yet run on a GPU): one repack when the checkpoint is placed, after which the Triton decode
    runs mma "swap_il" on them at every size (``moe_plan.IL_BANDS``) and the XLA reference converts them back per
    call (bit-identical outputs). Everything else is kept as stored.
    ``check``: refuse scales above ``moe_layout.MAX_SCALE`` (ValueError; needs concrete arrays). The result no longer
    matches the parameter table's shapes / dtypes for those arrays (``check_params`` rejects it): use it only as the
    arrays handed to the forward."""
    from dsflash.kernels import moe_layout
    specs = spec_map(cfg)
    out = dict(params)
    for name in params:
        s = specs.get(name)
        if s is None or s.fmt != "mxfp4" or ".experts." not in name or not name.endswith(".weight"):
            continue
        sname = name[: -len(".weight")] + ".scale"
        if sname not in params or moe_layout.is_il(params[name]):
            continue
        if check:
            moe_layout.check_scales(params[sname])
        out[name], out[sname] = moe_layout.repack(params[name], params[sname])
    return out


# Constants derived from the tokenizer, not stored in checkpoints (replicated, optional).
DERIVED = {"engram.token_map"}


def check_params(cfg: ModelConfig, params: dict, allow_missing_host: bool = True) -> None:
    """Raise ValueError naming the first missing, extra or mis-shaped tensor (DERIVED names are allowed)."""
    specs = spec_map(cfg)
    for name, s in specs.items():
        if name not in params:
            if s.host and allow_missing_host:
                continue
            raise ValueError(f"missing parameter {name!r} (expected {s.shape} {jnp.dtype(s.dtype).name})")
        a = params[name]
        if tuple(a.shape) != s.shape or jnp.dtype(a.dtype) != jnp.dtype(s.dtype):
            raise ValueError(f"parameter {name!r} has {tuple(a.shape)} {jnp.dtype(a.dtype).name}, "
                             f"expected {s.shape} {jnp.dtype(s.dtype).name}")
    extra = sorted(set(params) - set(specs) - DERIVED)
    if extra:
        raise ValueError(f"unexpected parameter {extra[0]!r}" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
