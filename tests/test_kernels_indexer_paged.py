"""The paged indexer scorer's contract on CPU: its reference input (``indexer_topk.paged_keys``) is exactly the
model's own gather + decode of the index-key pool, and the Triton kernel matches the reference in Triton's
interpreter (``scripts/triton_interpret_indexer_paged.py``: bit-identical on dyadic inputs, 1 bf16 ulp on
continuous ones; MXFP4 and plain pools, shuffled page tables, unused pages, padding rows, padded heads)."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.kernels import indexer_topk as ik
from dsflash.kernels.indexer_topk_shapes import paged_supports
from dsflash.model import state as st
from dsflash.model.attention import gather_pool, pool_addresses

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("precision", ["reference", "bf16"])
def test_paged_keys_is_the_models_gather(precision):
    B, P, per_page, Di = 3, 5, 8, 64
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    pool = st.encode_index_k(jax.random.normal(ks[0], (B * P * per_page + 8, Di), jnp.float32), precision)
    pt = jax.random.permutation(ks[1], B * P + 1)[: B * P].reshape(B, P).astype(jnp.int32)
    entries = jnp.broadcast_to(jnp.arange(P * per_page, dtype=jnp.int32)[None], (B, P * per_page))
    want = gather_pool(pool, pool_addresses(pt, entries, per_page), st.decode_index_k, jnp.bfloat16)
    got = ik.paged_keys(pool, pt, per_page, jnp.bfloat16)
    assert got.shape == (B, P * per_page, Di) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert set(pool) == ({"q", "s"} if precision == "reference" else {"x"})


def test_paged_supports():
    q = jnp.zeros((1, 6, 32, 128), jnp.bfloat16)
    mx = {"q": jnp.zeros((9, 64), jnp.uint8), "s": jnp.zeros((9, 4), jnp.uint8)}
    assert paged_supports(q, mx) and paged_supports(q, {"x": jnp.zeros((9, 128), jnp.bfloat16)})
    assert not paged_supports(q.astype(jnp.float32), mx)                       # fp32 runs: the gather path
    assert not paged_supports(jnp.zeros((1, 6, 24, 128), jnp.bfloat16), mx)   # heads not a power of two
    assert not paged_supports(q, {"q": mx["q"][:, :32], "s": mx["s"]})        # layout does not match Di


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_interpreter_script(interpreter_script):
    interpreter_script("triton_interpret_indexer_paged.py")


def test_paged_stages_reach_the_launch(monkeypatch):
    """``indexer_paged_triton.NUM_STAGES`` is the launch's num_stages (2 by default; 3 is the opt-in row prefetch
    one row further ahead), recorded through a stand-in for jax-triton at V4.1's decode shape."""
    pytest.importorskip("triton")
    import sys
    from dsflash.kernels import indexer_paged_triton as ipt
    calls = []

    class Rec:
        def triton_call(self, *args, kernel, out_shape, grid, num_warps, num_stages, **kw):
            calls.append(dict(grid=grid, num_warps=num_warps, num_stages=num_stages, **kw))
            return jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype)

    monkeypatch.setitem(sys.modules, "jax_triton", Rec())
    B, S, P, per_page = 2, 6, 4, 64
    sd = jax.ShapeDtypeStruct
    pool = {"q": sd((B * P * per_page, 64), jnp.uint8), "s": sd((B * P * per_page, 4), jnp.uint8)}
    args = (sd((B, S, 32, 128), jnp.bfloat16), sd((B, S, 32), jnp.bfloat16), sd((B, P), jnp.int32),
            sd((B, S), jnp.int32), sd((B, S), bool))

    def run():
        jax.eval_shape(lambda q, w, pt, vis, val, pl: ipt.indexer_scores_paged_triton(q, w, pl, pt, per_page, vis,
                                                                                      val), *args, pool)
    run()
    monkeypatch.setattr(ipt, "NUM_STAGES", 3)
    run()
    assert [c["num_stages"] for c in calls] == [2, 3]
    assert all(c["SB"] == 6 and c["BT"] == 128 and c["num_warps"] == 4 and c["grid"] == (B, 2) for c in calls)
