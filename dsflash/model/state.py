"""Inference state (SPEC_V41 §15) and the per-call batch metadata.

State is a plain pytree (nested dicts of arrays) so it can be donated, sharded and checkpointed:

* ``swa[name]``       per-slot window ring of every block (backbone ``"0".."L-1"`` and DSpark ``"mtp.s"``):
                      ``[slots, R, head_dim]``, position ``q`` lives at ring index ``q % R``.
* ``main_kv[src]``    paged compressed main KV of each KV source: ``[pages * P/r, head_dim]`` entries,
                      entry ``j`` of a sequence at ``page_table[j // (P/r)] * (P/r) + j % (P/r)``.
* ``index_k[src]``    paged index keys, same addressing, ``[pages * P/r, index_head_dim]``.
* ``comp[src]``       ratio-2 compressor per-token projections ``kv``/``score`` ``[slots, Rc, head_dim]`` fp32
                      (the pending group of SPEC §4.4, kept as a ring so speculative rows never clobber it).
* ``engram_hist``     ``[slots, Rc]`` compressed token ids by position ``% Rc`` (-1 = nothing).

Rings are longer than the window (``R = sliding_window + ring_slack``) so that rows written
speculatively past the committed length (draft verification) never overwrite an entry a later
query still needs: rollback is by length only. ``ring_slack`` must be >= the most rows one call
writes beyond the committed length (DSpark block + 1).

Storage formats by precision:
* ``"reference"``: packed, exactly the bytes of the released caches — window FP8 E4M3 codes + UE8M0
  per 32; main KV E2M1 nibbles + E4M3 scales per 16 (288 B/entry); index K E2M1 nibbles + UE8M0
  per 32 (68 B/entry). The round trip is lossless w.r.t. the reference's quantise-dequantise.
* ``"bf16"`` / ``"fp32"``: plain arrays of that dtype.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsflash.config import ModelConfig
from dsflash.kernels import dispatch
from dsflash import quant

PRECISIONS = ("reference", "bf16", "fp32")


@dataclass(frozen=True)
class CacheGeometry:
    num_slots: int          # sequences that can be live at once (per-slot rings)
    num_pages: int          # pages of global KV
    page_size: int = 64     # tokens per page (even, so ratio-2 groups never straddle pages)
    ring_slack: int = 16    # ring rows beyond the window (>= rows written past the committed length)

    def __post_init__(self):
        for f in ("num_slots", "num_pages", "page_size", "ring_slack"):
            if getattr(self, f) < 1:
                raise ValueError(f"CacheGeometry.{f} must be >= 1")
        if self.page_size % 2:
            raise ValueError("CacheGeometry.page_size must be even (ratio-2 groups must not straddle pages)")


def ring_len(cfg: ModelConfig, geo: CacheGeometry) -> int:
    return cfg.sliding_window + geo.ring_slack


def block_names(cfg: ModelConfig) -> list[str]:
    return [str(i) for i in range(cfg.num_hidden_layers)] + [f"mtp.{s}" for s in range(cfg.n_stages)]


def _cache_dtype(precision):
    return jnp.float32 if precision == "fp32" else jnp.bfloat16


# ------------------------------------------------------------------ encode / decode per cache kind
def encode_window(x, precision):
    if precision == "reference":
        q, s = quant.fp8_quant(x, 32)
        return {"q": q, "s": quant.f32_pow2_to_e8m0(s)}
    return {"x": x.astype(_cache_dtype(precision))}


def decode_window(c, dtype=jnp.bfloat16):
    if "x" in c:
        return c["x"].astype(dtype)
    return quant.fp8_dequant(c["q"], quant.e8m0_to_f32(c["s"]), 32, dtype)


def encode_main_kv(x, precision):
    if precision == "reference":
        q, s8 = quant.nvfp4_quant(x, 16)
        return {"q": quant.pack_nibbles(quant.e2m1_codes(q)), "s": s8}
    return {"x": x.astype(_cache_dtype(precision))}


def decode_main_kv(c, dtype=jnp.bfloat16):
    if "x" in c:
        return c["x"].astype(dtype)
    vals = quant.e2m1_from_codes(quant.unpack_nibbles(c["q"]))
    g = vals.reshape(*vals.shape[:-1], -1, 16) * c["s"].astype(jnp.float32)[..., None]
    return g.reshape(vals.shape).astype(dtype)


def encode_index_k(x, precision):
    if precision == "reference":
        q, s = quant.mxfp4_quant(x, 32)
        return {"q": quant.pack_nibbles(quant.e2m1_codes(q)), "s": quant.f32_pow2_to_e8m0(s)}
    return {"x": x.astype(_cache_dtype(precision))}


def decode_index_k(c, dtype=jnp.bfloat16):
    if "x" in c:
        return c["x"].astype(dtype)
    vals = quant.e2m1_from_codes(quant.unpack_nibbles(c["q"]))
    g = vals.reshape(*vals.shape[:-1], -1, 32) * quant.e8m0_to_f32(c["s"])[..., None]
    return g.reshape(vals.shape).astype(dtype)


def _empty(encode, shape, precision):
    """Zero-filled storage with the layout ``encode`` produces for ``shape`` (via abstract eval)."""
    abstract = jax.eval_shape(lambda: encode(jnp.zeros(shape, jnp.float32), precision))
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)


def init_state(cfg: ModelConfig, geo: CacheGeometry, precision: str = "reference") -> dict:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    R, Dh = ring_len(cfg, geo), cfg.head_dim
    st = {"swa": {}, "main_kv": {}, "index_k": {}, "comp": {}}
    for name in block_names(cfg):
        st["swa"][name] = _empty(encode_window, (geo.num_slots, R, Dh), precision)
    for src in cfg.kv_source_layer_ids:
        r = cfg.ratio(src)
        n = geo.num_pages * (geo.page_size // r)
        st["main_kv"][str(src)] = _empty(encode_main_kv, (n, Dh), precision)
        st["index_k"][str(src)] = _empty(encode_index_k, (n, cfg.index_head_dim), precision)
        if r == 2:
            st["comp"][str(src)] = {
                "kv": jnp.zeros((geo.num_slots, geo.ring_slack, Dh), jnp.float32),
                "score": jnp.zeros((geo.num_slots, geo.ring_slack, Dh), jnp.float32),
            }
    st["engram_hist"] = jnp.full((geo.num_slots, geo.ring_slack), -1, jnp.int32)
    return st


def global_kv_bytes_per_token(state: dict, geo: CacheGeometry) -> float:
    """Bytes of stored global KV (main KV + index K of every source) per token of page capacity, read off
    the state arrays themselves (also works on ``jax.eval_shape`` results)."""
    total = sum(a.size * jnp.dtype(a.dtype).itemsize for kind in ("main_kv", "index_k")
                for src in state[kind].values() for a in src.values())
    return total / (geo.num_pages * geo.page_size)


# ------------------------------------------------------------------ batch metadata
@jax.tree_util.register_dataclass
@dataclass
class Batch:
    """What the engine prepared for one forward call. All arrays; rows are sequences.

    tokens [B, S] int32     token ids; row b holds positions start[b] .. start[b] + lengths[b] - 1
    start [B] int32         absolute position of tokens[b, 0]
    lengths [B] int32       valid tokens of the row (0 = an idle/dummy row: it writes no state)
    slots [B] int32         per-sequence state slot (window rings, compressor ring, Engram history)
    page_table [B, P] int32 global-KV pages of the sequence, in order
    enc_floor [B] int32     encoder SWA keys below this position do not exist (encoder bounded replay)
    dec_floor [B] int32     decoder SWA keys below this position do not exist (decoder bounded replay)
    kv_write_from [B] int32 global KV is written only for positions >= this (replayed tokens reuse cache)
    engram_rows             optional [B, S, n_engram_layers, cols, De] rows gathered on the host
    prev_tokens             optional [B, N-1] token ids at positions start-N+1 .. start-1 (N = Engram max n-gram;
                            -1 before the sequence start): the Engram history for this call, replacing the
                            slot's ring. Needed when a call starts where this slot never ran (a prefix-cache
                            hit or a P/D transfer replays from the middle of a sequence).
    """
    tokens: jax.Array
    start: jax.Array
    lengths: jax.Array
    slots: jax.Array
    page_table: jax.Array
    enc_floor: jax.Array
    dec_floor: jax.Array
    kv_write_from: jax.Array
    engram_rows: jax.Array | None = None
    prev_tokens: jax.Array | None = None

    @property
    def positions(self):
        return self.start[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]

    @property
    def valid(self):
        return jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :] < self.lengths[:, None]


def make_batch(tokens, start=None, lengths=None, slots=None, page_table=None, *, pages_per_seq=None,
               enc_floor=None, dec_floor=None, kv_write_from=None) -> Batch:
    """Convenience constructor (notebooks/tests): defaults give row b slot b and pages b*n..(b+1)*n-1."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    B, S = tokens.shape
    z = jnp.zeros((B,), jnp.int32)
    start = z if start is None else jnp.asarray(start, jnp.int32).reshape(B)
    lengths = jnp.full((B,), S, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32).reshape(B)
    slots = jnp.arange(B, dtype=jnp.int32) if slots is None else jnp.asarray(slots, jnp.int32).reshape(B)
    if page_table is None:
        if pages_per_seq is None:
            raise ValueError("make_batch: give page_table or pages_per_seq")
        page_table = slots[:, None] * pages_per_seq + jnp.arange(pages_per_seq, dtype=jnp.int32)[None]
    page_table = jnp.asarray(page_table, jnp.int32)
    return Batch(tokens, start, lengths, slots, page_table,
                 z if enc_floor is None else jnp.asarray(enc_floor, jnp.int32).reshape(B),
                 z if dec_floor is None else jnp.asarray(dec_floor, jnp.int32).reshape(B),
                 z if kv_write_from is None else jnp.asarray(kv_write_from, jnp.int32).reshape(B))


@dataclass(frozen=True)
class RunOptions:
    """Static switches of one compiled forward (hashable; pass as a static argument).

    precision       "reference" (released numerics, default) | "bf16" (no round trips) | "fp32"
    bounded_replay  None (exact) | "report" (layer 20's compressor on all tokens, layers >= 20 on the
                    tail: tech-report definition) | "layer20_full" (layers 0-20 on all tokens, 21+ on the
                    tail: the SGLang/ATOM variant). SPEC §6.2.
    replay_tail     tail length for bounded replay (window + draft block by default)
    logits          "last" ([B, V] at each row's last valid token) | "all" ([B, S, V]) | "none"
    taps            return DSpark taps ``main_hidden`` [B, S, T*d] for every row position
    backend         kernel backend "auto" (default: Triton on a GPU with jax-triton, XLA otherwise) | "xla"
                    (pure-JAX references) | "triton" (GPU kernels); kept as given, decided per kernel by
                    ``dsflash.kernels.dispatch`` at trace time (``resolved_backend``: what "auto" means here)
    page_size       tokens per global-KV page (the CacheGeometry the state was built with)
    expert_load     return ``out["expert_load"]`` [L, E]: tokens routed to each expert per layer (EPLB input)
    index_distill   return ``out["index_kl"]``: the indexer's distillation loss summed over the index-source
                    layers (training; ``model/index_distill.py``); the other outputs are the same
    """
    precision: str = "reference"
    bounded_replay: str | None = None
    replay_tail: int = 0
    logits: str = "last"
    taps: bool = False
    backend: str = "auto"
    page_size: int = 64
    expert_load: bool = False
    index_distill: bool = False

    def __post_init__(self):
        if self.page_size < 2 or self.page_size % 2:
            raise ValueError("RunOptions.page_size must be even and >= 2 (must equal CacheGeometry.page_size)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"RunOptions.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.bounded_replay not in (None, "report", "layer20_full"):
            raise ValueError("RunOptions.bounded_replay must be None, 'report' or 'layer20_full'")
        if self.bounded_replay and self.replay_tail < 1:
            raise ValueError("RunOptions.replay_tail must be >= 1 with bounded replay")
        if self.logits not in ("last", "all", "none"):
            raise ValueError("RunOptions.logits must be 'last', 'all' or 'none'")
        if self.bounded_replay and self.index_distill:
            raise ValueError("RunOptions.index_distill is for training forwards, not with bounded replay")
        if self.bounded_replay and self.logits == "all":
            raise ValueError("RunOptions.logits='all' is not available with bounded replay (SPEC §6.2.4)")
        dispatch.check_backend(self.backend, "RunOptions.backend")     # no JAX backend start-up here

    @property
    def resolved_backend(self) -> str:
        """"xla" | "triton": what ``backend`` means in this process (``dispatch.resolve_backend``)."""
        return dispatch.resolve_backend(self.backend, "RunOptions.backend")

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)
