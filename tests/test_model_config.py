"""ModelConfig <-> official config.json, presets, validation, and the SPEC §0 / §4.9 figures computed from
the parameter table and the state arrays (not typed in)."""
import json

import pytest

from dsflash.config import PRESETS, ModelConfig, engram_primes, preset
from dsflash.model.params import param_counts, param_specs
from dsflash.model.state import CacheGeometry, global_kv_bytes_per_token, init_state


def test_presets_validate_and_roundtrip_json(tmp_path):
    for name in PRESETS:
        cfg = preset(name)
        path = tmp_path / f"{name}.json"
        cfg.save_json(path)
        d = json.loads(path.read_text())
        assert "quantization_config" in d and "quantization_config" not in d["text_config"]
        assert d["text_config"]["model_type"] == "deepseek_v41_text"
        assert ModelConfig.load_json(path) == cfg


def test_released_config_values():
    """SPEC §1.1 keys of the released file map onto the v41_flash preset."""
    released = {"text_config": {"hidden_size": 5120, "num_hidden_layers": 40, "compress_ratios": [0, 0] + [2] * 18
                                + [1] * 20 + [0] * 3, "index_topk": 512, "candidate_topk_blocks": 2048,
                                "engram_num_embeddings": [384006168, 384016682], "n_routed_experts": 384},
                "quantization_config": {"weight_block_size": [32, 32], "expert_dtype": "fp4"}}
    cfg = ModelConfig.from_hf_dict(released)
    assert cfg == preset("v41_flash")


def test_engram_primes_reproduce_table_sizes():
    cfg = preset("v41_flash")
    primes = engram_primes(cfg)
    assert primes[0][0][:3] == [16000057, 16000079, 16000081]            # SPEC §9.3
    assert tuple(sum(sum(o) for o in layer) for layer in primes) == cfg.engram_num_embeddings


def test_global_kv_bytes_per_token_is_890():
    cfg = preset("v41_flash")
    assert cfg.global_kv_bytes_per_token() == 890
    # the same figure read off the packed state arrays ("reference" storage)
    geo = CacheGeometry(num_slots=1, num_pages=2, page_size=64, ring_slack=8)
    import jax
    state = jax.eval_shape(lambda: init_state(cfg, geo, "reference"))
    assert global_kv_bytes_per_token(state, geo) == 890


def test_parameter_counts_match_spec():
    """SPEC §0 / §13.1: 763,205,315,794 parameters in all, of which vision is 970,536,960 bf16 bytes;
    backbone ~552B, Engram 196.6B, DSpark 14.2B."""
    c = param_counts(preset("v41_flash"))
    vision = 970_536_960 // 2
    assert c["total"] == 763_205_315_794 - vision
    assert c["engram"] == 768_022_850 * 256
    assert round(c["backbone"] / 1e9) == 552
    assert round(c["dspark"] / 1e8) == 142


@pytest.mark.parametrize("field,value,match", [
    ("index_topk", 64, "candidate_topk_blocks"),             # geometry rule of SPEC §16b.3 broken
    ("hidden_size", 250, "hidden_size"),
    ("o_groups", 3, "o_groups"),
    ("compress_ratios", (0, 0, 2, 2, 2, 1, 1, 1), "compress_ratios"),
    ("kv_source_layer_ids", (3, 5), "kv_source_layer_ids"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
])
def test_invalid_configs_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        preset("tiny").replace(**{field: value})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


def test_param_table_is_consistent():
    cfg = preset("tiny")
    specs = param_specs(cfg)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    for s in specs:
        assert len(s.axes) == len(s.shape), s.name
        if s.fmt == "fp8":
            assert all(d % 32 == 0 for d in s.shape[-2:]), s.name
