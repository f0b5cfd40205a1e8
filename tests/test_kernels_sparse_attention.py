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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rope_argument_is_rotation_around_the_attention(dtype):
    """``rope`` = (cos, sin) of the rows: the same bits as rotating q first and o back after (what the model did
    before the argument existed, ``layers.apply_rope`` twice), through the front end, the chunked reference and the
    paged reference; a wrong table shape is a ValueError naming ``rope``."""
    from dsflash.kernels.rope import rope_table, rotate_tail
    from dsflash.model import state as st
    from dsflash.model.layers import apply_rope
    q, kv, idx, sink = _inputs(jax.random.PRNGKey(7), B=2, S=4, dtype=dtype)
    scale = 64 ** -0.5
    pos = jnp.array([[3, 4, 5, 6], [100, 101, 102, 103]], jnp.int32)
    omega = (10000.0 ** (-np.arange(8) / 8.0)).astype(np.float32)            # rd = 16 of D = 64
    table = rope_table(pos, omega)
    qr = apply_rope(q, pos[..., None], omega)
    want = apply_rope(sa.sparse_sink_attention_reference(qr, kv, idx, sink, scale), pos[..., None], omega, inverse=True)
    got = sa.sparse_sink_attention(q, kv, idx, sink, scale, rope=table, backend="xla")
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    chunked = sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, rope=table, chunk=2)
    np.testing.assert_array_equal(np.asarray(chunked, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got, np.float32),
                              np.asarray(sa.sparse_sink_attention_reference(q, kv, idx, sink, scale), np.float32))
    # the rotation touches only the last rd channels, and they differ from the unrotated result
    np.testing.assert_array_equal(np.asarray(rotate_tail(q, *(t[:, :, None] for t in table)))[..., :-16],
                                  np.asarray(q)[..., :-16])
    # the paged front end (XLA path here) carries the same argument
    win, win_idx = kv[:, :20], jnp.where(idx < 20, idx, -1)
    pool = st.encode_main_kv(kv[:, 20:].reshape(-1, kv.shape[-1]), "reference")
    addr = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32)[None, None], (2, 4, 4))
    valid = jnp.ones((2, 4, 4), bool)
    dec = lambda leaves, dt: st.decode_main_kv(leaves, dt)                     # noqa: E731
    p_rope = sa.sparse_sink_attention_paged(q, win, win_idx, pool, addr, valid, sink, scale, decode=dec, rope=table,
                                            backend="xla")
    p_want = apply_rope(sa.sparse_sink_attention_paged(qr, win, win_idx, pool, addr, valid, sink, scale, decode=dec,
                                                       backend="xla"), pos[..., None], omega, inverse=True)
    np.testing.assert_array_equal(np.asarray(p_rope, np.float32), np.asarray(p_want, np.float32))
    for bad in ((table[0][:, :3], table[1][:, :3]), (table[0], table[1][..., :4]),
                tuple(jnp.zeros((2, 4, 40)) for _ in range(2))):
        with pytest.raises(ValueError, match="rope"):
            sa.sparse_sink_attention(q, kv, idx, sink, scale, rope=bad, backend="xla")
