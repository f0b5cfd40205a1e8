"""Engram: n-gram hash ids from token ids (SPEC §9.3-9.5) and the gated memory injection (SPEC §9.6).

The reference hashes with int64 arithmetic. JAX runs without x64 here, so 64-bit values are carried as
four 16-bit limbs in uint32 lanes: products ``c * mult`` fit in 63 bits by construction of the
multiplier bound, XOR is limb-wise, and the modulus by a prime < 2^24 is taken 8 bits at a time.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsflash.config import ModelConfig, engram_primes
from dsflash import quant
from dsflash.model.layers import act_dtype, linear_fp8

MASK16 = 0xFFFF


@functools.lru_cache(maxsize=None)
def _layout(cfg: ModelConfig):
    """(multipliers[layer][k], primes[layer][order][head], offsets[layer][order][head]) as Python ints."""
    bound = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
    mults = []
    for L in cfg.engram_layer_ids:
        v = np.random.default_rng(10007 * L).integers(0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64)
        mults.append([int(2 * x + 1) for x in v])
    primes = engram_primes(cfg)
    offsets = []
    for layer in primes:
        acc, per = 0, []
        for order in layer:
            row = []
            for p in order:
                row.append(acc)
                acc += p
            per.append(row)
        offsets.append(per)
    return mults, primes, offsets


def hash_multipliers(cfg: ModelConfig):
    return _layout(cfg)[0]


def _limbs(value: int):
    return [(value >> (16 * i)) & MASK16 for i in range(4)]


def _mul_small(c, mult: int):
    """c [..] uint32 times a Python int -> 4 uint32 limbs of 16 bits (the product must be < 2^64).

    Schoolbook over 16-bit limbs; every partial product is split into lo/hi halves before summing so
    no uint32 sum can overflow."""
    cl = [c & MASK16, c >> 16]
    m = _limbs(mult)
    lo = {}
    hi = {}
    for a in range(2):
        for b in range(4):
            if not m[b]:
                continue
            prod = cl[a] * jnp.uint32(m[b])
            lo.setdefault(a + b, []).append(prod & MASK16)
            hi.setdefault(a + b + 1, []).append(prod >> 16)
    out, carry = [], jnp.zeros_like(c)
    for i in range(4):
        total = carry
        for t in lo.get(i, []) + hi.get(i, []):
            total = total + t
        out.append(total & MASK16)
        carry = total >> 16
    return out


def _mod_prime(limbs, p: int):
    """(sum limbs[i] 2^(16 i)) mod p for p < 2^24, 8 bits at a time so r * 256 stays in uint32."""
    r = jnp.zeros_like(limbs[0])
    P = jnp.uint32(p)
    for i in reversed(range(4)):
        for shift in (8, 0):
            byte = (limbs[i] >> shift) & 0xFF
            r = (r * jnp.uint32(256) + byte) % P
    return r


def hash_rows(cids_ext, cfg: ModelConfig, layer_k: int):
    """cids_ext [B, S + N - 1] compressed ids (already padded at the front for the N-1 previous positions).

    Returns row ids [B, S, orders*heads] int32 of Engram layer ``layer_k`` (index into engram_layer_ids)."""
    mults, primes, offsets = _layout(cfg)
    N = cfg.engram_max_ngram_size
    S = cids_ext.shape[1] - (N - 1)
    c = cids_ext.astype(jnp.uint32)
    shifted = [c[:, N - 1 - k: N - 1 - k + S] for k in range(N)]   # k = 0 is the current token
    pis = [_mul_small(shifted[k], mults[layer_k][k]) for k in range(N)]
    cols = []
    rho = pis[0]
    for o in range(N - 1):                                         # order o + 2
        rho = [a ^ b for a, b in zip(rho, pis[o + 1])]
        for h, p in enumerate(primes[layer_k][o]):
            cols.append(_mod_prime(rho, p).astype(jnp.int32) + offsets[layer_k][o][h])
    return jnp.stack(cols, axis=-1)


def compressed_ids(tokens, params, cfg: ModelConfig):
    tmap = params.get("engram.token_map")
    if tmap is None:
        return tokens.astype(jnp.int32)
    return tmap[tokens]


# Engram tables kept in host memory (SPEC §9.7: ~100 GB each at real size), keyed by (config hash, layer).
_HOST_TABLES: dict = {}


def register_host_tables(cfg: ModelConfig, tables: dict) -> None:
    """Serve Engram rows from host arrays (numpy / np.memmap) instead of device params.

    ``tables``: ``{layer: (embed.weight [R, De] float8_e4m3fn, embed.scale [R, De/32] uint8)}``. The forward
    gathers the rows of each step with a host callback, so only ``[B, S, cols, De]`` bytes cross to the
    device. Registered tables take effect for params that do not carry the table."""
    for layer, (w, sc) in tables.items():
        if layer not in cfg.engram_layer_ids:
            raise ValueError(f"register_host_tables: layer {layer} is not an Engram layer of this config")
        _HOST_TABLES[(hash(cfg), int(layer))] = (w, sc)


def host_table(cfg: ModelConfig, layer: int):
    return _HOST_TABLES.get((hash(cfg), int(layer)))


def gather_rows_host(cfg: ModelConfig, layer: int, rows, precision):
    """rows [B, S, cols] -> dequantised rows gathered on the host (jax.pure_callback)."""
    import numpy as np

    w, sc = _HOST_TABLES[(hash(cfg), int(layer))]
    De = w.shape[1]

    def gather(r):
        r = np.asarray(r)
        return np.asarray(w[r.reshape(-1)]).reshape(*r.shape, De), np.asarray(sc[r.reshape(-1)]).reshape(
            *r.shape, De // 32)

    shapes = (jax.ShapeDtypeStruct((*rows.shape, De), w.dtype), jax.ShapeDtypeStruct((*rows.shape, De // 32), jnp.uint8))
    q, s = jax.pure_callback(gather, shapes, rows, vmap_method="sequential")
    return quant.fp8_dequant(q, quant.e8m0_to_f32(s), 32, act_dtype(precision))


def gather_rows(params, prefix, rows, precision):
    """rows [B, S, cols] -> dequantised table rows [B, S, cols, De]."""
    table, scale = params[f"{prefix}.embed.weight"], params.get(f"{prefix}.embed.scale")
    q = table[rows]
    if scale is None:                                  # float master table (training)
        return q.astype(act_dtype(precision))
    s = quant.e8m0_to_f32(scale[rows])
    return quant.fp8_dequant(q, s, 32, act_dtype(precision))


def inject(X, emb, params, prefix, cfg: ModelConfig, precision):
    """X [B, S, n, d] streams; emb [B, S, cols, De] gathered rows -> X with the gated value added per copy."""
    n, d = cfg.hc_mult, cfg.hidden_size
    lead = X.shape[:-2]
    # one token axis: XLA on CPU fused the d-sums below differently at [4, 32, ...] than at [1, 128, ...] (another
    # bf16 ulp), so a prompt's prefill depended on its bucket's row split; over [B*S, ...] only the token count counts
    X, emb = X.reshape(-1, *X.shape[-2:]), emb.reshape(-1, *emb.shape[-2:])
    flat = emb.reshape(*emb.shape[:-2], -1)
    kv = linear_fp8(flat, params, f"{prefix}.wkv", precision)
    key = kv[..., : n * d].reshape(*kv.shape[:-1], n, d).astype(jnp.float32)
    value = kv[..., n * d:].astype(jnp.float32)
    Xf = X.astype(jnp.float32)
    qk = params[f"{prefix}.q_weight"].astype(jnp.float32) * params[f"{prefix}.k_weight"].astype(jnp.float32)
    eps = cfg.rms_norm_eps
    dot = jnp.sum(Xf * qk * key, axis=-1)
    dot = dot * jax.lax.rsqrt(jnp.mean(Xf * Xf, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = dot * d ** -0.5
    sign = jnp.where(jnp.signbit(dot), -1.0, 1.0)                  # copysign: +0 counts as positive
    g = jax.nn.sigmoid(sign * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
    return (Xf + g[..., None] * value[..., None, :]).astype(act_dtype(precision)).reshape(*lead, n, d)
