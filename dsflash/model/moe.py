"""MoE: sqrt-softplus gate with aux-free bias, top-k (ties to the lowest id), routed + shared SwiGLU. SPEC §8."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsflash.config import ModelConfig
from dsflash.kernels import moe_gemm
from dsflash.model.layers import act_dtype, linear_f32, linear_fp8


def route(x, gate_w, bias, topk: int, cfg: ModelConfig):
    """x [T, d] -> (idx [T, k] int32, weight [T, k] f32). Selection uses s + bias, weights the unbiased s."""
    u = linear_f32(x, gate_w) / cfg.gate_temp
    s = jnp.sqrt(jax.nn.softplus(u))
    _, idx = jax.lax.top_k(s + bias.astype(jnp.float32), topk)  # lax.top_k: equal values -> lower index first
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and topk > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


def shared_expert(x, params, prefix, cfg: ModelConfig, precision, backend="xla"):
    L = cfg.swiglu_limit
    g = linear_fp8(x, params, f"{prefix}.w1", precision, backend=backend).astype(jnp.float32)
    u = linear_fp8(x, params, f"{prefix}.w3", precision, backend=backend).astype(jnp.float32)
    h = (jax.nn.silu(jnp.minimum(g, L)) * jnp.clip(u, -L, L)).astype(act_dtype(precision))
    return linear_fp8(h, params, f"{prefix}.w2", precision, backend=backend)


def expert_load(idx, valid, n_experts):
    """Tokens routed to each of ``n_experts`` experts ``[n] f32`` from top-k ids ``idx [T, k]``, counting only
    rows where ``valid [T]`` (None = all) is set."""
    w = jnp.ones(idx.shape, jnp.float32) if valid is None else \
        jnp.broadcast_to(valid[:, None], idx.shape).astype(jnp.float32)
    return jnp.zeros((n_experts,), jnp.float32).at[idx].add(w)


def moe(x, params, prefix, cfg: ModelConfig, precision, backend="auto", draft=False, routed_fn=None, valid=None):
    """x [..., d] -> (y [..., d], load [E] f32 tokens routed to each expert among ``valid`` rows; with an
    EPLB hook (``routed_fn.returns_load``) the hook's per-physical-expert load [P] instead).

    ``routed_fn`` replaces the routed-expert call (expert-parallel sharding hook); it receives the block
    name as ``layer=`` so per-layer EPLB tables can be used."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    topk = cfg.dspark_num_experts_per_tok if draft else cfg.num_experts_per_tok
    idx, w = route(xt, params[f"{prefix}.gate.weight"], params[f"{prefix}.gate.bias"], topk, cfg)
    e = f"{prefix}.experts"
    fn = routed_fn or moe_gemm.routed_moe
    sc = lambda k: params.get(f"{e}.{k}.scale")  # noqa: E731  (None: float master weights)
    # an EPLB hook (``returns_load``) gets the row mask and returns the per-physical-expert load itself
    hook_load = getattr(fn, "returns_load", False)
    extra = {"valid": None if valid is None else valid.reshape(-1)} if hook_load else {}
    routed = fn(xt, idx, w, params[f"{e}.w1.weight"], sc("w1"), params[f"{e}.w3.weight"],
                sc("w3"), params[f"{e}.w2.weight"], sc("w2"),
                limit=cfg.swiglu_limit, precision=precision, backend=backend, layer=prefix.rsplit(".", 1)[0], **extra)
    if hook_load:
        routed, load = routed
    shared = shared_expert(xt, params, f"{prefix}.shared_experts", cfg, precision, backend=backend)
    y = routed + shared.astype(jnp.float32)
    if not hook_load:
        load = expert_load(idx, None if valid is None else valid.reshape(-1), params[f"{prefix}.gate.bias"].shape[0])
    return y.astype(act_dtype(precision)).reshape(shape), load
