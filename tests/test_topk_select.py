"""kernels/topk_select.py: the sort-free top-k gives the same bits as the lax.top_k references in indexer_topk for
every kind of input (ties, -inf, NaN of both signs, -0.0 / +0.0, T < topk, visible limits, all-masked rows)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.kernels import dispatch
from dsflash.kernels import indexer_topk as ik
from dsflash.kernels import topk_select as ts

NAN = np.float32("nan")
SPECIALS = np.array([np.inf, -np.inf, NAN, -NAN, 0.0, -0.0, 1.0, -1.0], np.float32)


def _row_block(rng, S, T, kind):
    """[S, T] fp32 of one flavour, with -inf masks and specials sprinkled in (sometimes an all-masked row)."""
    if kind == "ties":
        x = rng.integers(-2, 3, (S, T)).astype(np.float32)
    elif kind == "bf16":
        x = np.asarray(jnp.asarray(rng.standard_normal((S, T)), jnp.bfloat16).astype(jnp.float32))
    else:
        x = rng.standard_normal((S, T)).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4)
    x = np.where(rng.random((S, T)) < rng.choice([0.0, 0.3, 0.9]), -np.inf, x).astype(np.float32)
    if kind != "bf16" or rng.random() < 0.5:
        spec = rng.random((S, T)) < rng.choice([0.0, 0.1, 0.5])
        x = np.where(spec, rng.choice(SPECIALS, (S, T)), x).astype(np.float32)
    if rng.random() < 0.3:
        x[rng.integers(S)] = -np.inf
    return x


def _batch(seed, T, B=12, S=3, kinds=("ties", "bf16", "normal")):
    """B independent random [S, T] cases stacked (one compile covers them all), visible in [0, T]."""
    rng = np.random.default_rng(seed)
    score = np.stack([_row_block(rng, S, T, kinds[b % len(kinds)]) for b in range(B)])
    visible = rng.integers(0, T + 1, (B, S)).astype(np.int32)
    visible[0] = T
    return jnp.asarray(score), jnp.asarray(visible)


def _bits_equal(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.dtype == b.dtype and a.shape == b.shape


def _jit(fn, *static, **kw):
    return jax.jit(lambda s, v: fn(s, v, *static, **kw))


@pytest.mark.parametrize("T,topk", [(1, 1), (5, 8), (16, 3), (37, 8), (64, 64), (100, 7)])
def test_select_matches_lax_top_k(T, topk):
    score, visible = _batch(T * 131 + topk, T)
    _bits_equal(_jit(ts.select_topk_threshold, topk)(score, visible),
                _jit(ik.select_topk_sorted, topk)(score, visible))


def test_select_16_bit_keys_on_bf16_scores():
    """key_bits=16 (the caller's opt-in) is exact when every score is bf16-valued."""
    score, visible = _batch(11, 50, kinds=("bf16",))
    _bits_equal(_jit(ts.select_topk_threshold, 9, key_bits=16)(score, visible),
                _jit(ik.select_topk_sorted, 9)(score, visible))


@pytest.mark.parametrize("T,block,topb", [(5, 1, 2), (37, 3, 4), (64, 8, 2), (100, 2, 40)])
def test_candidate_mask_matches_lax_top_k(T, block, topb):
    score, visible = _batch(T * 7 + block, T)
    _bits_equal(_jit(ts.candidate_mask_threshold, block, topb)(score, visible),
                _jit(ik.candidate_mask_sorted, block, topb)(score, visible))


@pytest.mark.parametrize("digit_bits,counts", [(4, "stacked"), (8, "stacked"), (4, "sibling")])
def test_search_variants_agree(digit_bits, counts):
    score, visible = _batch(digit_bits, 30, B=6)
    _bits_equal(_jit(ts.select_topk_threshold, 8, digit_bits=digit_bits, counts=counts)(score, visible),
                _jit(ik.select_topk_sorted, 8)(score, visible))


def test_long_row_heavy_ties():
    """One longer row set (T 3000, k 512): thousands of equal keys straddle the threshold."""
    rng = np.random.default_rng(3)
    score = jnp.asarray(rng.integers(0, 4, (2, 3, 3000)).astype(np.float32))
    visible = jnp.asarray([[3000, 2999, 1], [0, 1500, 3000]], jnp.int32)
    _bits_equal(_jit(ts.select_topk_threshold, 512)(score, visible), _jit(ik.select_topk_sorted, 512)(score, visible))
    _bits_equal(_jit(ts.candidate_mask_threshold, 8, 64)(score, visible),
                _jit(ik.candidate_mask_sorted, 8, 64)(score, visible))


def test_lax_top_k_order_is_total():
    """The order the keys reproduce (CPU): +0.0 above -0.0, +NaN above +inf, -NaN below -inf, ties lowest index."""
    x = jnp.asarray([-0.0, 0.0, -NAN, -np.inf, NAN, np.inf, 0.0], jnp.float32)
    _, idx = jax.lax.top_k(x, 7)
    assert list(np.asarray(idx)) == [4, 5, 1, 6, 0, 3, 2]
    keys = np.asarray(ts.total_order_key(x))
    assert list(np.argsort(-keys.astype(np.int64), kind="stable")) == [4, 5, 1, 6, 0, 3, 2]


@pytest.mark.parametrize("topk", [1, 2, 3, 4])
def test_specials_at_the_boundary(topk):
    """Hand-made rows where -0.0 vs +0.0, +NaN vs -NaN and +-inf decide what is picked (the fuzz may miss them)."""
    rows = [[-0.0, 0.0, -0.0, 0.0, 1.0, -1.0], [0.0, -0.0, 0.0, -0.0, -1.0, -2.0],
            [-NAN, -np.inf, -1.0, -NAN, -np.inf, -0.0], [NAN, -NAN, np.inf, NAN, -np.inf, 0.0],
            [-np.inf] * 6, [np.inf, -np.inf, np.inf, -0.0, NAN, 0.0]]
    score = jnp.asarray(np.array(rows, np.float32)[None])
    visible = jnp.asarray([[6, 6, 6, 6, 6, 3]], jnp.int32)
    _bits_equal(_jit(ts.select_topk_threshold, topk)(score, visible), _jit(ik.select_topk_sorted, topk)(score, visible))
    _bits_equal(_jit(ts.candidate_mask_threshold, 1, topk)(score, visible),
                _jit(ik.candidate_mask_sorted, 1, topk)(score, visible))


def test_kth_largest_key_is_the_kth():
    rng = np.random.default_rng(0)
    key = rng.integers(0, 2 ** 32, (4, 50), dtype=np.uint64).astype(np.uint32)
    key[:, :10] = key[:, :1]   # ties
    for k in (1, 10, 11, 50):
        got = np.asarray(ts.kth_largest_key(jnp.asarray(key), k))
        np.testing.assert_array_equal(got, -np.sort(-key.astype(np.int64), axis=-1)[:, k - 1])


def test_gate_routes_through_dispatch(monkeypatch):
    """select_topk / candidate_mask take the threshold path where dispatch says, the reference elsewhere."""
    calls = []
    for name in ("select_topk_threshold", "candidate_mask_threshold"):
        real = getattr(ts, name)
        monkeypatch.setattr(ts, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    score, visible = _batch(5, 20, B=2)
    ref = _jit(ik.select_topk_sorted, 4)(score, visible), _jit(ik.candidate_mask_sorted, 2, 3)(score, visible)
    _bits_equal(_jit(ik.select_topk, 4)(score, visible), ref[0])
    assert calls == []                      # 20 entries: below the gate on any platform
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setitem(dispatch.GATES, "topk_select", dispatch.GATES["topk_select"].replace(triton=((1, None),)))
    _bits_equal(_jit(ik.select_topk, 4)(score, visible), ref[0])
    _bits_equal(_jit(ik.candidate_mask, 2, 3)(score, visible), ref[1])
    assert calls == ["select_topk_threshold", "candidate_mask_threshold"]
    monkeypatch.setitem(dispatch.GATES, "topk_select", dispatch.GATES["topk_select"].replace(triton=()))
    calls.clear()
    _bits_equal(_jit(ik.select_topk, 4)(score, visible), ref[0])
    assert calls == []                      # an empty range: lax.top_k even on a "GPU"
