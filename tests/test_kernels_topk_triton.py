"""The Triton radix top-k (kernels/topk_triton.py) on CPU: bit-identical to the lax.top_k references in Triton's
interpreter (scripts/triton_interpret_topk.py --only one: fuzz rows with ties, +-NaN, +-0.0, +-inf, -inf masks, visible limits,
T < topk, partial 4K tiles, 32- and 16-bit keys), its argument checks, and the front end's choice of key width
(16-bit keys only for bf16-valued scores, i.e. bf16 index queries)."""
import importlib.util
import sys
import types

import jax.numpy as jnp
import pytest

import dsflash.kernels
from dsflash.kernels import dispatch, indexer_topk as ik

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_interpreter_script(interpreter_script):
    """The one-program-a-row kernel (the split launcher's checks hit the interpreter flake too often for the
    default suite: tests/test_kernels_interpret.py runs them, opt-in)."""
    interpreter_script("triton_interpret_topk.py", "--only", "one")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_kernel_args_reject_bad_settings():
    from dsflash.kernels import topk_triton as tt
    s = jnp.zeros((2, 3, 100), jnp.float32)
    with pytest.raises(ValueError, match="key_bits"):
        tt.kernel_args(s, 8, key_bits=24)
    with pytest.raises(ValueError, match="k must be"):
        tt.kernel_args(s, 101)
    rows, const, grid, _ = tt.kernel_args(s, 8, key_bits=16)
    assert rows.shape == (6, 100) and grid == (6,) and const["PASSES"] == 2 and const["BLOCK"] == 128
    assert const["VIS_BOUND"] == 0 and tt.kernel_args(s, 8, masked=True)[1]["VIS_BOUND"] == 1
    with pytest.raises(ValueError, match="mask mode"):
        tt.kernel_args(s, 8, mode=1, masked=True)


@pytest.fixture
def fake_topk(monkeypatch):
    """A GPU pretended, the "topk" gate open, and a fake topk_triton recording the key width it is asked for."""
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "jax_triton_importable", lambda: True)
    monkeypatch.setitem(dispatch.GATES, "topk", dispatch.GATES["topk"].replace(triton=((1, None),)))
    seen = []
    mod = types.ModuleType("dsflash.kernels.topk_triton")

    def select(score, visible, topk, *, key_bits=32, masked=False):
        seen.append(("select", key_bits, masked))
        return ik.select_topk_sorted(score, visible, topk)

    def cand(score, visible, block_size, topk_blocks, *, key_bits=32):
        seen.append(("cand", key_bits))
        return ik.candidate_mask_sorted(score, visible, block_size, topk_blocks)

    mod.select_topk_triton, mod.candidate_mask_triton = select, cand
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(dsflash.kernels, "topk_triton", mod, raising=False)
    dispatch._auto_backend.cache_clear()
    yield seen
    dispatch._auto_backend.cache_clear()


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 16), (jnp.float32, 32)])
def test_key_width_follows_the_query_dtype(fake_topk, dtype, bits):
    B, S, Hi, Di, T = 1, 2, 4, 32, 64
    q = jnp.ones((B, S, Hi, Di), dtype)
    w = jnp.ones((B, S, Hi), dtype)
    k = jnp.ones((B, T, Di), dtype)
    vis = jnp.full((B, S), T, jnp.int32)
    valid = jnp.ones((B, S), bool)
    ik.indexer_topk(q, w, k, vis, valid, topk=8, cand_filter=(4, 2), backend="xla")
    assert fake_topk == []                                      # "xla": never the kernel
    ik.indexer_topk(q, w, k, vis, valid, topk=8, cand_filter=(4, 2), backend="auto")
    assert sorted(fake_topk) == [("cand", bits), ("select", bits, True)]     # the scorers' -inf past visible
