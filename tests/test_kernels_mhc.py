"""Fused mHC: the reference vs the model's pieces (coefficients / collapse / expand), dispatch, shape errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.config import preset
from dsflash.kernels import mhc_fused as mf, mhc_fused_plan
from dsflash.model import mhc

CFG = preset("tiny")


def _inputs(lead=(2, 3), seed=0):
    n, d = CFG.hc_mult, CFG.hidden_size
    nc = 2 * n + n * n
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    X = jax.random.normal(ks[0], (*lead, n, d)).astype(jnp.bfloat16)
    a = jax.nn.sigmoid(jax.random.normal(ks[1], (*lead, n)))
    fn = jax.random.normal(ks[2], (nc, n * d)) * (n * d) ** -0.5
    base = jax.random.normal(ks[3], (nc,))
    scale = jnp.array([1.0, 0.5, 2.0], jnp.float32)
    y = jax.random.normal(ks[4], (*lead, d)).astype(jnp.bfloat16)
    return X, a, fn, base, scale, y


def _eq(x, y):
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), x, y)


@pytest.mark.parametrize("backend", ["xla", "triton"])   # triton on CPU = the reference
def test_fused_equals_model_pieces(backend):
    X, a, fn, base, scale, y = _inputs()
    prec = "reference"
    h, coef = mhc.pre_mix(X, a, fn, base, scale, CFG, prec, backend)
    _eq((h, coef), (mhc.collapse(X, a, prec), mhc.coefficients(X, fn, base, scale, CFG)))
    _, post, comb = coef
    X1, h1, coef1 = mhc.post_mix(y, X, post, comb, a, fn, base, scale, CFG, prec, backend)
    want_X1 = mhc.expand(y, X, post, comb, prec)
    _eq((X1, h1, coef1), (want_X1, mhc.collapse(want_X1, a, prec), mhc.coefficients(want_X1, fn, base, scale, CFG)))


def test_comb_is_doubly_stochastic():
    X, a, fn, base, scale, _ = _inputs()
    _, _, comb = mhc.coefficients(X, fn, base, scale, CFG)
    np.testing.assert_allclose(np.asarray(comb.sum(-1)), 1.0, atol=1e-2)  # tiny config: few Sinkhorn iterations
    np.testing.assert_allclose(np.asarray(comb.sum(-2)), 1.0, atol=1e-2)  # tiny config: few Sinkhorn iterations


def test_bad_backend_and_shapes():
    X, a, fn, base, scale, y = _inputs(lead=(5,))
    kw = dict(eps=1e-6, rms_eps=1e-20, iters=3, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="backend"):
        mf.mhc_fused(X, a, fn, base, scale, **kw, backend="cuda")
    for args in [(X[0], a, fn, base, scale), (X, a[:, :1], fn, base, scale), (X, a, fn[:, 1:], base, scale),
                 (X, a, fn, base[1:], scale), (X, a, fn, base, scale, (y[:, 1:], a, jnp.zeros((5, 4, 4))))]:
        with pytest.raises(ValueError):
            mf.mhc_fused(*args, **kw)


def test_model_routes_mhc_through_the_fused_ops(monkeypatch):
    """forward.py runs mHC as pre_mix / post_mix through ``mhc_fused`` with the run's own backend (the crossover
    table is applied inside, by kernels/dispatch.py: tests/test_kernels_dispatch.py); on CPU "triton" gives the XLA
    pieces' numbers (the kernel runs only on a GPU)."""
    import jax

    import dsflash
    m = dsflash.load("tiny")
    seen = []
    real = mf.mhc_fused

    def spy(*a, backend="auto", **k):
        seen.append(backend)
        return real(*a, backend=backend, **k)
    monkeypatch.setattr(mf, "mhc_fused", spy)
    tokens = np.arange(16, 48, dtype=np.int32)[None]
    want = m.logits(tokens, backend="xla")
    assert seen and set(seen) == {"xla"}
    jax.clear_caches()
    seen.clear()
    got = m.logits(tokens, backend="triton")
    assert seen and set(seen) == {"triton"}
    np.testing.assert_array_equal(got, want)


def test_collapse_and_expand_pin_fp32_products():
    """DEFAULT precision is TF32 on recent GPUs; the reference's contractions ask for HIGHEST (fp32)."""
    X, a, fn, base, scale, y = _inputs(lead=(3,))
    n = X.shape[-2]
    comb = jnp.ones((3, n, n)) / n
    for jaxpr in (jax.make_jaxpr(lambda *t: mf.collapse(*t, jnp.bfloat16))(X, a),
                  jax.make_jaxpr(lambda *t: mf.expand(*t, jnp.bfloat16))(y, X, a, comb)):
        dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        assert dots and all("HIGHEST" in str(e.params["precision"]) for e in dots), dots


# ------------------------------------------------------------------ Triton kernel plan (pure Python, see mhc_fused)
V41 = dict(n=4, d=5120)
TS = [1, 2, 7, 16, 17, 33, 64, 65, 100, 128, 129, 256, 257, 1000, 1024, 2048, 2049, 4096, 5000, 8192, 16384, 65536]


@pytest.mark.parametrize("n,d", [(4, 5120), (4, 128), (2, 64), (4, 256), (4, 384), (8, 4096), (1, 32)])
def test_plan_splits_d_into_bd_multiples(n, d):
    for T in TS:
        p = mf.kernel_plan(T, n, d)
        assert p["BD"] in mf.BD_CHOICES and d % p["BD"] == 0, (T, p)
        assert d % p["DS"] == 0 and (d // p["DS"]) % p["BD"] == 0, (T, p)     # every split = whole BD chunks
        assert p["BT"] * p["BD"] <= mf.TILE_CAP or p["BD"] == mf.BD_CHOICES[-1], (T, p)
        cap = mf.EPI_ROW_TILE_CAP if p["BTE"] == 1 else mf.EPI_TILE_CAP
        assert p["SB"] * p["BTE"] * p["NCP"] <= cap and p["SB"] <= mf._next_pow2(p["DS"]), (T, p)
        assert p["NCP"] >= 2 * n + n * n and p["programs"] == -(-T // p["BT"]) * p["DS"], (T, p)
        assert p["num_warps"] in (4, 8)
        mf.check_plan(p, n, d)


def test_plan_runs_kernel_b_per_token_below_epi_rows(monkeypatch):
    """``EPI_ROWS_BELOW`` (session 28; 512 by default since session 29's GPU run): below it kernel B takes one token
    a program and every partial in one step (V4.1 at 6 tokens: DS 160 -> SB 256); from it, or with it 0, the
    16-token blocks walking the partials in steps of 8."""
    monkeypatch.setattr(mhc_fused_plan, "EPI_ROWS_BELOW", 0)
    p = mf.kernel_plan(6, **V41)
    assert (p["BTE"], p["SB"]) == (16, 8), p                                  # switched off: the token blocks
    monkeypatch.undo()
    assert mhc_fused_plan.EPI_ROWS_BELOW == 512                               # the default
    for T in (1, 6, 48, 192, 511):
        p = mf.kernel_plan(T, **V41)
        assert p["BTE"] == 1 and p["SB"] >= p["DS"] and p["SB"] * p["NCP"] <= mf.EPI_ROW_TILE_CAP, (T, p)
        mf.check_plan(p, **V41)
    assert mf.kernel_plan(6, **V41)["SB"] == 256
    assert mf.kernel_plan(512, **V41)["BTE"] == 16


def test_plan_fills_the_gpu_at_small_T():
    """The old kernel ran <= 16 programs at <= 256 tokens (the measured latency floor): every V4.1 size now puts at
    least one kernel-A program on each SM, two from 64 tokens on, and walks at most two chunks a program up to 256."""
    for T in TS:
        p = mf.kernel_plan(T, **V41)
        assert p["programs"] >= mf.MIN_PROGRAMS, (T, p)
        if T >= 64:
            assert p["programs"] >= mf.TARGET_PROGRAMS, (T, p)
        if T <= 256:
            assert V41["d"] // p["DS"] // p["BD"] <= 2, (T, p)
    assert mf.kernel_plan(1, **V41)["DS"] > 1 and mf.kernel_plan(64, **V41)["DS"] > 1


def test_plan_partials_stay_small_at_large_T():
    """Partials (written by A, read by B) vs the X read: bounded by the plan's cap everywhere, < 4 % from 1024 tokens
    at V4.1, and large T uses wide token blocks (fn re-read per block) and few splits."""
    for n, d in [(4, 5120), (4, 256), (2, 64)]:
        for T in TS:
            p = mf.kernel_plan(T, n, d)
            x_bytes = T * n * d * 2
            assert mf.partial_bytes(T, p["DS"], p["NCP"]) <= max(mf.PARTIAL_X_FRAC * x_bytes, mf.PARTIAL_FLOOR) \
                or p["DS"] == 1, (n, d, T, p)
    for T in (1024, 2048, 4096, 16384, 65536):
        p = mf.kernel_plan(T, **V41)
        assert mf.partial_bytes(T, p["DS"], p["NCP"]) < 0.04 * T * 4 * 5120 * 2, (T, p)
    p = mf.kernel_plan(16384, **V41)
    assert p["DS"] <= 4, p


def test_plan_from_512_tokens_is_the_measured_narrow_tile():
    """From 512 tokens: [16, 64] tiles on 4 warps with hardware rounding and the rule's splits, the plan the sweeps
    timed (H100, session 20: 0.612 -> 0.475 ms at 4096 tokens, 2.026 -> 1.635 at 16384; session 21: 0.228 -> 0.181
    at 1024, 0.372 -> 0.294-0.316 at 2048; H200, session 24: 0.146 -> 0.115 at 512); below, the rule's plan, never the
    hardware rounding (4-6 % at 192 / 256 tokens, not taken)."""
    assert mf.NARROW_FROM == 512
    for T in (512, 1023, 1024, 2048, 2049, 4096, 16384, 65536):
        p = mf.kernel_plan(T, **V41)
        assert (p["BT"], p["BD"], p["num_warps"], p.get("hw_round")) == (mf.NARROW_BT, mf.NARROW_BD, 4, 1), (T, p)
        assert p["programs"] == -(-T // 16) * p["DS"], (T, p)
    got = [mf.kernel_plan(T, **V41)["DS"] for T in (512, 1024, 2048, 4096, 16384)]
    assert got == [20, 10, 5, 5, 2], got                                # the splits as measured
    for T in (1, 128, 192, 256, 511):
        assert "hw_round" not in mf.kernel_plan(T, **V41), T
    assert [mf.kernel_plan(T, **V41)["BT"] for T in (192, 256, 511)] == [32, 32, 32]


def test_plan_rejects_unsupported_shapes():
    for T, n, d in [(0, 4, 5120), (5, 3, 5120), (5, 4, 5000), (5, 4, 48)]:
        with pytest.raises(ValueError):
            mf.kernel_plan(T, n, d)
    good = mf.kernel_plan(20, 4, 256)
    mf.check_plan(dict(good, warps_b=1), 4, 256)
    mf.check_plan(dict(good, BTE=1), 4, 256)
    for bad in (dict(DS=3), dict(BT=24), dict(BD=8), dict(NCP=16), dict(SB=3), dict(BTE=12), dict(warps_b=3)):
        with pytest.raises(ValueError):
            mf.check_plan(dict(good, **bad), 4, 256)


def test_crossover_table():
    # the kernel at every size since the demo-model check on the H200 (kernels/dispatch.py, GATES["mhc"])
    from dsflash.kernels import dispatch
    gate = dispatch.GATES["mhc"]
    assert gate.triton == ((1, None),) and all(gate.covers(T) for T in TS)
    assert not any(gate.replace(triton=()).covers(T) for T in TS)
    two = gate.replace(triton=((1, 64), (4096, None)))
    assert [two.covers(T) for T in (1, 64, 65, 4095, 4096, 10 ** 6)] == [True, True, False, False, True, True]


def test_hardware_rounding_runs_on_the_gpu_only():
    """kernel_plan's hw_round (from 512 tokens) launches HW_ROUND 1 on a GPU; interpreted, where fp32 -> bf16 casts
    truncate, the same plan runs the integer rounding (the same bits), and asking for hw_round there is refused."""
    mt = pytest.importorskip("dsflash.kernels.mhc_fused_triton")
    kw = dict(expand=True, x_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, eps=1e-6, rms_eps=1e-20, iters=20)
    for interpret, want in ((False, 1), (True, 0)):
        p, (_, a_kw), _ = mt.launch_config(4096, 4, 5120, interpret=interpret, **kw)
        assert (p["BT"], p["BD"], a_kw["HW_ROUND"]) == (16, 64, want), (interpret, p, a_kw)
    assert mt.launch_config(511, 4, 5120, **kw)[1][1]["HW_ROUND"] == 0
    with pytest.raises(ValueError, match="interpreter"):
        mt.launch_config(64, 4, 5120, interpret=True, plan={"hw_round": 1}, **kw)


@pytest.mark.parametrize("dot,terms", [(2, 2), (2, 3), (3, 2), (1, 1)])
def test_pack_fn_layout_and_split(dot, terms):
    """pack_fn's [parts, d/BD, n*BD, NCP] tiles hold fn[j, c*d + i*BD + e] at [., i, c*BD + e, j] (zeros past NC),
    and the bf16 parts sum to fn within 2^-16 (2 parts) / fp32 rounding (3 parts)."""
    mt = pytest.importorskip("dsflash.kernels.mhc_fused_triton")   # needs triton (the interpreter's CPU install)
    n, d, BD, NCP = 4, 256, 64, 32
    nc = 2 * n + n * n
    fn = jax.random.normal(jax.random.PRNGKey(3), (nc, n * d)) * 0.1
    pk = mt.pack_fn(fn, n, d, BD, NCP, dot, terms)
    assert pk.shape == (terms, d // BD, n * BD, NCP)
    assert pk.dtype == (jnp.bfloat16 if dot == mt.DOT_BF16_SPLIT else jnp.float32)
    tot = np.asarray(pk.astype(jnp.float32)).sum(0)             # [d/BD, n*BD, NCP]
    back = tot.reshape(d // BD, n, BD, NCP).transpose(3, 1, 0, 2).reshape(NCP, n * d)
    assert np.all(back[nc:] == 0)
    err = np.max(np.abs(back[:nc] - np.asarray(fn)) / np.abs(np.asarray(fn)))
    assert err <= {1: 0, 2: 2.0 ** -16, 3: 2.0 ** -23}[terms], err


def test_triton_wrapper_keeps_the_epilogue_next_to_the_split_kernel(monkeypatch):
    """h (kernel A's output, the sublayer's input) leaves the Triton wrapper through one optimization barrier with
    kernel B's coefficients, so XLA cannot defer B past the sublayer (whose weight reads evict A's partials from L2:
    B then read them from HBM, 35 us a call in the 1 x 6 step). Traced with a stand-in for jax-triton (CPU)."""
    import sys
    import types

    pytest.importorskip("triton")                          # in the test extra on Linux x86-64 (CI)
    from dsflash.kernels import mhc_fused_triton as mft

    def triton_call(*args, kernel, out_shape, **kw):      # the launches' shapes, no GPU
        return tuple(jnp.zeros(o.shape, o.dtype) for o in out_shape)

    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))
    X, a, fn, base, scale, y = _inputs(lead=(6,))
    n = CFG.hc_mult
    post, comb = jnp.ones((6, n), jnp.float32), jnp.full((6, n, n), 1.0 / n, jnp.float32)
    kw = dict(eps=CFG.hc_eps, rms_eps=CFG.rms_norm_eps, iters=CFG.hc_sinkhorn_iters, out_dtype=jnp.bfloat16)
    for expand in (None, (y, post, comb)):
        jaxpr = jax.make_jaxpr(lambda X, a: mft.mhc_fused_triton(X, a, fn, base, scale, expand, **kw))(X, a).jaxpr
        barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
        assert len(barriers) == 1, [e.primitive.name for e in jaxpr.eqns]
        _, h, (pre, post_o, comb_o) = jaxpr.outvars[0], jaxpr.outvars[1], jaxpr.outvars[2:5]
        assert {id(v) for v in (h, pre, post_o, comb_o)} <= {id(v) for v in barriers[0].outvars}
