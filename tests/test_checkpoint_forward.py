"""Logits from a loaded synthetic checkpoint equal logits from the in-memory params it was written from
(through ``dsflash.load``, the path a user takes), and again after an orbax round trip."""
import jax
import numpy as np

from dsflash import api  # noqa: E402

import dsflash  # noqa: E402
from dsflash.checkpoint import restore_params, save_params  # noqa: E402
from dsflash.checkpoint.synth import fast_init_params, write_synthetic_checkpoint  # noqa: E402
from dsflash.config import preset  # noqa: E402


def small_cfg():
    """The tiny preset cut to 4 layers (SWA, SWA+Engram, ratio-2 KV source, ratio-1 candidate source) + 1
    DSpark stage: every tensor kind of the checkpoint, half the compile time of the 8-layer preset."""
    return preset("tiny").replace(num_hidden_layers=4, compress_ratios=(0, 0, 2, 1, 0), kv_source_layer_ids=(2, 3),
                                  index_source_layer_ids=(2, 3), candidate_source_layer_id=3,
                                  dspark_target_layer_ids=(1, 2, 3))


def test_loaded_logits_equal_in_memory(tmp_path):
    cfg = small_cfg()
    params = {k: jax.numpy.asarray(v) for k, v in fast_init_params(cfg, seed=0).items()}   # numpy-only: no init jit
    folder = write_synthetic_checkpoint(tmp_path / "ckpt", cfg, params=params)
    loaded = dsflash.load(folder, progress=False)
    assert loaded.cfg == cfg and loaded.tokenizer is not None
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    got = loaded.logits(tokens)
    in_memory = api.Model(cfg, params, loaded.tokenizer, loaded.opts)
    want = in_memory.logits(tokens)
    assert want.shape == (2, 24, cfg.vocab_size) and np.isfinite(want).all() and want.std() > 0
    np.testing.assert_array_equal(got, want)
    # and through orbax
    back = restore_params(save_params(tmp_path / "orbax", loaded.params), cfg)
    np.testing.assert_array_equal(api.Model(cfg, back, None, loaded.opts).logits(tokens), want)
