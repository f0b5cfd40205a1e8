"""The Gluon prefill flash kernel (``kernels/sparse_attention_gluon.py``) against the sparse-attention
reference on the GPU, both of its schedules (OVERLAP 0 / 1), and the channel-split warp-specialised one
(``sparse_attention_gluon_ws``): within ``flash_bound``'s band (P rounded to bf16 against
the running max, as the Triton flash kernel) plus the bf16 output's own rounding, rows with no entry exactly 0, and an
empty slot never read as a value (kv row 0, where empty slots gather from, is a large constant no valid id points to)."""
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytest.importorskip("triton.experimental.gluon")
from dsflash.kernels import sparse_attention as sa  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [  # B, S, H, D, N, K
    (3, 1, 64, 512, 700, 640),       # V4.1 decode rows
    (2, 6, 64, 512, 2000, 640),      # 1 + 5 draft rows
    (1, 200, 64, 512, 1500, 640),    # prefill rows
    (2, 5, 64, 512, 900, 600),       # K not a multiple of the 64-entry block
    (1, 3, 64, 512, 300, 40),        # one partial block
]


def _inputs(case, seed):
    B, S, H, D, N, K = case
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
    kv = jax.random.normal(ks[1], (B, N, D), jnp.float32).astype(jnp.bfloat16)
    kv = kv.at[:, 0].set(8.0)                                       # never a valid entry: ids in [1, N)
    idx = jax.random.randint(ks[2], (B, S, K), 1, N, jnp.int32)
    idx = jnp.where(jax.random.uniform(ks[3], (B, S, K)) < 0.2, -1, idx)
    idx = idx.at[B - 1, S - 1].set(-1)                             # a row with no entry
    sink = jax.random.normal(ks[4], (H,), jnp.float32)
    return q, kv, idx, sink, D ** -0.5


def _kernel(variant):
    """The launcher of each Gluon flash kernel: the two schedules of ``sparse_attention_gluon`` and the channel-split
    ``sparse_attention_gluon_ws``."""
    if variant == "ws":
        from dsflash.kernels.experimental import sparse_attention_gluon_ws as ws
        return ws.flash_prefill_gluon_ws
    from dsflash.kernels import sparse_attention_gluon as sag
    return lambda *a: sag.flash_prefill_gluon(*a, overlap=int(variant[-1]))


@pytest.mark.parametrize("variant", ["ov0", "ov1", "ws"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}S{}H{}D{}N{}K{}".format(*c))
def test_gluon_flash_within_error_band(case, variant):
    from dsflash.kernels import sparse_attention_triton as sat
    q, kv, idx, sink, scale = _inputs(case, zlib.crc32(repr(("gluon", case)).encode()))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=jnp.float32,
                                                            precision="reference"))
    A = np.asarray(sat.flash_weights_abs(q, kv, idx, sink, scale))
    launch = _kernel(variant)
    f = jax.jit(lambda *a: launch(*a, scale))
    poison = np.asarray(f(jnp.full_like(q, jnp.nan), kv, idx, sink).astype(jnp.float32))
    has_entry = np.asarray((idx >= 0).any(-1))
    assert np.isnan(poison[has_entry]).all()          # every written element depends on q (no stale buffer)
    out = np.asarray(f(q, kv, idx, sink).astype(jnp.float32))
    assert np.all(np.isfinite(out))
    tol = sat.flash_bound(A, ref, 2) + 2.0 ** -8 * np.abs(ref)      # + the bf16 output's rounding
    v = float((np.abs(out - ref) / tol).max())
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    print(f"gluon {variant} {case}: rel err {err:.2e}, max |err|/band {v:.3f}")
    assert v <= 1.0, v
    assert err < 5e-3, err
    B, S = case[:2]
    assert np.all(out[B - 1, S - 1] == 0.0)


def test_bad_shapes_are_a_value_error():
    from dsflash.kernels import sparse_attention_gluon as sag
    q, kv, idx, sink, scale = _inputs((1, 2, 64, 512, 100, 64), 0)
    with pytest.raises(ValueError, match="64, 512"):
        sag.flash_prefill_gluon(q[:, :, :32], kv, idx, sink[:32], scale)
    with pytest.raises(ValueError, match="bf16"):
        sag.flash_prefill_gluon(q.astype(jnp.float32), kv, idx, sink, scale)
