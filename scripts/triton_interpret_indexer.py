"""CPU check of the Triton indexer scoring kernel's logic in Triton's interpreter (TRITON_INTERPRET=1).

Runs ``_indexer_score_kernel`` on numpy buffers at small shapes and compares the scores and the selected top-k
sets (selection = the shared ``indexer_topk.select``) with ``indexer_topk_reference``. Inputs are on a coarse
dyadic grid, so every fp32 sum is exact whatever its order: scores must be bit-identical and index sets equal
(many exact ties, so the lowest-index rule is exercised). A continuous-input case checks scores to 1 bf16 ulp.
Non-finite input: the rounding helper on special bit patterns (the GPU's canonical NaN 0x7FFFFFFF cannot be made
by numpy arithmetic, so it is fed in directly) and NaN weights / queries end to end vs the reference's NaN pattern.
Each check runs in its own process, a failed one re-run once (``interpret_isolation``).
Usage: python scripts/triton_interpret_indexer.py [--list | --check NAME]   (needs `pip install triton`)"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from triton_interpret_moe import Fake  # noqa: E402
import interpret_isolation  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from dsflash.kernels import indexer_topk as ik, indexer_topk_triton as it  # noqa: E402
from dsflash.kernels.triton_common import _bf16_rne  # noqa: E402

interpret_isolation.allow_runtime_loop_bounds()   # the row form's loops run from / to runtime scalars


def inputs(B, S, Hi, Di, T, seed, grid=True, dtype=jnp.bfloat16, cand=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    if grid:   # small integers x 2^-3: exact products and sums
        q = jax.random.randint(ks[0], (B, S, Hi, Di), -3, 4).astype(jnp.float32) / 8
        k = jax.random.randint(ks[1], (B, T, Di), -3, 4).astype(jnp.float32) / 8
        w = jax.random.randint(ks[2], (B, S, Hi), -2, 3).astype(jnp.float32) / 4
    else:
        q = jax.random.normal(ks[0], (B, S, Hi, Di))
        k = jax.random.normal(ks[1], (B, T, Di))
        w = jax.random.normal(ks[2], (B, S, Hi)) * 0.1
    visible = jax.random.randint(ks[3], (B, S), 0, T + 1).at[0, 0].set(T)
    valid = jnp.ones((B, S), bool).at[B - 1, S - 1].set(S == 1)
    c = jax.random.uniform(ks[4], (B, S, T)) < 0.6 if cand else None
    return q.astype(dtype), w.astype(dtype), k.astype(dtype), visible.astype(jnp.int32), valid, c


def kernel_scores(q, w, k, visible, valid, cand, form="tiles", block_t=None, min_programs=None, mod=it):
    """The Triton scores as ``indexer_scores_triton`` launches them: ``form`` "tiles" (``_indexer_score_kernel``) or
    "rows" (``_indexer_score_rows_kernel``, the entry axis split as ``rows_form_splits`` says). The output starts as
    NaN, so an entry no program writes shows. ``mod``: the module holding the kernels (a mutant's, for the checks
    that must fail)."""
    B, S, Hi, Di = q.shape
    T = k.shape[1]
    prm = it.launch_params(S, Hi, T)
    prm.pop("num_warps")
    if block_t:
        prm["BT"] = block_t
    out = np.full((B, S, T), np.nan, np.float32)
    lim = np.asarray(jnp.where(valid, visible, 0).astype(jnp.int32))
    c = np.asarray(cand).astype(np.int8) if cand is not None else np.zeros(1, np.int8)
    rows = B * triton.cdiv(S, prm["BS"])
    if form == "rows":
        splits, tps = it.rows_form_splits(B, S, T, prm["BS"], prm["BT"],
                                          min_programs or it.ROWS_FORM_MIN_PROGRAMS)
        kernel, grid, extra = mod._indexer_score_rows_kernel, (rows, splits), dict(TPS=tps)
    else:
        kernel, grid, extra = mod._indexer_score_kernel, (rows, triton.cdiv(T, prm["BT"])), {}
    kernel[grid](
        Fake(np.asarray(q)), Fake(np.asarray(w)), Fake(np.asarray(k)), Fake(lim), Fake(c), Fake(out),
        S=S, T=T, Hi=Hi, Di=Di, HAS_CAND=int(cand is not None), ROUND=int(q.dtype == jnp.bfloat16), IEEE=1, **prm,
        **extra)
    return out


SPECIALS = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0x7F800000,
                     0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00000000, 0x80000000,
                     0x00008000, 0xBF800001, 0x7F7F7FFF, 0x3F808001, 0x80007FFF], np.uint32)


@triton.jit
def _specials_kernel(x_ptr, r_ptr, m_ptr, N: tl.constexpr, BN: tl.constexpr, RNE: tl.constexpr, RELU: tl.constexpr):
    o = tl.arange(0, BN)
    x = tl.load(x_ptr + o, mask=o < N, other=0.0)
    tl.store(r_ptr + o, RNE(x), mask=o < N)
    tl.store(m_ptr + o, RELU(x), mask=o < N)


def check_specials(rne, relu=None):
    """The kernel's bf16 rounding (and relu) on special bit patterns vs XLA's convert: NaN stays NaN (the GPU's
    canonical NaN 0x7FFFFFFF used to carry into the sign bit and round to -0.0), inf/overflow/ties as XLA."""
    x = SPECIALS.view(np.float32)
    r, m = np.zeros_like(x), np.zeros_like(x)
    _specials_kernel[(1,)](Fake(x), Fake(r), Fake(m), N=x.size, BN=triton.next_power_of_2(x.size), RNE=rne,
                           RELU=relu or rne)
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(r), nan), (SPECIALS[np.isnan(r) != nan], r[np.isnan(r) != nan])
    assert np.array_equal(r[~nan].view(np.uint32), want[~nan].view(np.uint32)), (r, want)
    assert np.array_equal(r[nan].view(np.uint32) & 0xFFFF, np.zeros(nan.sum(), np.uint32)), "NaN not bf16-exact"
    if relu is not None:
        want_m = np.asarray(jax.nn.relu(jnp.asarray(x)))
        cmp = ~np.isnan(want_m) & ((np.abs(x) >= np.finfo(np.float32).tiny) | (x == 0))  # XLA:CPU flushes subnormals
        assert np.array_equal(np.isnan(m), np.isnan(want_m)) and np.array_equal(m[cmp], want_m[cmp]), (m, want_m)
    print(f"specials: {x.size} bit patterns (canonical GPU NaN 0x7FFFFFFF included) round like XLA's convert, NaN kept")


@triton.jit
def _round_kernel(x_ptr, r_ptr, N: tl.constexpr, BN: tl.constexpr, HW_ROUND: tl.constexpr):
    o = tl.arange(0, BN)
    x = tl.load(x_ptr + o, mask=o < N, other=0.0)
    tl.store(r_ptr + o, it._bf16_round(x, HW_ROUND), mask=o < N)


def check_hw_nan_bits():
    """The hardware-rounding path (``_bf16_round`` HW_ROUND 1, ``hw_round=True``) is a GPU-only path: what the
    interpreter CAN check is its NaN select, whose bits must be ``_bf16_rne``'s for every NaN pattern (the GPU's
    canonical 0x7FFFFFFF, signed and signalling payloads); its other lanes are the interpreter's cast, which is not
    RNE (it truncates: 0x3F818000 -> 0x3F810000, 0x7F7FFFFF stays finite; a subnormal came out as 0x807E0000),
    shown here on the round-up / tie / overflow patterns, which is why ``indexer_scores_triton``
    refuses ``hw_round`` under TRITON_INTERPRET instead of running (and so checking) the integer path."""
    x = np.concatenate([SPECIALS, np.array([0xFFA00001, 0x7F800002, 0xFFFFFFFF, 0x7FC00001], np.uint32)]).view(
        np.float32)
    outs = {}
    for hw in (0, 1, 2):
        r = np.zeros_like(x)
        _round_kernel[(1,)](Fake(x), Fake(r), N=x.size, BN=triton.next_power_of_2(x.size), HW_ROUND=hw)
        outs[hw] = r.view(np.uint32)
    nan = np.isnan(x)
    assert np.array_equal(outs[1][nan], outs[0][nan]), [hex(v) for v in outs[1][nan]]
    assert not np.array_equal(outs[2][nan], outs[0][nan])   # the check has teeth: no NaN select (HW_ROUND 2) fails it
    n_diff = int((outs[1][~nan] != outs[0][~nan]).sum())
    assert n_diff > 0                   # the interpreter's cast is not RNE, so the rounding half is not checkable here
    print(f"hw_nan_bits: {int(nan.sum())} NaN patterns give _bf16_rne's bits under HW_ROUND 1 (HW_ROUND 2, no "
          f"select: {int((outs[2][nan] != outs[0][nan]).sum())} differ); {n_diff} of {int((~nan).sum())} non-NaN "
          "patterns differ from RNE (the interpreter's cast truncates: GPU only)")


def run_poison(B=2, S=3, Hi=16, Di=32, T=300, seed=6, where="w"):
    """Non-finite input: the kernel must give the reference's NaN / -inf pattern (the GPU test's poison call)."""
    q, w, k, visible, valid, _ = inputs(B, S, Hi, Di, T, seed)
    if where == "w":
        w = jnp.full_like(w, jnp.nan)
    else:   # one NaN query element: that row's every visible score is NaN
        q = q.at[0, 0, 1, 3].set(jnp.nan)
    visible = jnp.full_like(visible, T // 2)
    ref = np.asarray(ik.indexer_scores_reference(q, w, k, visible, valid))
    got = kernel_scores(q, w, k, visible, valid, None)
    assert np.isnan(ref).any()
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.array_equal(np.isneginf(got), np.isneginf(ref))
    print(f"poison ({where} NaN): NaN scores {int(np.isnan(got).sum())} = reference's, -inf pattern equal")


def run(B=2, S=3, Hi=16, Di=32, T=300, topk=40, seed=0, grid=True, dtype=jnp.bfloat16, cand=False, filt=None):
    q, w, k, visible, valid, c = inputs(B, S, Hi, Di, T, seed, grid, dtype, cand)
    ref = np.asarray(ik.indexer_scores_reference(q, w, k, visible, valid, c))
    got = kernel_scores(q, w, k, visible, valid, c)
    fin = np.isfinite(ref)
    assert np.array_equal(fin, np.isfinite(got)), "mask differs"
    diff = np.abs(got[fin] - ref[fin])
    rel = float(diff.max() / max(np.abs(ref[fin]).max(), 1e-30)) if fin.any() else 0.0
    sel_ref, m_ref = ik.select(jnp.asarray(ref), visible, topk=topk, cand_filter=filt)
    sel_got, m_got = ik.select(jnp.asarray(got), visible, topk=topk, cand_filter=filt)
    same = bool(np.array_equal(np.asarray(sel_ref), np.asarray(sel_got)))
    if filt:
        same &= bool(np.array_equal(np.asarray(m_ref), np.asarray(m_got)))
    ties = int(sum(len(r) - len(np.unique(r)) for r in ref.reshape(-1, T)))
    print(f"B{B} S{S} Hi{Hi} Di{Di} T{T} k{topk} grid={grid} {jnp.dtype(dtype).name} cand={cand} filter={filt}: "
          f"max rel score err {rel:.1e}, index sets equal {same}, tied scores {ties}")
    if grid:
        assert np.array_equal(got, ref) and same, "grid inputs must match bit for bit"
    return rel


def _continuous():
    rel = run(B=2, S=2, Hi=32, Di=128, T=260, topk=64, seed=5, grid=False)
    assert rel < 1e-2, rel


def prefill_inputs(B, S, Hi, Di, T, seed, start, ratio, pad=0, grid=True, dtype=jnp.bfloat16, cand=False):
    """A causal prefill chunk: row s of sequence b sees (start[b] + s + 1) // ratio entries (as attention.py passes
    ``(pos + 1) // ratio``); the last ``pad`` rows of every sequence are padding (valid False)."""
    q, w, k, _, _, c = inputs(B, S, Hi, Di, T, seed, grid, dtype, cand)
    start = np.broadcast_to(np.asarray(start), (B,))
    visible = (start[:, None] + np.arange(S)[None] + 1) // ratio
    assert visible.max() <= T, (visible.max(), T)
    valid = np.ones((B, S), bool)
    valid[:, S - pad:] = False
    return q, w, k, jnp.asarray(visible, jnp.int32), jnp.asarray(valid), c


def tile_census(visible, valid, S, Hi, T, block_t=None, min_programs=None):
    """(tiles computed, tiles stored as -inf only, tiles computed with some entries masked) of the row form."""
    prm = it.launch_params(S, Hi, T)
    BS, BT = prm["BS"], block_t or prm["BT"]
    B = visible.shape[0]
    splits, tps = it.rows_form_splits(B, S, T, BS, BT, min_programs or it.ROWS_FORM_MIN_PROGRAMS)
    nt = triton.cdiv(T, BT)
    lim = np.where(np.asarray(valid), np.asarray(visible), 0)
    lim = np.pad(lim, ((0, 0), (0, triton.cdiv(S, BS) * BS - S)))
    comp = dead = part = 0
    for b in range(B):
        for s0 in range(0, S, BS):
            blk = lim[b, s0:s0 + BS]
            for sp in range(splits):
                j0, j1 = sp * tps, min(sp * tps + tps, nt)
                live = max(min(-(-int(blk.max()) // BT), j1), j0)
                comp, dead = comp + live - j0, dead + j1 - live
                part += sum(int(blk.min()) < min((j + 1) * BT, T) for j in range(j0, live))
    return comp, dead, part


def run_rows(B, S, Hi, Di, T, seed, start, ratio, pad=0, grid=True, dtype=jnp.bfloat16, cand=False, block_t=None,
             min_programs=None, poison=False, mod=it):
    """The row form against the tile form (must be the same bits: same tile math) and the reference (bit for bit on
    grid inputs). Returns (ok, message) so a mutant's check can expect False."""
    q, w, k, visible, valid, c = prefill_inputs(B, S, Hi, Di, T, seed, start, ratio, pad, grid, dtype, cand)
    if poison:   # one NaN query element: that row's visible scores are NaN in every form
        q = q.at[B - 1, S // 2, 1, 3].set(jnp.nan)
    ref = np.asarray(ik.indexer_scores_reference(q, w, k, visible, valid, c))
    tiles = kernel_scores(q, w, k, visible, valid, c, "tiles", block_t)
    rows = kernel_scores(q, w, k, visible, valid, c, "rows", block_t, min_programs, mod=mod)
    comp, dead, part = tile_census(visible, valid, S, Hi, T, block_t, min_programs)
    assert dead > 0 and part > 0, (comp, dead, part)      # the case exercises the skip and the partial tiles
    same_tiles = bool(np.array_equal(rows.view(np.uint32), tiles.view(np.uint32)))
    fin = np.isfinite(ref)
    same_mask = bool(np.array_equal(np.isnan(rows), np.isnan(ref)) and np.array_equal(np.isneginf(rows),
                                                                                      np.isneginf(ref)))
    if grid:
        same_ref = bool(np.array_equal(rows[fin], ref[fin])) and same_mask
    else:
        rel = float(np.abs(rows[fin] - ref[fin]).max() / max(np.abs(ref[fin]).max(), 1e-30))
        same_ref = same_mask and rel < 1e-2
    bad = int((rows.view(np.uint32) != tiles.view(np.uint32)).sum())
    msg = (f"rows form B{B} S{S} Hi{Hi} Di{Di} T{T} BT{block_t or it.launch_params(S, Hi, T)['BT']} start {start} "
           f"ratio {ratio} pad {pad} {jnp.dtype(dtype).name} grid={grid} cand={cand} poison={poison}: tiles computed "
           f"{comp}, -inf only {dead}, partly masked {part}; bit-identical to the tile form {same_tiles} "
           f"({bad} entries differ), to the reference {same_ref} (NaN {int(np.isnan(rows).sum())})")
    return same_tiles and same_ref, msg


def mutant(name, old, new):
    """A copy of indexer_topk_triton.py with one edit, imported from a temporary file (the checks must catch it)."""
    import importlib.util
    import tempfile
    src = open(it.__file__).read()
    assert src.count(old) == 1, old
    path = os.path.join(tempfile.mkdtemp(prefix="idx_mutant_"), f"{name}.py")
    with open(path, "w") as f:
        f.write(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows_check(expect_ok=True, mod_fn=None, **kw):
    def f():
        ok, msg = run_rows(**kw, **({"mod": mod_fn()} if mod_fn else {}))
        print(msg + ("" if expect_ok else f"  -> {'passed (BAD: the check is vacuous)' if ok else 'caught'}"))
        assert ok == expect_ok, msg
    return f


LIVE = "tl.cdiv(tl.max(lim, axis=0), BT)"
# seq 0 sees 1..37 entries (tiles 1, 2 dead for every block), seq 1 101..137 (tile 0 / 0-1 per block), T % 128 != 0
ROWS_BASE = dict(B=2, S=37, Hi=16, Di=32, T=300, seed=11, start=(0, 100), ratio=1, pad=3)
ROWS_CHECKS = {
    "rows_prefill": rows_check(**ROWS_BASE),
    # ratio 2 (visible (51 + s) // 2), 32-entry tiles, T % 32 != 0, consumer layer's candidate set, 5 padding rows
    "rows_ratio2_cand": rows_check(B=1, S=70, Hi=32, Di=64, T=200, seed=12, start=50, ratio=2, pad=5, cand=True,
                                   block_t=32),
    # entries split over the second grid axis (min_programs 64: 3 splits of 6 tiles), rows not a multiple of BS
    "rows_split": rows_check(B=2, S=45, Hi=8, Di=32, T=260, seed=13, start=(0, 130), ratio=1, pad=2, block_t=16,
                             min_programs=64),
    "rows_fp32": rows_check(B=1, S=21, Hi=16, Di=32, T=100, seed=14, start=40, ratio=1, pad=1, dtype=jnp.float32,
                            block_t=16),
    # V4.1's head shape (Hi 32, Di 128, BT 128) on continuous input: same bits as the tile form, 1 ulp of the reference
    "rows_continuous": rows_check(B=1, S=24, Hi=32, Di=128, T=260, seed=15, start=(120,), ratio=1, grid=False),
    "rows_poison": rows_check(**{**ROWS_BASE, "seed": 16}, poison=True),
    # mutants the checks must catch: one tile fewer computed (its entries -inf), the block's least lim for its most
    "mutant_skip_one_more": rows_check(False, lambda: mutant("idx_mut_skip", LIVE, LIVE + " - 1"), **ROWS_BASE),
    "mutant_min_lim": rows_check(False, lambda: mutant("idx_mut_min", LIVE, LIVE.replace("max", "min")),
                                 **{**ROWS_BASE, "B": 1, "start": 100}),
}


CHECKS = {   # each runs in its own process (``interpret_isolation``)
    "specials": lambda: check_specials(_bf16_rne, it._relu_nan),
    "hw_nan_bits": check_hw_nan_bits,
    "poison_w": lambda: run_poison(),
    "poison_q": lambda: run_poison(where="q"),
    "grid": lambda: run(),
    "decode": lambda: run(B=1, S=1, Hi=32, Di=128, T=700, topk=512, seed=1),          # V4.1 head shape, decode
    "cand": lambda: run(B=2, S=6, Hi=32, Di=64, T=200, topk=64, seed=2, cand=True),   # consumer layer, 6 rows
    "filter": lambda: run(B=1, S=5, Hi=8, Di=32, T=130, topk=16, seed=3, filt=(8, 4)),  # candidate source
    "fp32": lambda: run(B=1, S=4, Hi=16, Di=32, T=100, topk=20, seed=4, dtype=jnp.float32),  # "fp32" precision
    "continuous": _continuous,
    **ROWS_CHECKS,
}


if __name__ == "__main__":
    interpret_isolation.main(__file__, CHECKS)
