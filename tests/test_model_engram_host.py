"""Engram tables in host memory (SPEC §9.7): rows gathered by a host callback give the same model as tables
on the device, for a preset and for a checkpoint loaded with memory-mapped tables."""
import numpy as np

import dsflash
from dsflash.checkpoint import write_synthetic_checkpoint
from dsflash.config import preset
from dsflash.model.params import init_params


def test_host_tables_match_device_tables(tmp_path):
    cfg = preset("tiny")
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
    dev = dsflash.load("tiny", seed=2, page_size=16)
    host = dsflash.load("tiny", seed=2, page_size=16, engram_tables="host")
    assert "layers.1.engram.embed.weight" not in host.params
    want = dev.logits(toks)
    np.testing.assert_array_equal(host.logits(toks), want)

    write_synthetic_checkpoint(tmp_path, cfg, params=init_params(cfg, seed=2))
    ck = dsflash.load(str(tmp_path), page_size=16, engram_tables="host", progress=False)
    assert "layers.1.engram.embed.weight" not in ck.params
    np.testing.assert_array_equal(ck.logits(toks), want)
