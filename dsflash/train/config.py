"""The ``demo`` model: every V4.1 component at a size that trains in minutes and generates on a CPU.

Components: a CED stack (2 SWA-only layers, ratio-2 layers, ratio-1 layers: encoder up to the candidate
source, decoder after it), CSA2 KV/index sharing (ratio-2 KV source 2, ratio-1 source 5, an extra index
source 7), mHC (hc_mult 4), Engram at layer 1 (2-3-grams), MoE (8 routed experts, top 2, shared expert)
and one DSpark stage (block 5). ``engram_compressed_vocab_size`` is set from the trained tokenizer.
"""
from __future__ import annotations

from dsflash.config import ModelConfig, engram_primes, preset


def _with_engram_rows(cfg: ModelConfig) -> ModelConfig:
    rows = tuple(sum(sum(h) for h in layer) for layer in engram_primes(cfg))
    return cfg.replace(engram_num_embeddings=rows)


def demo_config(vocab_size: int = 4096, compressed_vocab_size: int | None = None) -> ModelConfig:
    base = preset("tiny").replace(
        vocab_size=vocab_size, image_token_id=vocab_size - 1, hidden_size=256, moe_intermediate_size=128,
        sliding_window=32, index_topk=16, candidate_topk_blocks=8, candidate_block_size=4,
        engram_vocab_size=8000, engram_head_dim=64, engram_compressed_vocab_size=compressed_vocab_size or vocab_size,
        dspark_block_size=5, dspark_noise_token_id=3, dspark_markov_rank=64, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=1, engram_num_embeddings=(1,))
    return _with_engram_rows(base)


def test_config(vocab_size: int = 512, compressed_vocab_size: int | None = None) -> ModelConfig:
    """The tiny preset with a trained tokenizer's vocabulary (tests)."""
    base = preset("tiny").replace(vocab_size=vocab_size, image_token_id=vocab_size - 1,
                                  engram_compressed_vocab_size=compressed_vocab_size or vocab_size,
                                  engram_num_embeddings=(1,))
    return _with_engram_rows(base)


def mini_config(vocab_size: int = 512, compressed_vocab_size: int | None = None) -> ModelConfig:
    """Four layers (SWA, ratio 2, ratio 1 x2) with Engram, MoE and one DSpark stage: fast-compiling tests."""
    base = test_config(vocab_size, compressed_vocab_size).replace(
        num_hidden_layers=4, compress_ratios=(0, 2, 1, 1, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2), candidate_source_layer_id=2, engram_layer_ids=(0,),
        dspark_target_layer_ids=(1, 2, 3), sliding_window=8, engram_num_embeddings=(1,))
    return _with_engram_rows(base)


CONFIGS = {"demo": demo_config, "test": test_config, "mini": mini_config}
