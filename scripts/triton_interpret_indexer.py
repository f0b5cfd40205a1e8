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


def kernel_scores(q, w, k, visible, valid, cand):
    B, S, Hi, Di = q.shape
    T = k.shape[1]
    prm = it.launch_params(S, Hi, T)
    prm.pop("num_warps")
    out = np.zeros((B, S, T), np.float32)
    lim = np.asarray(jnp.where(valid, visible, 0).astype(jnp.int32))
    c = np.asarray(cand).astype(np.int8) if cand is not None else np.zeros(1, np.int8)
    it._indexer_score_kernel[(B * triton.cdiv(S, prm["BS"]), triton.cdiv(T, prm["BT"]))](
        Fake(np.asarray(q)), Fake(np.asarray(w)), Fake(np.asarray(k)), Fake(lim), Fake(c), Fake(out),
        S=S, T=T, Hi=Hi, Di=Di, HAS_CAND=int(cand is not None), ROUND=int(q.dtype == jnp.bfloat16), IEEE=1, **prm)
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


CHECKS = {   # each runs in its own process (``interpret_isolation``)
    "specials": lambda: check_specials(it._bf16_rne, it._relu_nan),
    "poison_w": lambda: run_poison(),
    "poison_q": lambda: run_poison(where="q"),
    "grid": lambda: run(),
    "decode": lambda: run(B=1, S=1, Hi=32, Di=128, T=700, topk=512, seed=1),          # V4.1 head shape, decode
    "cand": lambda: run(B=2, S=6, Hi=32, Di=64, T=200, topk=64, seed=2, cand=True),   # consumer layer, 6 rows
    "filter": lambda: run(B=1, S=5, Hi=8, Di=32, T=130, topk=16, seed=3, filt=(8, 4)),  # candidate source
    "fp32": lambda: run(B=1, S=4, Hi=16, Di=32, T=100, topk=20, seed=4, dtype=jnp.float32),  # "fp32" precision
    "continuous": _continuous,
}


if __name__ == "__main__":
    interpret_isolation.main(__file__, CHECKS)
