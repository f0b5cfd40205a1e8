"""ModelConfig: the official nested ``config.json`` <-> one frozen dataclass, plus presets.

Field names are the Hugging Face ``text_config`` keys (SPEC_V41 §1.1) so that reading and writing
the official file is a plain mapping. Everything the layer schedule needs (roles of each layer,
the KV / index source a layer reads) is derived here once, so the model never re-derives it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

_DEFAULT_YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 65536,
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=lambda: dict(_DEFAULT_YARN))
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    sliding_window: int = 128
    compress_rope_theta: float = 160000.0
    compress_ratios: tuple = tuple([0, 0] + [2] * 18 + [1] * 20 + [0] * 3)
    kv_source_layer_ids: tuple = (2, 8, 14, 20)
    index_source_layer_ids: tuple = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple = (1, 14)
    engram_num_embeddings: tuple = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # top-level keys of the official file
    bos_token_id: int = 0
    eos_token_id: int = 1
    image_token_id: int = 129264
    weight_block_size: tuple = (32, 32)
    expert_dtype: str = "fp4"

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                     "engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids",
                     "weight_block_size"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        object.__setattr__(self, "rope_scaling", dict(self.rope_scaling or {}))
        self.validate()
        object.__setattr__(self, "_hash", hash(json.dumps(self.to_hf_dict(), sort_keys=True)))

    def __hash__(self):  # rope_scaling is a dict; configs are static jit arguments, so hash the JSON once
        return self._hash

    # ------------------------------------------------------------------ derived schedule
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_stages(self) -> int:
        """DSpark draft stages (``mtp.{s}``), the last entries of ``compress_ratios``."""
        return self.num_nextn_predict_layers

    @property
    def n_engram_orders(self) -> int:
        return self.engram_max_ngram_size - 1

    @property
    def engram_cols(self) -> int:
        """Lookup columns per Engram layer: orders x heads."""
        return self.n_engram_orders * self.engram_n_heads

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The nearest KV source at or before ``layer`` (None for ratio-0 layers)."""
        if layer >= self.num_hidden_layers or self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source_of(self, layer: int) -> int | None:
        if layer >= self.num_hidden_layers or self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    @property
    def decoder_start(self) -> int:
        """First decoder layer of the CED split: the candidate source (layer 20)."""
        return self.candidate_source_layer_id

    def engram_index(self, layer: int) -> int:
        return self.engram_layer_ids.index(layer)

    def validate(self) -> None:
        def bad(field_name, msg):
            raise ValueError(f"ModelConfig.{field_name}: {msg}")

        L = self.num_hidden_layers
        if L < 1:
            bad("num_hidden_layers", "must be >= 1")
        if len(self.compress_ratios) != L + self.num_nextn_predict_layers:
            bad("compress_ratios", f"has {len(self.compress_ratios)} entries, expected "
                f"num_hidden_layers + num_nextn_predict_layers = {L + self.num_nextn_predict_layers}")
        if any(r not in (0, 1, 2) for r in self.compress_ratios):
            bad("compress_ratios", "entries must be 0, 1 or 2 (V4.1 has SWA-only, ratio-1 and ratio-2 layers)")
        if any(r != 0 for r in self.compress_ratios[L:]):
            bad("compress_ratios", "DSpark stages (the last num_nextn_predict_layers entries) must be 0")
        if self.num_key_value_heads != 1:
            bad("num_key_value_heads", "V4.1 uses one shared KV latent (MQA); must be 1")
        for name in ("hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size",
                     "head_dim", "index_head_dim"):
            if getattr(self, name) % 32:
                bad(name, f"{getattr(self, name)} is not a multiple of 32 (FP8/MXFP4 block size)")
        if self.weight_block_size != (32, 32):
            bad("weight_block_size", "V4.1 stores dense FP8 weights in 32x32 blocks")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            bad("qk_rope_head_dim", "must be even and no larger than head_dim and index_head_dim")
        if self.num_attention_heads % self.o_groups:
            bad("o_groups", f"{self.o_groups} does not divide num_attention_heads={self.num_attention_heads}")
        if (self.num_attention_heads // self.o_groups) * self.head_dim % 32:
            bad("o_groups", "group width (heads per group x head_dim) must be a multiple of 32")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            bad("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
        if self.num_nextn_predict_layers and not 1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts:
            bad("dspark_num_experts_per_tok", f"must be in [1, dspark_n_routed_experts={self.dspark_n_routed_experts}]")
        if self.n_shared_experts != 1:
            bad("n_shared_experts", "V4.1 has exactly one shared expert")
        if self.scoring_func != "sqrtsoftplus":
            bad("scoring_func", "only 'sqrtsoftplus' is part of V4.1")
        if self.sliding_window < 1:
            bad("sliding_window", "must be >= 1")
        # --- CSA2 sharing
        ratio_layers = [l for l in range(L) if self.compress_ratios[l] > 0]
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)):
                bad(name, "must be strictly increasing")
            for l in ids:
                if not 0 <= l < L or self.compress_ratios[l] == 0:
                    bad(name, f"layer {l} is not a compressed (ratio > 0) backbone layer")
        if ratio_layers:
            if not self.kv_source_layer_ids or self.kv_source_layer_ids[0] != ratio_layers[0]:
                bad("kv_source_layer_ids", "the first compressed layer must be a KV source")
            if not self.index_source_layer_ids or self.index_source_layer_ids[0] != ratio_layers[0]:
                bad("index_source_layer_ids", "the first compressed layer must be an index source")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            bad("index_source_layer_ids", "every KV source must also be an index source (it produces index K)")
        for l in ratio_layers:
            src = max(s for s in self.kv_source_layer_ids if s <= l)
            if self.compress_ratios[src] != self.compress_ratios[l]:
                bad("compress_ratios", f"layer {l} (ratio {self.compress_ratios[l]}) reads KV source {src} "
                    f"of ratio {self.compress_ratios[src]}")
        if ratio_layers:
            if self.candidate_source_layer_id not in self.kv_source_layer_ids:
                bad("candidate_source_layer_id", "must be one of kv_source_layer_ids")
            if self.candidate_source_layer_id != max(self.kv_source_layer_ids):
                bad("candidate_source_layer_id", "must be the last KV source (the decoder's global KV)")
            if self.candidate_topk_blocks * self.candidate_block_size - (self.candidate_block_size - 1) < self.index_topk:
                bad("candidate_topk_blocks", "candidate_topk_blocks*candidate_block_size - (candidate_block_size-1) "
                    f"must be >= index_topk={self.index_topk}")
        if self.index_topk < 1:
            bad("index_topk", "must be >= 1")
        # --- Engram
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            bad("engram_num_embeddings", "needs one table size per engram layer")
        for l in self.engram_layer_ids:
            if not 0 <= l < L:
                bad("engram_layer_ids", f"layer {l} out of range")
        if self.engram_layer_ids:
            if self.engram_max_ngram_size < 2:
                bad("engram_max_ngram_size", "must be >= 2")
            if self.engram_head_dim % 32:
                bad("engram_head_dim", "must be a multiple of 32 (FP8 row scale blocks)")
        # --- DSpark
        if self.num_nextn_predict_layers:
            if len(self.dspark_target_layer_ids) < 1 or any(not 0 <= l < L for l in self.dspark_target_layer_ids):
                bad("dspark_target_layer_ids", "must name backbone layers")
            if self.dspark_block_size < 1:
                bad("dspark_block_size", "must be >= 1")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size:
                bad("dspark_noise_token_id", "must be a token id")
        if self.gate_temp <= 0:
            bad("gate_temp", "must be > 0")

    # ------------------------------------------------------------------ official JSON
    def to_hf_dict(self) -> dict:
        text = {}
        top_keys = {"bos_token_id", "eos_token_id", "image_token_id", "weight_block_size", "expert_dtype"}
        for f in dataclasses.fields(self):
            if f.name in top_keys:
                continue
            v = getattr(self, f.name)
            text[f.name] = list(v) if isinstance(v, tuple) else v
        text["model_type"] = "deepseek_v41_text"
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "image_token_id": self.image_token_id,
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.weight_block_size),
                "scale_fmt": "ue8m0",
                "expert_dtype": self.expert_dtype,
            },
            "text_config": text,
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        if "text_config" in d:
            text = dict(d["text_config"])
            top = d
        else:  # a flat text config is accepted too
            text, top = dict(d), d
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in text.items() if k in known}
        for k in ("bos_token_id", "eos_token_id", "image_token_id"):
            if k in top and top[k] is not None:
                kwargs[k] = top[k]
        q = top.get("quantization_config") or {}
        if "weight_block_size" in q:
            kwargs["weight_block_size"] = tuple(q["weight_block_size"])
        if "expert_dtype" in q:
            kwargs["expert_dtype"] = q["expert_dtype"]
        return cls(**kwargs)

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_hf_dict(), f, indent=2)

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> "ModelConfig":
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        with open(p) as f:
            return cls.from_hf_dict(json.load(f))

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def hash(self) -> str:
        import hashlib
        return hashlib.sha256(json.dumps(self.to_hf_dict(), sort_keys=True).encode()).hexdigest()[:12]

    # ------------------------------------------------------------------ KV accounting
    def global_kv_bytes_per_token(self) -> float:
        """Packed global KV per token (SPEC §4.9): FP4 main KV + E4M3/16 scales, MXFP4 index K."""
        main = self.head_dim // 2 + self.head_dim // 16
        index = self.index_head_dim // 2 + self.index_head_dim // 32
        return sum((main + index) / self.compress_ratios[s] for s in self.kv_source_layer_ids)


def engram_primes(cfg: ModelConfig) -> list[list[list[int]]]:
    """SPEC §9.3: primes[layer][order][head], a seen-set shared across layers."""
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_order = []
        for _o in range(cfg.n_engram_orders):
            start = cfg.engram_vocab_size - 1
            heads = []
            for _h in range(cfg.engram_n_heads):
                p = _next_prime(start, seen)
                seen.add(p)
                heads.append(p)
                start = p
            per_order.append(heads)
        out.append(per_order)
    return out


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    r = int(math.isqrt(n))
    f = 3
    while f <= r:
        if n % f == 0:
            return False
        f += 2
    return True


def _next_prime(n: int, seen: set[int]) -> int:
    c = n + 1
    while not _is_prime(c) or c in seen:
        c += 1
    return c


# ---------------------------------------------------------------------- presets
def _tiny() -> ModelConfig:
    cfg = dict(
        vocab_size=512, hidden_size=256, moe_intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, head_dim=128, qk_rope_head_dim=32, q_lora_rank=64,
        o_lora_rank=64, o_groups=2, n_routed_experts=8, num_experts_per_tok=2,
        sliding_window=16, compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 0),
        kv_source_layer_ids=(2, 5), index_source_layer_ids=(2, 5, 7), index_n_heads=2,
        index_head_dim=64, index_topk=8, candidate_source_layer_id=5, candidate_topk_blocks=4,
        candidate_block_size=4, engram_layer_ids=(1,), engram_max_ngram_size=3,
        engram_vocab_size=1000, engram_n_heads=2, engram_head_dim=32, engram_pad_token_id=2,
        engram_compressed_vocab_size=512, num_nextn_predict_layers=1, dspark_block_size=3,
        dspark_noise_token_id=3, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=32,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=1, max_position_embeddings=4096,
        image_token_id=511,
    )
    base = ModelConfig(**{**cfg, "engram_num_embeddings": (1,)})
    rows = tuple(sum(sum(h) for h in layer) for layer in engram_primes(base))
    return base.replace(engram_num_embeddings=rows)


def _bench(n_layers: int = 4, n_experts: int = 48) -> ModelConfig:
    """Real layer widths, fewer layers/experts: one or two GPUs can time real-shape layers.

    Layers: [SWA, SWA+Engram-free, ratio-2 Full, ratio-1 Full(candidate source), ...ratio-1 Reuse]."""
    if n_layers < 4:
        raise ValueError("ModelConfig bench preset: n_layers must be >= 4")
    ratios = (0, 0, 2) + (1,) * (n_layers - 3)
    return ModelConfig(
        num_hidden_layers=n_layers, compress_ratios=ratios + (0,), kv_source_layer_ids=(2, 3),
        index_source_layer_ids=(2, 3), candidate_source_layer_id=3, n_routed_experts=n_experts,
        engram_layer_ids=(), engram_num_embeddings=(), num_nextn_predict_layers=1,
        dspark_target_layer_ids=tuple(range(n_layers - 3, n_layers)) if n_layers >= 3 else (n_layers - 1,),
        dspark_n_routed_experts=min(128, n_experts),
    )


PRESETS = {
    "v41_flash": lambda: ModelConfig(),
    "tiny": _tiny,
    "bench": _bench,
    "bench-4l-48e": lambda: _bench(4, 48),
    "bench-4l-96e": lambda: _bench(4, 96),
    "bench-8l-384e": lambda: _bench(8, 384),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]()
