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



# ------------------------------------------------------------------ NVFP4 quotients exactly as IEEE fp32 division
def _np_nvfp4(x):
    """Independent NVFP4 quantiser: numpy float32 division (IEEE, correctly rounded) and ml_dtypes conversions."""
    g = x.reshape(*x.shape[:-1], -1, 16).astype(np.float32)
    a = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(6 * 2.0 ** -9))
    s8 = (a / np.float32(6)).astype(ml_dtypes.float8_e4m3fn)
    with np.errstate(invalid="ignore"):
        q = np.clip(g / s8.astype(np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return q.reshape(x.shape), s8[..., 0]


def _nudged(v, ks):
    """float32 values v moved by k ulps (bit steps) for every k in ks."""
    bits = np.asarray(v, np.float32).view(np.int32)
    return np.concatenate([(bits + k).view(np.float32) for k in ks])


def test_nvfp4_e2m1_tie_with_non_pow2_scale_under_jit():
    """The issue-18 case: amax 2.8125 gives the E4M3 scale 0.46875 (not a power of two) and 1.171875 / 0.46875 is
    exactly 2.5, an E2M1 tie that must go to the even code (2.0). XLA rewrote ``g / s`` as ``g * (1/s)``
    (2.5000002 -> 3.0). Checked as the model runs it: jitted, and through the main-KV cache encoder."""
    from dsflash.model import state as st
    x = np.zeros((2, 32), np.float32)
    x[:, 0], x[:, 1], x[:, 17] = 2.8125, 1.171875, -1.171875
    x[:, 16] = -2.8125
    want_q, want_s = _np_nvfp4(x)
    assert want_s.astype(np.float32)[0, 0] == 0.46875 and want_q[0, 1] == 2.0 and want_q[0, 17] == -2.0
    for f in (jax.jit(quant.nvfp4_quant), quant.nvfp4_quant):
        q, s8 = f(jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(q), want_q)
        np.testing.assert_array_equal(np.asarray(s8).view(np.uint8), want_s.view(np.uint8))
    c = jax.jit(lambda v: st.encode_main_kv(v, "reference"))(jnp.asarray(x))
    got = np.asarray(jax.jit(st.decode_main_kv, static_argnums=1)(c, jnp.float32))
    np.testing.assert_array_equal(got, (want_q.reshape(2, 2, 16) * want_s.astype(np.float32)[..., None]).reshape(2, 32))


def test_nvfp4_quotient_next_to_every_e2m1_midpoint_every_scale():
    """For every E4M3 scale s (codes 1..126, forced by a group amax of 6 s), values m s and m s +- 1..3 ulps for
    every E2M1 midpoint m, both signs: the jitted quantiser's codes equal numpy's IEEE-division ones."""
    scales = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    rows = []
    for s in scales:
        v = _nudged(mids * s, range(-3, 4))               # 49 values, all < 6 s
        v = np.concatenate([v, -v, np.zeros(((-2 * v.size) % 15), np.float32)]).reshape(-1, 15)
        rows.append(np.concatenate([np.full((v.shape[0], 1), 6 * s, np.float32), v], axis=1))
    x = np.concatenate(rows)
    assert np.all(np.abs(x[:, 1:]) < 6 * x[:, :1])
    want_q, want_s = _np_nvfp4(x)
    assert np.array_equal(want_s.astype(np.float32)[:, 0], x[:, 0] / 6)      # the intended scale in every group
    q, s8 = jax.jit(quant.nvfp4_quant)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(s8).view(np.uint8), want_s.view(np.uint8))
    bad = np.asarray(q) != want_q
    assert not bad.any(), (x[:, 1:][bad[:, 1:]][:8], np.asarray(q)[bad][:8], want_q[bad][:8])


def test_nvfp4_scale_next_to_every_e4m3_midpoint():
    """The scale ``e4m3(max(amax, 6*2^-9) / 6)`` (SPEC §16b.7: a division): amax = 6 t and 6 t +- 1..6 ulps for every
    E4M3 midpoint t (XLA's ``amax * f32(1/6)`` rounds 15 of these the wrong way), plus log-uniform random amax
    values; jitted, against numpy's IEEE division."""
    vals = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mids = np.append((vals[:-1] + vals[1:]) / 2, 464.0)
    a = _nudged((6 * mids).astype(np.float32), range(-6, 7))
    a = np.concatenate([a, np.exp(np.random.default_rng(3).uniform(np.log(1e-3), np.log(2700.0), 4000))])
    a = a.astype(np.float32)
    x = np.zeros((a.size, 16), np.float32)
    x[:, 3] = a
    x[::2, 3] *= -1
    want_q, want_s = _np_nvfp4(x)
    q, s8 = jax.jit(quant.nvfp4_quant)(jnp.asarray(x))
    got = np.asarray(s8).view(np.uint8)
    bad = got != want_s.view(np.uint8)
    assert not bad.any(), (a[bad[:, 0]][:8], got[bad][:8], want_s.view(np.uint8)[bad][:8])
    np.testing.assert_array_equal(np.asarray(q), want_q)

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
