"""Triton sparse sink attention vs ``sparse_sink_attention_reference`` on the GPU (fresh random inputs).

Every named variant of sparse_attention_triton (fused DV 128/256/512, split chunks 64/128/auto) over the shape
sweep below, incl. the split path at one row. Written 2026-11-30 and checked in Triton's interpreter (scripts/triton_interpret_sparse_attention.py); not yet run
on a GPU. Tolerance: same function and roundings; exp() and fp32 summation order differ from XLA's, which can flip a
rare bf16 rounding of P: ||out - ref|| / ||ref|| < 2e-3 with fp32 outputs, no NaN, rows without entries exactly 0."""
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dsflash.kernels import sparse_attention as sa  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [  # B, S, H, D, N, K
    (2, 3, 16, 64, 50, 40),
    (3, 1, 64, 512, 700, 640),      # V4.1 decode: 64 heads x 512, 128 window + 512 compressed
    (2, 6, 64, 512, 2000, 640),     # 1 + 5 draft rows
    (1, 4, 32, 256, 300, 100),
]


def _inputs(case, seed):
    B, S, H, D, N, K = case
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
    kv = jax.random.normal(ks[1], (B, N, D), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(ks[2], (B, S, K), 0, N, jnp.int32)
    idx = jnp.where(jax.random.uniform(ks[3], (B, S, K)) < 0.2, -1, idx)
    if B * S > 1:
        idx = idx.at[B - 1, S - 1].set(-1)
    sink = jax.random.normal(ks[4], (H,), jnp.float32)
    return q, kv, idx, sink, D ** -0.5


VARIANTS = ["fused_dv128", "fused_dv256", "fused_dv256_bk32", "fused_dv512", "fused_dv512_bk32", "split_ch128_dv128",
            "split_ch64_dv128", "split_ch128_dv512", "split_auto_dv256", None]   # None = PICK_TABLE's choice


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v or "picked")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}S{}H{}D{}N{}K{}".format(*c))
@pytest.mark.parametrize("precision", ["reference", "fp32"])
def test_matches_reference(case, precision, variant):
    from dsflash.kernels import sparse_attention_triton as sat
    if precision == "fp32" and case[3] == 512 and variant != "fused_dv128":
        pytest.skip("fp32 operands at D=512 exceed the 227 KB smem in the v2 configs (H200 2026-11-30); the model "
                    "runs bf16 KV, fp32 at D=512 stays covered by fused_dv128 and all variants at D<=256")
    q, kv, idx, sink, scale = _inputs(case, zlib.crc32(repr((case, precision)).encode()))
    if precision == "fp32":
        q, kv = q.astype(jnp.float32), kv.astype(jnp.float32)
    ref = np.asarray(sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=jnp.float32,
                                                        precision=precision))
    out = np.asarray(jax.jit(lambda *a: sat.sparse_sink_attention_triton(*a, scale, out_dtype=jnp.float32,
                                                                        precision=precision, config=variant))(
        q, kv, idx, sink))
    assert np.all(np.isfinite(out))
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    print(f"{case} {precision}: rel err {err:.2e}")
    assert err < 2e-3, err
    B, S = case[:2]
    if B * S > 1:
        assert np.all(out[B - 1, S - 1] == 0.0)


def test_backend_dispatch_bf16_output():
    q, kv, idx, sink, scale = _inputs(CASES[1], 5)
    a = jax.jit(lambda *x: sa.sparse_sink_attention(*x, scale, backend="triton", force=True))(q, kv, idx, sink)
    b = sa.sparse_sink_attention(q, kv, idx, sink, scale, backend="xla")
    assert a.dtype == jnp.bfloat16 and a.shape == b.shape
    a32, b32 = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    assert np.all(np.isfinite(a32))
    assert float(np.linalg.norm(a32 - b32) / np.linalg.norm(b32)) < 5e-3
