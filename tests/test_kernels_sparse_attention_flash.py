"""CPU checks of the v3 ("flash") sparse attention pieces that run outside the Triton kernel: the split planner, the
exact fp32 combine of split partials, and the error band (``flash_weights_abs`` / ``flash_bound``) that the GPU test
and the interpreter script assert. The kernel's math is emulated in JAX block by block (running max, P rounded to
bf16 against it, alpha rescaling, fp32 partials per split), so the band is checked against the algorithm itself;
the kernel's own code is checked in Triton's interpreter (scripts/triton_interpret_sparse_attention.py)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("triton")
import jax.numpy as jnp  # noqa: E402

from dsflash.kernels import sparse_attention as sa  # noqa: E402
from dsflash.kernels import sparse_attention_triton as sat  # noqa: E402


def _inputs(seed, B=2, S=2, H=8, D=64, N=60, K=40, empty_row=True):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
    kv = jax.random.normal(ks[1], (B, N, D), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(ks[2], (B, S, K), 0, N, jnp.int32)
    idx = jnp.where(jax.random.uniform(ks[3], (B, S, K)) < 0.3, -1, idx)
    if empty_row:
        idx = idx.at[B - 1, S - 1].set(-1)
    sink = jax.random.normal(ks[4], (H,), jnp.float32)
    return q, kv, idx, sink, D ** -0.5


def _emulate(q, kv, idx, sink, scale, BK, NS, rescale=True):
    """v3's math in JAX: per split, blocks of BK entries with a running max; P rounded to bf16 against it."""
    B, S, H, D = q.shape
    K = idx.shape[-1]
    nb = -(-K // BK)
    bps = -(-nb // NS)
    ns = -(-nb // bps)
    qf = q.astype(jnp.float32).reshape(B * S, H, D)
    ids = idx.reshape(B * S, K)
    kvr = jnp.repeat(kv.astype(jnp.float32), S, axis=0)                   # [R, N, D], row r -> its sequence
    hp = jax.lax.Precision.HIGHEST
    ops, mps, lps = [], [], []
    for sp in range(ns):
        m = jnp.full((B * S, H), -1e30, jnp.float32)
        l = jnp.zeros((B * S, H), jnp.float32)
        acc = jnp.zeros((B * S, H, D), jnp.float32)
        for b in range(sp * bps, min(sp * bps + bps, nb)):
            blk = ids[:, b * BK:(b + 1) * BK]
            valid = blk >= 0
            rows = jnp.take_along_axis(kvr, jnp.where(valid, blk, 0)[:, :, None], axis=1)   # [R, bk, D]
            s = jnp.einsum("rhd,rkd->rhk", qf, rows, precision=hp) * scale
            s = jnp.where(valid[:, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            alpha = jnp.exp(m - m_new) if rescale else jnp.ones_like(m)
            p = jnp.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            pb = p.astype(jnp.bfloat16).astype(jnp.float32)
            acc = acc * alpha[..., None] + jnp.einsum("rhk,rkd->rhd", pb, rows, precision=hp)
            m = m_new
        ops.append(acc)
        mps.append(m)
        lps.append(l)
    op, mp, lp = jnp.stack(ops, 1), jnp.stack(mps, 1), jnp.stack(lps, 1)
    return sat.flash_combine(op, mp, lp, sink, (B, S, H, D), jnp.float32)


def _band_ratio(out, q, kv, idx, sink, scale):
    ref = np.asarray(sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=jnp.float32))
    ref32 = np.asarray(sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=jnp.float32,
                                                          precision="fp32"))
    A = np.asarray(sat.flash_weights_abs(q, kv, idx, sink, scale))
    out = np.asarray(out)
    return (float((np.abs(out - ref) / sat.flash_bound(A, ref, 2)).max()),
            float((np.abs(out - ref32) / sat.flash_bound(A, ref32, 1)).max()), out)


@pytest.mark.parametrize("BK,NS", [(8, 1), (8, 2), (16, 3), (64, 1)])
def test_emulated_flash_within_band(BK, NS):
    q, kv, idx, sink, scale = _inputs(BK * 10 + NS)
    v_ref, v_32, out = _band_ratio(_emulate(q, kv, idx, sink, scale, BK, NS), q, kv, idx, sink, scale)
    assert v_ref <= 1.0 and v_32 <= 1.0, (v_ref, v_32)
    assert np.all(np.isfinite(out)) and np.all(out[-1, -1] == 0.0)


def test_band_is_not_vacuous():
    q, kv, idx, sink, scale = _inputs(7, empty_row=False)
    v_ref, _, _ = _band_ratio(_emulate(q, kv, idx, sink, scale, 8, 2, rescale=False), q, kv, idx, sink, scale)
    assert v_ref > 1.0, v_ref                                # forgetting the alpha rescale breaks it
    v_ref, _, _ = _band_ratio(_emulate(q, kv, idx, sink, scale * 1.01, 8, 2), q, kv, idx, sink, scale)
    assert v_ref > 1.0, v_ref                                # so does a 1 % wrong scale


def test_combine_of_one_split_is_the_final_formula_and_empty_splits_vanish():
    q, kv, idx, sink, scale = _inputs(3)
    idx = idx.at[0, 0, :16].set(-1)                          # the first two blocks of row 0 empty
    a = np.asarray(_emulate(q, kv, idx, sink, scale, 8, 1))
    b = np.asarray(_emulate(q, kv, idx, sink, scale, 8, 5))  # splits of 1 block: some hold no valid entry
    np.testing.assert_allclose(a, b, rtol=0, atol=float(np.abs(a).max()) * 2 ** -7)


def test_flash_plan():
    cfg32, cfg64 = sat.NAMED_CONFIGS["flash_bk32"], sat.NAMED_CONFIGS["flash_bk64"]
    for cfg in (cfg32, cfg64):
        nb = -(-640 // cfg.BK)
        for rows in (1, 2, 8, 16, 32, 64, 128, 192, 1024):
            ns, bps = sat.flash_plan(cfg, rows, 640)
            assert 1 <= ns <= nb and ns * bps >= nb and (ns - 1) * bps < nb   # covers K, no empty split
        assert sat.flash_plan(cfg, 1, 640)[0] >= 10            # one row is spread over >= 10 SMs
        assert sat.flash_plan(cfg, 128, 640) == (1, nb)         # a full wave of rows: no split
    assert sat.flash_plan(sat.NAMED_CONFIGS["flash_bk32_ns2"], 192, 640) == (2, 10)
    assert sat.flash_plan(sat.NAMED_CONFIGS["flash_bk64_ns1"], 1, 640) == (1, 10)
    assert sat.flash_plan(cfg32, 1, 20) == (1, 1)               # K shorter than one block


def test_flash_head_split_plan_and_grid():
    """Head split (HS): 4 groups of 16 at H = 64, capped at H // 16 groups; the planner counts rows * NS * HS
    programs; the launch grid gets the third axis (the final-output kernel too: (rows, 1, HS))."""
    c64, c32 = sat.NAMED_CONFIGS["flash_bk64_hs4"], sat.NAMED_CONFIGS["flash_bk32_hs4"]
    assert [sat.flash_heads(c64, h) for h in (16, 32, 64, 128)] == [1, 2, 4, 4]
    assert sat.flash_heads(sat.NAMED_CONFIGS["flash_bk64"], 64) == 1
    for cfg in (c64, c32):
        nb = -(-640 // cfg.BK)
        for rows in (1, 2, 8, 16, 32, 64, 128):
            ns, bps = sat.flash_plan(cfg, rows, 640, 4)
            assert 1 <= ns <= nb and ns * bps >= nb and (ns - 1) * bps < nb
        assert sat.flash_plan(cfg, 1, 640, 4) == (nb, 1)                # one row: a block per program, 4 x nb programs
        assert sat.flash_plan(cfg, 32, 640, 4) == (1, nb)               # 32 rows x 4 groups fill a wave: no combine
    ka = dict(S=1, N=4096, H=64, D=512, K=640, SCALE=0.1, BK=64, DC=64, IEEE=0)
    ns, grid, kw = sat.flash_launch(c64, 1, 64, 512, 640, ka, 1)
    assert (ns, grid, kw["HG"], kw["NS"]) == (10, (1, 10, 4), 16, 10)
    ns, grid, kw = sat.flash_launch(c64, 32, 64, 512, 640, ka, 1)
    assert (ns, grid, kw["HG"], "NS" in kw) == (1, (32, 1, 4), 16, False)
    ns, grid, kw = sat.flash_launch(sat.NAMED_CONFIGS["flash_bk64"], 1, 64, 512, 640, ka, 1)
    assert (ns, grid, kw["HG"]) == (10, (1, 10), 64)                    # no head split: grid and plan as before
