"""The official inventory derived from the parameter table reproduces the published checkpoint totals
(SPEC_V41 §13.1, §13.4: MLX atlas of the pinned revision and the index's metadata.total_size)."""
from collections import Counter

from dsflash.checkpoint.names import expert_name, official_inventory, split_official
from dsflash.config import preset

VISION_TENSORS, VISION_BYTES = 266, 970_536_960          # all BF16


def test_full_checkpoint_totals():
    inv = official_inventory(preset("v41_flash"))
    assert len(inv) + VISION_TENSORS == 96_085
    by_dtype = Counter()
    for t in inv.values():
        by_dtype[t.dtype] += t.nbytes
    assert by_dtype == {"BF16": 3_952_883_712 - VISION_BYTES, "F32": 169_229_128, "F8_E4M3": 204_015_223_296,
                        "F8_E8M0": 23_563_015_184, "I8": 278_585_671_680}
    assert sum(by_dtype.values()) + VISION_BYTES == 510_286_023_000       # metadata.total_size
    t = inv["layers.7.ffn.experts.383.w2.weight"]
    assert (t.param, t.expert, t.shape, t.dtype) == ("layers.7.ffn.experts.w2.weight", 383, (5120, 1152), "I8")
    assert inv["mtp.2.ffn.experts.127.w1.scale"].shape == (2304, 160)
    assert "mtp.2.ffn.experts.128.w1.scale" not in inv
    assert inv["layers.14.engram.embed.weight"].shape == (384_016_682, 256)


def test_name_mapping():
    assert split_official("layers.3.ffn.experts.17.w3.scale") == ("layers.3.ffn.experts.w3.scale", 17)
    assert split_official("mtp.0.ffn.experts.0.w1.weight") == ("mtp.0.ffn.experts.w1.weight", 0)
    assert split_official("layers.3.ffn.shared_experts.w3.weight") == ("layers.3.ffn.shared_experts.w3.weight", None)
    assert expert_name("layers.3.ffn.experts.w2.weight", 5) == "layers.3.ffn.experts.5.w2.weight"
