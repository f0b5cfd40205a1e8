"""The paged sparse attention kernel (``sparse_attention_paged_triton``) on the GPU: inside the flash error band of
the model's path (``sparse_sink_attention_paged_reference``), and bit-equal to the v3 flash kernel on the
materialised buffer with the same padded ids (the same blocks and MMAs on the same bf16 values: the pool decoding is
exact). Written 2026-12-06, checked in Triton's interpreter (scripts/triton_interpret_sparse_attention_paged.py);
passed on one H200 the same day (3 of 3, bits equal, max |err| / band 0.27-0.56:
benchmarks/results/gpu_tests_20261206_h200_s15_sparse_attention_paged.log)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dsflash.kernels import sparse_attention as sa  # noqa: E402
from dsflash.model import state as st  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [  # B, S, H, D, NW, KW, K (picks), P (pool rows)
    (2, 3, 16, 64, 20, 12, 24, 100),
    (1, 6, 64, 512, 134, 128, 512, 3000),     # V4.1 decode row set: 1 + 5 drafts, 128 window ids, 512 picks
    (32, 6, 64, 512, 134, 128, 512, 20000),   # the 32 x 6 step's shape
]


def _inputs(case, seed):
    B, S, H, D, NW, KW, K, P = case
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
    win = jax.random.normal(ks[1], (B, NW, D), jnp.float32).astype(jnp.bfloat16)
    rows = jax.random.normal(ks[2], (P, D), jnp.float32)
    rows = jnp.where(jax.random.uniform(ks[3], (P, 1)) < 0.25, rows * 1e-3, rows * 2.0)   # subnormal scales too
    pool = st.encode_main_kv(rows, "reference")
    win_idx = jax.random.randint(ks[4], (B, S, KW), 0, NW, jnp.int32)
    win_idx = jnp.where(jax.random.uniform(ks[5], (B, S, KW)) < 0.2, -1, win_idx)
    addr = jax.random.randint(ks[6], (B, S, K), 0, P, jnp.int32)
    valid = jax.random.uniform(ks[7], (B, S, K)) >= 0.2
    win_idx = win_idx.at[B - 1, S - 1].set(-1)
    valid = valid.at[B - 1, S - 1].set(False)
    sink = jax.random.normal(ks[8], (H,), jnp.float32)
    return q, win, win_idx, pool, addr, valid, sink, D ** -0.5


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_paged_kernel_matches_flash_bits_and_the_reference_band(case):
    from dsflash.kernels import sparse_attention_paged_triton as spt, sparse_attention_triton as sat
    q, win, win_idx, pool, addr, valid, sink, scale = _inputs(case, 0)
    B, S, H, D, NW, KW, K, P = case
    cfg = sat.pick_config(B * S)
    cfg = cfg if cfg.kind == "flash" else sat.NAMED_CONFIGS["flash_bk32"]
    out = np.asarray(jax.jit(lambda *a: spt.sparse_sink_attention_paged_triton(
        *a, scale, out_dtype=jnp.float32, config=cfg))(q, win, win_idx, pool["q"], pool["s"], addr, valid, sink))
    kv, idx = sa.paged_buffer(win, spt.pad_window_ids(win_idx, cfg.BK), pool, addr, valid, st.decode_main_kv)
    flash = np.asarray(jax.jit(lambda *a: sat.sparse_sink_attention_triton(
        *a, scale, out_dtype=jnp.float32, config=cfg))(q, kv, idx, sink))
    ref = np.asarray(sa.sparse_sink_attention_paged_reference(
        q, win, win_idx, pool, addr, valid, sink, scale, decode=st.decode_main_kv, out_dtype=jnp.float32,
        backend="xla"))
    A = np.asarray(sat.flash_weights_abs(q, kv, idx, sink, scale))
    band = (np.abs(out - ref) / sat.flash_bound(A, ref, 2)).max()
    print(f"{case}: max |err| / band {band:.3f}, bits == flash {np.array_equal(out, flash)}")
    assert np.all(np.isfinite(out)) and band <= 1.0, band
    assert np.abs(out[B - 1, S - 1]).max() == 0.0
    np.testing.assert_array_equal(out, flash)
