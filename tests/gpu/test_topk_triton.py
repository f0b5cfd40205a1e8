"""The Triton radix top-k (kernels/topk_triton.py) on the GPU: the same bits as the lax.top_k references on the fuzz
rows of tests/test_topk_select.py (ties, +-NaN, +-0.0, +-inf, -inf masks, visible limits, T < topk, partial tiles),
at the indexer's real shape (32 x 6 rows x 131,072 entries, top-512; the candidate filter's 16,384 blocks), with
32-bit keys and, on bf16-valued rows, 16-bit keys; and through the front end with its gate open."""
import os
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_topk_select import _batch  # noqa: E402

from dsflash.kernels import dispatch, indexer_topk as ik  # noqa: E402

pytestmark = pytest.mark.gpu


def _eq(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("T,topk,bits,kinds", [
    (1, 1, 32, ("ties", "bf16", "normal")), (37, 8, 32, ("ties", "bf16", "normal")),
    (300, 40, 32, ("ties", "bf16", "normal")), (3000, 512, 32, ("ties",)),
    (5000, 512, 32, ("ties", "bf16", "normal")), (5000, 512, 16, ("bf16",)), (16384, 2048, 16, ("bf16", "ties"))])
def test_select_and_mask_match_lax_top_k(T, topk, bits, kinds):
    from dsflash.kernels import topk_select as ts, topk_triton as tt
    score, visible = _batch(T + bits, T, B=8, S=3, kinds=kinds)
    k = min(topk, T)
    _eq(jax.jit(lambda s, v: tt.select_topk_triton(s, v, topk, key_bits=bits))(score, visible),
        jax.jit(lambda s, v: ik.select_topk_sorted(s, v, topk))(score, visible))
    _eq(jax.jit(lambda s: tt.topk_mask_triton(s, k, key_bits=bits))(score), jax.jit(lambda s: ts.topk_mask(s, k))(score))


@pytest.mark.parametrize("T,topk,bits,kinds", [
    (3000, 512, 32, ("ties",)), (20000, 512, 32, ("ties", "bf16", "normal")), (20000, 512, 16, ("bf16", "ties"))])
def test_split_rows_match_lax_top_k(T, topk, bits, kinds):
    from dsflash.kernels import topk_select as ts, topk_split_triton as tst
    score, visible = _batch(T + bits + 1, T, B=4, S=3, kinds=kinds)
    _eq(jax.jit(lambda s, v: tst.select_topk_split(s, v, topk, key_bits=bits, chunk=1024))(score, visible),
        jax.jit(lambda s, v: ik.select_topk_sorted(s, v, topk))(score, visible))
    _eq(jax.jit(lambda s: tst.topk_mask_split(s, min(topk, T), key_bits=bits, chunk=1024))(score),
        jax.jit(lambda s: ts.topk_mask(s, min(topk, T)))(score))


@pytest.mark.parametrize("bits,split", [(32, False), (16, False), (16, True)])
def test_real_shape(bits, split):
    from dsflash.kernels import topk_split_triton as tst, topk_triton as tt
    select, cand = ((tst.select_topk_split, tst.candidate_mask_split) if split else
                    (tt.select_topk_triton, tt.candidate_mask_triton))
    B, S, T = 32, 6, 131072
    score = jax.random.normal(jax.random.PRNGKey(bits), (B, S, T)).astype(jnp.bfloat16).astype(jnp.float32)
    visible = jnp.full((B, S), T, jnp.int32).at[:, -1].set(T // 3)
    score = jnp.where(jnp.arange(T)[None, None] < visible[..., None], score, -jnp.inf)
    _eq(jax.jit(lambda s, v: select(s, v, 512, key_bits=bits))(score, visible),
        jax.jit(lambda s, v: ik.select_topk_sorted(s, v, 512))(score, visible))
    _eq(jax.jit(lambda s, v: cand(s, v, 8, 2048, key_bits=bits))(score, visible),
        jax.jit(lambda s, v: ik.candidate_mask_sorted(s, v, 8, 2048))(score, visible))


def test_front_end_with_the_gate_open(monkeypatch):
    monkeypatch.setitem(dispatch.GATES, "topk", dispatch.GATES["topk"].replace(triton=((1, None),)))
    score, visible = _batch(7, 4096, B=4, S=6, kinds=("bf16",))
    _eq(jax.jit(lambda s, v: ik.select_topk(s, v, 512, backend="triton", bf16_scores=True))(score, visible),
        jax.jit(lambda s, v: ik.select_topk_sorted(s, v, 512))(score, visible))


@pytest.mark.parametrize("T,topk,bits", [(300, 40, 32), (5000, 512, 32), (16384, 512, 16)])
def test_masked_rows_read_to_visible(T, topk, bits):
    """``masked=True`` (each row read up to max(visible, k); session 22) on scorer-like rows -- -inf at t >= visible,
    visible across [0, T], a causal-prefill sequence, rows just below / above k -- the same bits as the reference."""
    from dsflash.kernels import topk_triton as tt
    score, visible = _batch(T + bits + 2, T, B=6, S=4, kinds=("bf16", "ties"))
    visible = visible.at[1].set(jnp.array([topk - 1, topk, topk + 1, T]).clip(0, T).astype(jnp.int32))
    visible = visible.at[2].set(jnp.arange(4, dtype=jnp.int32) * (T // 4) + 1)
    score = jnp.where(jnp.arange(T)[None, None] < visible[..., None], score, -jnp.inf)
    _eq(jax.jit(lambda s, v: tt.select_topk_triton(s, v, topk, key_bits=bits, masked=True))(score, visible),
        jax.jit(lambda s, v: ik.select_topk_sorted(s, v, topk))(score, visible))
