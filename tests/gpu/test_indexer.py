"""Triton indexer scoring + top-k vs ``indexer_topk_reference`` on the GPU (fresh random inputs).

Not yet run on a GPU (checked in the interpreter: scripts/triton_interpret_indexer.py). The reference runs op by
op (not jitted) so each of its bf16 roundings happens (NOTES.md: XLA may drop round trips inside one program).
* grid inputs (small integers x 2^-3): every fp32 sum is exact, so scores must be bit-identical and the top-k
  index sets and candidate masks equal, with thousands of exact ties (lowest index wins);
* continuous inputs: the fp32 summation order differs, so a score may move by one bf16 ulp; scores within 1 ulp,
  and every index in the symmetric difference of the sets must score within 1 ulp of the k-th value.
Poisoning: a NaN-producing call of the same shape runs first (NaN head weights, every entry visible): it must
give the reference's NaN / -inf pattern (non-finite input follows the reference), and a buffer the allocator hands
back then holds NaN; every entry of the real output must then be finite or -inf (no tile left unwritten; this half
is best effort, the allocator need not reuse the buffer).
First H200 run (2026-11-30, commit 199278b): the poison call returned -0. everywhere (plain-grid cases, the run
stopped at 4 failures): the kernel's integer bf16 rounding carried the GPU's canonical NaN 0x7FFFFFFF into the
sign bit. Fixed in the kernel (NaN kept, relu NaN-propagating like jnp.maximum); checked in the interpreter,
not yet re-run here.
test_hw_round_bit_identical (written 2026-12-06, session 17; 25 passed on one H100 the same day, session 18, so
hw_round became the default on a GPU): ``hw_round=True`` (hardware bf16
rounding) must give the default's bits in both forms on grid, normal, exactly-halfway, subnormal and NaN / inf
inputs."""
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dsflash.kernels import dispatch, indexer_topk as ik  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [  # B, S, Hi, Di, T, topk
    (2, 3, 16, 32, 300, 40),
    (4, 1, 32, 128, 8192, 512),      # V4.1 decode, 8K compressed entries
    (2, 6, 32, 128, 16384, 512),     # 1 + 5 draft rows
    (1, 1, 32, 128, 65536, 512),     # 64K entries (128K tokens at ratio 2)
    (1, 512, 32, 128, 2048, 512),    # prefill chunk
]


def _inputs(case, seed, grid):
    B, S, Hi, Di, T, _ = case
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    if grid:
        q = jax.random.randint(ks[0], (B, S, Hi, Di), -3, 4).astype(jnp.float32) / 8
        k = jax.random.randint(ks[1], (B, T, Di), -3, 4).astype(jnp.float32) / 8
        w = jax.random.randint(ks[2], (B, S, Hi), -2, 3).astype(jnp.float32) / 4
    else:
        q, k = jax.random.normal(ks[0], (B, S, Hi, Di)), jax.random.normal(ks[1], (B, T, Di))
        w = jax.random.normal(ks[2], (B, S, Hi)) * 0.1
    visible = jax.random.randint(ks[3], (B, S), 0, T + 1).astype(jnp.int32).at[0, 0].set(T)
    valid = jnp.ones((B, S), bool)
    if B * S > 1:
        valid = valid.at[B - 1, S - 1].set(False)
    bf = jnp.bfloat16
    return q.astype(bf), w.astype(bf), k.astype(bf), visible, valid


def _ulp(x):
    return np.abs(x.astype(np.float32)) * 2.0 ** -7 + 1e-30


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}S{}Hi{}Di{}T{}k{}".format(*c))
@pytest.mark.parametrize("grid", [True, False], ids=["grid", "normal"])
@pytest.mark.parametrize("mode", ["plain", "consumer", "candidate"])
def test_matches_reference(case, grid, mode):
    from dsflash.kernels import indexer_topk_triton as it
    topk = case[-1]
    q, w, k, visible, valid = _inputs(case, zlib.crc32(repr((case, grid, mode)).encode()), grid)
    cand = (jax.random.uniform(jax.random.PRNGKey(3), visible.shape + (k.shape[1],)) < 0.7) \
        if mode == "consumer" else None
    filt = (8, max(1, topk // 4)) if mode == "candidate" else None
    ref = np.asarray(ik.indexer_scores_reference(q, w, k, visible, valid, cand))
    f = jax.jit(it.indexer_scores_triton)
    pargs = (q, jnp.full_like(w, jnp.nan), k, jnp.full_like(visible, k.shape[1]), jnp.ones_like(valid), cand)
    poison, ref_p = np.asarray(f(*pargs)), np.asarray(ik.indexer_scores_reference(*pargs))
    assert np.isnan(ref_p).any()
    assert np.array_equal(np.isnan(poison), np.isnan(ref_p)), \
        f"NaN weights: {int(np.isnan(poison).sum())} NaN scores, reference {int(np.isnan(ref_p).sum())}"
    assert np.array_equal(np.isneginf(poison), np.isneginf(ref_p)), "NaN weights: -inf pattern differs"
    del poison, ref_p
    got = np.asarray(f(q, w, k, visible, valid, cand))
    assert not np.isnan(got).any()
    assert np.array_equal(np.isfinite(got), np.isfinite(ref)), "mask differs"
    fin = np.isfinite(ref)
    sel_r, m_r = ik.select(jnp.asarray(ref), visible, topk=topk, cand_filter=filt)
    sel_g, m_g = jax.jit(lambda s: ik.select(s, visible, topk=topk, cand_filter=filt))(jnp.asarray(got))
    sel_r, sel_g = np.asarray(sel_r), np.asarray(sel_g)
    if grid:
        assert np.array_equal(got, ref)
        assert np.array_equal(sel_g, sel_r)
        if filt:
            assert np.array_equal(np.asarray(m_g), np.asarray(m_r))
        return
    assert np.all(np.abs(got[fin] - ref[fin]) <= _ulp(ref[fin]) * 1.01)
    flips = 0
    for b in range(sel_r.shape[0]):
        for s in range(sel_r.shape[1]):
            a, g = set(sel_r[b, s][sel_r[b, s] >= 0]), set(sel_g[b, s][sel_g[b, s] >= 0])
            if a == g:
                continue
            kth = min(ref[b, s, list(a)]) if a else -np.inf
            for i in a ^ g:
                flips += 1
                assert abs(ref[b, s, i] - kth) <= 2 * _ulp(np.float32(kth)), (b, s, i, ref[b, s, i], kth)
    print(f"{case} {mode}: near-tie set differences {flips}, exact score share "
          f"{np.mean(got[fin] == ref[fin]):.4f}")


def _bf16_bits(bits):
    """bf16 values from their bit patterns (NaN payloads and signs kept)."""
    return jax.lax.bitcast_convert_type(jnp.asarray(np.asarray(bits, np.uint16)), jnp.bfloat16)


def _hw_inputs(case, kind, seed):
    """Inputs for the hw_round A/B. "grid" / "normal": ``_inputs``. "ties": q, k in {-15..15}/16 (qk = n/256 with up
    to ~12 significant bits: many qk exactly halfway between two bf16 values) and w in {+-3, +-5, +-7}/8 (c = bf16(qk)
    x w has up to 11 bits: halfway products too). "subnormal": head h's q scaled by 2^-(92 + 4 (h % 5)), k by 2^-34,
    so qk = n x 2^-(132 + 4 (h % 5)), ~95 % below fp32's normal limit 2^-126 (fp32 subnormals on a 2^-149 step that
    bf16, on a 2^-133 step, must round: ~75 % of qk, ~10 % of c = qk x w with ~6 % ties; ~97 % of the scores are
    subnormal in a numpy model without flush to zero). "nonfinite": on the grid, entries t % 7 == 1 hold a NaN key
    element (signs and payloads varied), t % 7 == 2 keys x 2^120 (the fp32 accumulator overflows to +-inf for large
    |n|, finite near-max values elsewhere), t % 7 == 3 a +inf key element (inf, -inf or inf x 0 = NaN per head); rows
    r % 3 == 1 a NaN head weight and r % 3 == 2 a NaN query element."""
    B, S, Hi, Di, T, _ = case
    bf = jnp.bfloat16
    if kind in ("grid", "normal"):
        return _inputs(case, seed, kind == "grid")
    q, w, k, visible, valid = _inputs(case, seed, True)
    ks = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    if kind == "ties":
        q = (jax.random.randint(ks[0], (B, S, Hi, Di), -15, 16).astype(jnp.float32) / 16).astype(bf)
        k = (jax.random.randint(ks[1], (B, T, Di), -15, 16).astype(jnp.float32) / 16).astype(bf)
        pick = jax.random.randint(ks[2], (B, S, Hi), 0, 6)
        w = (jnp.array([-7, -5, -3, 3, 5, 7], jnp.float32)[pick] / 8).astype(bf)
    elif kind == "subnormal":
        scale = jnp.exp2(-(92.0 + 4 * (jnp.arange(Hi) % 5)))[None, None, :, None]
        q = (q.astype(jnp.float32) * scale).astype(bf)
        k = (k.astype(jnp.float32) * 2.0 ** -34).astype(bf)
    elif kind == "nonfinite":
        t = jnp.arange(T)
        nan_k = _bf16_bits([0x7FC0, 0xFFC1, 0x7F81, 0xFFFF])[t % 4]
        k = k.at[:, :, 3].set(jnp.where(t % 7 == 1, nan_k, k[:, :, 3]))
        k = jnp.where((t % 7 == 2)[None, :, None], (k.astype(jnp.float32) * 2.0 ** 120).astype(bf), k)
        k = k.at[:, :, 0].set(jnp.where(t % 7 == 3, jnp.inf, k[:, :, 0]).astype(bf))
        r = jnp.arange(B * S).reshape(B, S)
        w = w.at[:, :, 0].set(jnp.where(r % 3 == 1, _bf16_bits([0xFFC3])[0], w[:, :, 0]))
        q = q.at[:, :, 2, 5].set(jnp.where(r % 3 == 2, _bf16_bits([0x7FA5])[0], q[:, :, 2, 5]))
    return q, w, k, visible, valid


def _halfway_share(q, k, s):
    """Share of row s (sequence 0) qk values, exact in float64 (grid inputs), that lie exactly halfway between two
    bf16 values (fp32 low half 0x8000), and the share that are fp32 subnormals bf16 must round (input design)."""
    qk = np.asarray(q[0, s], np.float64) @ np.asarray(k[0], np.float64).T          # [Hi, T], exact
    f = qk.astype(np.float32)
    b = f.view(np.uint32)
    sub = (f != 0) & (np.abs(f) < np.finfo(np.float32).tiny)
    return float(np.mean((b & 0xFFFF) == 0x8000)), float(np.mean(sub & ((b & 0xFFFF) != 0)))


_HW_JIT = {}   # (form, hw_round) -> jitted scorer, shared by the cases


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}S{}Hi{}Di{}T{}k{}".format(*c))
@pytest.mark.parametrize("kind", ["grid", "normal", "ties", "subnormal", "nonfinite"])
@pytest.mark.parametrize("hw", [1, 2])     # 2: the convert alone (session 22, opt-in until this passes)
def test_hw_round_bit_identical(case, kind, hw):
    """``hw_round=True`` (the three bf16 roundings by the hardware convert, NaN bits selected as ``_bf16_rne``'s;
    written 2026-12-06, session 17, CPU only) against the default integer rounding: the same uint32 bits for every
    entry, in both forms (tile and row), on finite, exactly-halfway, subnormal and NaN / inf inputs. This is the
    check that lets ``hw_round`` become the default (NOTES.md "Hardware bf16 rounding"). ``hw`` 2 (session 22): the
    convert alone, whose NaN bits are canonical; the scores must still match, fp32 arithmetic following each rounding
    (NOTES.md "The indexer scorer's rounding as the convert alone")."""
    import functools

    from dsflash.kernels import indexer_topk_triton as it
    q, w, k, visible, valid = _hw_inputs(case, kind, zlib.crc32(repr((case, kind, "hw")).encode()))
    if kind == "ties":
        half, _ = _halfway_share(q, k, 0)
        assert half > 0.01, half                       # the input exercises ties at the qk rounding
    if kind == "subnormal":
        _, sub = _halfway_share(q, k, 0)
        assert sub > 0.01, sub                         # and inexact fp32 subnormals there
    for form in ("tiles", "rows"):
        f = {h: _HW_JIT.setdefault((form, h), jax.jit(functools.partial(it.indexer_scores_triton, form=form,
                                                                         hw_round=h))) for h in (0, hw)}
        a = np.asarray(f[0](q, w, k, visible, valid))
        b = np.asarray(f[hw](q, w, k, visible, valid))
        ua, ub = a.view(np.uint32), b.view(np.uint32)
        bad = np.flatnonzero(ua != ub)
        fin = np.isfinite(a)
        print(f"{case} {kind} {form} hw_round {hw}: NaN {int(np.isnan(a).sum())}, +-inf {int(np.isinf(a).sum())}, "
              f"subnormal {int(np.sum(fin & (a != 0) & (np.abs(a) < np.finfo(np.float32).tiny)))}, differing {bad.size}")
        assert bad.size == 0, (form, hw, bad.size, [(hex(x), hex(y)) for x, y in zip(ua.reshape(-1)[bad[:8]],
                                                                                       ub.reshape(-1)[bad[:8]])])
        if kind == "nonfinite":
            assert np.isnan(a).any()
        if kind == "subnormal":    # after the bits check: a flush to zero here leaves subnormal rounding untested
            assert np.any(fin & (a != 0) & (np.abs(a) < np.finfo(np.float32).tiny)), "no subnormal score: flushed?"


def test_one_row_decode_stays_on_xla():
    """1 row x 8192 entries: the Triton path lost (0.095 vs 0.078 ms, H200 2026-11-30), so dispatch keeps XLA."""
    case = (1, 1, 32, 128, 8192, 512)
    q, w, k, visible, valid = _inputs(case, 12, False)
    assert not dispatch.use_triton("indexer", "triton", q.shape[0] * q.shape[1] * k.shape[1])
    a, _ = jax.jit(lambda *x: ik.indexer_topk(*x, topk=512, backend="triton"))(q, w, k, visible, valid)
    b, _ = jax.jit(lambda *x: ik.indexer_topk(*x, topk=512, backend="xla"))(q, w, k, visible, valid)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_backend_dispatch():
    case = CASES[1]
    q, w, k, visible, valid = _inputs(case, 11, True)
    assert dispatch.use_triton("indexer", "triton", q.shape[0] * q.shape[1] * k.shape[1])
    a, _ = jax.jit(lambda *x: ik.indexer_topk(*x, topk=512, backend="triton"))(q, w, k, visible, valid)
    b, _ = ik.indexer_topk(q, w, k, visible, valid, topk=512, backend="xla")
    assert np.array_equal(np.asarray(a), np.asarray(b))


PAGED_CASES = [  # B, S, Hi, Di, pages, per_page
    (4, 6, 32, 128, 64, 256),        # 1 + 5 draft rows over 16K entries (ratio 1)
    (2, 1, 32, 128, 512, 256),       # one row over 128K entries
    (3, 8, 16, 64, 7, 128),          # odd sizes: T = 896, 8 rows
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: "B{}S{}Hi{}Di{}P{}x{}".format(*c))
@pytest.mark.parametrize("grid", [True, False], ids=["grid", "normal"])
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "plain"])
def test_paged_matches_reference(case, grid, mxfp4):
    """The paged scorer (keys read through the page table, MXFP4 decoded in registers) against the reference on
    the gathered keys: scores bit-identical on the grid, within 1 bf16 ulp otherwise; the top-512 sets equal on
    the grid; unused pages (-1) past every row's visible entries."""
    from dsflash import quant
    from dsflash.kernels import indexer_paged_triton as ipt
    B, S, Hi, Di, P, pp = case
    T = P * pp
    q, w, _, visible, valid = _inputs((B, S, Hi, Di, 16, 512), zlib.crc32(repr((case, grid)).encode()), grid)
    ks = jax.random.split(jax.random.PRNGKey(P), 2)
    npool = B * P + 5
    raw = (jax.random.randint(ks[0], (npool * pp, Di), -3, 4).astype(jnp.float32) / 2 if grid
           else jax.random.normal(ks[0], (npool * pp, Di)))
    if mxfp4:
        qv, sv = quant.mxfp4_quant(raw, 32)
        pool = {"q": quant.pack_nibbles(quant.e2m1_codes(qv)), "s": quant.f32_pow2_to_e8m0(sv)}
    else:
        pool = {"x": raw.astype(jnp.bfloat16)}
    pt = jax.random.permutation(ks[1], npool)[: B * P].reshape(B, P).astype(jnp.int32)
    visible = (visible * T // 16).astype(jnp.int32).at[0, 0].set(T)
    used = -(-jnp.max(visible, axis=1) // pp)
    pt = jnp.where(jnp.arange(P)[None] < used[:, None], pt, -1)
    ref = np.asarray(ik.indexer_scores_reference(q, w, ik.paged_keys(pool, pt, pp), visible, valid))
    got = np.asarray(jax.jit(ipt.indexer_scores_paged_triton, static_argnums=(4,))(q, w, pool, pt, pp, visible,
                                                                                  valid))
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin), "mask differs"
    if grid:
        assert np.array_equal(got, ref)
        a, _ = ik.select(jnp.asarray(ref), visible, topk=512)
        b, _ = ik.select(jnp.asarray(got), visible, topk=512)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    else:
        assert np.all(np.abs(got[fin] - ref[fin]) <= _ulp(ref[fin]) * 1.01)
        print(f"{case} mxfp4={mxfp4}: exact score share {np.mean(got[fin] == ref[fin]):.4f}")
