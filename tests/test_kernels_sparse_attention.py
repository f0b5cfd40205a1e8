"""CPU checks of the sparse sink attention reference (SPEC §4.6) against a float64 numpy loop."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dsflash.kernels import sparse_attention as sa


def _numpy_ref(q, kv, idx, sink, scale, round_p=False):
    B, S, H, D = q.shape
    out = np.zeros((B, S, H, D), np.float64)
    for b in range(B):
        for s in range(S):
            ids = [int(i) for i in idx[b, s] if i >= 0]
            if not ids:
                continue
            rows = kv[b, ids].astype(np.float64)                     # [k, D]
            lg = q[b, s].astype(np.float64) @ rows.T * scale          # [H, k]
            m = lg.max(-1, keepdims=True)
            p = np.exp(lg - m)
            den = p.sum(-1, keepdims=True) + np.exp(sink.astype(np.float64)[:, None] - m)
            if round_p:
                p = np.asarray(jnp.asarray(p, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
            out[b, s] = (p @ rows) / den
    return out


def _inputs(key, B=2, S=3, H=4, D=64, N=50, K=24, empty_frac=0.3, dtype=jnp.float32):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    q = jax.random.normal(k1, (B, S, H, D), jnp.float32).astype(dtype)
    kv = jax.random.normal(k2, (B, N, D), jnp.float32).astype(dtype)
    idx = jax.random.randint(k3, (B, S, K), 0, N, jnp.int32)
    idx = jnp.where(jax.random.uniform(k4, (B, S, K)) < empty_frac, -1, idx)
    sink = jax.random.normal(k5, (H,), jnp.float32)
    return q, kv, idx, sink


def test_fp32_matches_float64_loop():
    q, kv, idx, sink = _inputs(jax.random.PRNGKey(0))
    scale = q.shape[-1] ** -0.5
    out = sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, precision="fp32")
    ref = _numpy_ref(np.asarray(q), np.asarray(kv), np.asarray(idx), np.asarray(sink), scale)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_reference_precision_rounds_p_to_bf16():
    q, kv, idx, sink = _inputs(jax.random.PRNGKey(1), dtype=jnp.bfloat16)
    scale = q.shape[-1] ** -0.5
    out = sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=jnp.float32)
    args = [np.asarray(a.astype(jnp.float32)) for a in (q, kv)] + [np.asarray(idx), np.asarray(sink)]
    ref_round = _numpy_ref(*args, scale, round_p=True)
    ref_exact = _numpy_ref(*args, scale, round_p=False)
    err_round = np.abs(np.asarray(out) - ref_round).max()
    err_exact = np.abs(np.asarray(out) - ref_exact).max()
    assert err_round < 1e-5, err_round
    assert err_exact > err_round  # the bf16 rounding of P is visible, i.e. really applied
    # default output dtype follows q
    assert sa.sparse_sink_attention_reference(q, kv, idx, sink, scale).dtype == jnp.bfloat16


def test_empty_rows_give_zero_and_sink_lowers_mass():
    q, kv, idx, sink = _inputs(jax.random.PRNGKey(2), empty_frac=0.0)
    idx = idx.at[0, 1].set(-1)                      # one query row with no entry at all
    scale = q.shape[-1] ** -0.5
    out = sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, precision="fp32")
    assert np.all(np.isfinite(np.asarray(out)))
    assert np.all(np.asarray(out[0, 1]) == 0.0)
    # a very negative sink is the plain softmax; a huge sink drives the output to zero
    lo = sa.sparse_sink_attention_reference(q, kv, idx, jnp.full_like(sink, -1e4), scale, precision="fp32")
    hi = sa.sparse_sink_attention_reference(q, kv, idx, jnp.full_like(sink, 80.0), scale, precision="fp32")
    rows = kv[0][idx[0, 0]]
    lg = jnp.einsum("hd,kd->hk", q[0, 0], rows) * scale
    plain = jax.nn.softmax(lg, -1) @ rows
    np.testing.assert_allclose(np.asarray(lo[0, 0]), np.asarray(plain), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(hi)).max() < 1e-20


def test_chunked_equals_unchunked_and_jits():
    q, kv, idx, sink = _inputs(jax.random.PRNGKey(3), S=8, dtype=jnp.bfloat16)
    scale = q.shape[-1] ** -0.5
    full = sa.sparse_sink_attention_reference(q, kv, idx, sink, scale)
    chunked = jax.jit(lambda *a: sa.sparse_sink_attention_reference(*a, scale, chunk=2))(q, kv, idx, sink)
    np.testing.assert_array_equal(np.asarray(full.astype(jnp.float32)), np.asarray(chunked.astype(jnp.float32)))


def test_dispatch_and_shape_errors():
    q, kv, idx, sink = _inputs(jax.random.PRNGKey(4))
    a = sa.sparse_sink_attention(q, kv, idx, sink, 0.125, backend="xla")
    b = sa.sparse_sink_attention_reference(q, kv, idx, sink, 0.125)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError):
        sa.sparse_sink_attention(q, kv, idx, sink, 0.125, backend="cuda")
    with pytest.raises(ValueError):
        sa.sparse_sink_attention_reference(q, kv, idx, sink[:2], 0.125)
