"""Quantisation formats (SPEC §12, §16b.7), top-k tie breaking, Engram hashing (SPEC §9.4-9.5) — each against
an independent numpy computation."""
import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dsflash.config import preset
from dsflash.model import engram, quant
from dsflash.model.attention import select_topk
from dsflash.model.moe import route


def np_pow2_ceil(y):
    return 2.0 ** np.ceil(np.log2(y.astype(np.float64)))


def test_fp8_activation_roundtrip_matches_numpy():
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * np.float32(3.0)
    x[0, :32] = 0.0                                               # all-zero group: scale floors at 1e-4
    g = x.reshape(4, 2, 32)
    s = np_pow2_ceil(np.maximum(np.abs(g).max(-1, keepdims=True), 1e-4) / 448.0).astype(np.float32)
    ref = (np.clip(g / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).reshape(4, 64)
    np.testing.assert_array_equal(np.asarray(quant.fp8_roundtrip(jnp.asarray(x))), ref)


def test_e2m1_ties_to_even():
    v = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(quant.e2m1_round(v)), [0, 1, 1, 2, 2, 4, 4, -0.0, -4])


def test_nvfp4_and_mxfp4_roundtrips_match_numpy():
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    g16 = x.reshape(3, 4, 16)
    s = (np.maximum(np.abs(g16).max(-1, keepdims=True), 6 * 2.0 ** -9) / 6).astype(ml_dtypes.float8_e4m3fn)
    s = s.astype(np.float32)
    ref = np.clip(g16 / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * s
    np.testing.assert_array_equal(np.asarray(quant.nvfp4_roundtrip(jnp.asarray(x))), ref.reshape(3, 64))
    g32 = x.reshape(3, 2, 32)
    s = np_pow2_ceil(np.maximum(np.abs(g32).max(-1, keepdims=True), 6 * 2.0 ** -126) / 6).astype(np.float32)
    ref = np.clip(g32 / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * s
    np.testing.assert_array_equal(np.asarray(quant.mxfp4_roundtrip(jnp.asarray(x))), ref.reshape(3, 64))


def test_nibble_pack_low_first():
    codes = jnp.array([[1, 2, 15, 0]], jnp.uint8)
    packed = np.asarray(quant.pack_nibbles(codes))
    assert packed.tolist() == [[0x21, 0x0F]]
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(jnp.asarray(packed))), codes)


def test_topk_ties_break_to_lowest_index():
    cfg = preset("tiny")
    score = jnp.array([[[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0, 3.0, 3.0, 3.0, 3.0]]])
    sel = np.asarray(select_topk(score, jnp.array([[11]]), cfg))[0, 0]
    # 8 picks among eight 3.0s (ids 1,2,4,5,7,8,9,10): all of them; a tie at the cut goes to the lowest ids
    assert sel.tolist() == [1, 2, 4, 5, 7, 8, 9, 10]
    # 6 visible: the indexer masks invisible scores first, so all 6 are picked, empties are -1 at the end
    masked = jnp.where(jnp.arange(11) < 6, score, -jnp.inf)
    sel = np.asarray(select_topk(masked, jnp.array([[6]]), cfg))[0, 0]
    assert sel.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    # SPEC §16b.3: picks at or beyond the visible count are dropped even if their score is finite
    sel = np.asarray(select_topk(score, jnp.array([[6]]), cfg))[0, 0]
    assert sel.tolist() == [1, 2, 4, 5, -1, -1, -1, -1]
    x = jnp.zeros((1, cfg.hidden_size), jnp.bfloat16)                    # every expert scores the same
    idx, w = route(x, jnp.zeros((cfg.n_routed_experts, cfg.hidden_size), jnp.bfloat16),
                   jnp.zeros((cfg.n_routed_experts,)), 2, cfg)
    assert np.asarray(idx).tolist() == [[0, 1]]
    np.testing.assert_allclose(np.asarray(w), [[0.75, 0.75]], rtol=1e-6)   # normalised, x1.5


def test_engram_multipliers_are_the_spec_vectors():
    mults = engram.hash_multipliers(preset("v41_flash"))
    assert mults[0] == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert mults[1] == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


@pytest.mark.parametrize("name", ["v41_flash", "tiny"])
def test_engram_hash_rows_match_int64_numpy(name):
    cfg = preset(name)
    N = cfg.engram_max_ngram_size
    rng = np.random.default_rng(2)
    cid = rng.integers(0, cfg.engram_compressed_vocab_size, size=(2, 40 + N - 1)).astype(np.int64)
    mults, primes, offsets = engram._layout(cfg)
    for k in range(len(cfg.engram_layer_ids)):
        got = np.asarray(engram.hash_rows(jnp.asarray(cid, jnp.int32), cfg, k))
        shifted = [cid[:, N - 1 - j: N - 1 - j + 40] for j in range(N)]
        pis = [shifted[j] * np.int64(mults[k][j]) for j in range(N)]   # fits int64 by the multiplier bound
        rho, cols = pis[0], []
        for o in range(N - 1):
            rho = rho ^ pis[o + 1]
            cols += [rho % p + offsets[k][o][h] for h, p in enumerate(primes[k][o])]
        np.testing.assert_array_equal(got, np.stack(cols, -1))
        assert got.max() < cfg.engram_num_embeddings[k]
