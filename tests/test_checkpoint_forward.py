"""Logits from a loaded synthetic checkpoint equal logits from the in-memory params it was written from."""
import jax
import numpy as np
import pytest

forward_mod = pytest.importorskip("dsflash.model.forward", reason="dsflash.model.forward not available yet")

from dsflash.checkpoint import load_checkpoint, restore_params, save_params  # noqa: E402
from dsflash.checkpoint.synth import fast_init_params, write_synthetic_checkpoint  # noqa: E402
from dsflash.config import preset  # noqa: E402
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch  # noqa: E402

PAGE = 16


def run(params, cfg, tokens):
    B, S = tokens.shape
    pages = -(-S // PAGE)
    state = init_state(cfg, CacheGeometry(num_slots=B, num_pages=B * pages, page_size=PAGE))
    batch = make_batch(tokens, pages_per_seq=pages)
    out, _ = forward_mod.forward_jit(params, cfg, batch, state, RunOptions(logits="all", page_size=PAGE))
    return np.asarray(out["logits"])


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
    cfg2, loaded = load_checkpoint(folder, progress=False)
    assert cfg2 == cfg
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    want = run(params, cfg, tokens)
    assert np.isfinite(want).all() and want.std() > 0
    got = run(loaded, cfg2, tokens)
    np.testing.assert_array_equal(got, want)
    # and through orbax
    back = restore_params(save_params(tmp_path / "orbax", loaded), cfg)
    np.testing.assert_array_equal(run(back, cfg, tokens), want)
