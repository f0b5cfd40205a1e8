"""CPU check of the paged Triton indexer scorer (``indexer_paged_triton``) in Triton's interpreter.

Runs ``_indexer_paged_kernel`` on numpy buffers with the launch's own arguments (``kernel_args``) and compares its
scores with the reference on the gathered keys (``indexer_topk.paged_keys`` + ``indexer_scores_reference``):
bit-identical on dyadic-grid inputs (every fp32 sum exact, so summation order cannot matter), within one bf16 ulp on
continuous ones; MXFP4 and plain pools, shuffled page tables with unused (-1 / out-of-range) pages past the
visible entries, padding rows, rows that do not fill a row block, T not a multiple of the entry tile, candidates.
Usage: python scripts/triton_interpret_indexer_paged.py [--list | --check NAME]   (needs `pip install triton`; exits 1
on a mismatch; every case in a fresh process, a failed one re-run once: interpret_isolation)"""
import functools
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
from dsflash import quant  # noqa: E402
from dsflash.kernels import indexer_paged_triton as ipt, indexer_topk as ik  # noqa: E402


def encode(x, mx):
    if not mx:
        return {"x": x.astype(jnp.bfloat16)}
    q, s = quant.mxfp4_quant(x, 32)
    return {"q": quant.pack_nibbles(quant.e2m1_codes(q)), "s": quant.f32_pow2_to_e8m0(s)}


def problem(B, S, Hi, Di, P, per_page, seed, grid, mx, cand):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    npool = B * P + 3
    if grid:
        q = jax.random.randint(ks[0], (B, S, Hi, Di), -3, 4).astype(jnp.float32) / 8
        k = jax.random.randint(ks[1], (npool * per_page, Di), -3, 4).astype(jnp.float32) / 2
        w = jax.random.randint(ks[2], (B, S, Hi), -2, 3).astype(jnp.float32) / 4
    else:
        q = jax.random.normal(ks[0], (B, S, Hi, Di))
        k = jax.random.normal(ks[1], (npool * per_page, Di))
        w = jax.random.normal(ks[2], (B, S, Hi)) * 0.1
    pool = encode(k, mx)
    pt = jax.random.permutation(ks[3], npool)[: B * P].reshape(B, P).astype(jnp.int32)
    T = P * per_page
    visible = jax.random.randint(ks[4], (B, S), 0, T + 1).astype(jnp.int32).at[0, 0].set(T)
    used = -(-jnp.max(visible, axis=1) // per_page)                      # pages past every row's reach
    junk = jnp.where(jax.random.bernoulli(ks[5], 0.5, (B, P)), -1, npool + 7)
    pt = jnp.where(jnp.arange(P)[None] < used[:, None], pt, junk)
    valid = jnp.ones((B, S), bool).at[B - 1, S - 1].set(S == 1)
    c = jax.random.uniform(ks[6], (B, S, T)) < 0.6 if cand else None
    return q.astype(jnp.bfloat16), w.astype(jnp.bfloat16), pool, pt, per_page, visible, valid, c


def kernel_scores(q, w, pool, pt, per_page, visible, valid, cand):
    arrays, const, grid, _ = ipt.kernel_args(q, w, pool, pt, per_page, visible, valid, cand)
    B, S = q.shape[:2]
    out = np.zeros((B, S, const["T"]), np.float32)
    ipt._indexer_paged_kernel[grid](*[Fake(np.asarray(a)) for a in arrays], Fake(out), DECODE=0, **const)
    return out


CASES = [  # B, S, Hi, Di, P, per_page, grid, mx, cand
    (2, 3, 16, 32, 5, 16, True, True, False),       # T 80 < one entry tile
    (2, 6, 32, 128, 3, 64, True, True, True),       # the real head shape, candidates
    (1, 1, 16, 64, 9, 32, True, False, False),      # plain pool, T 288 = 2.25 tiles
    (2, 5, 16, 32, 4, 64, False, True, False),      # continuous: 1 bf16 ulp
    (3, 8, 16, 32, 2, 128, False, False, True),
    (1, 9, 16, 32, 2, 64, True, True, False),       # 9 rows: two row blocks of 8
    (2, 6, 2, 64, 4, 32, True, True, True),         # the tiny preset's 2 heads (padded to 16 in the kernel)
    (2, 3, 4, 32, 3, 64, False, True, False),
]


def check(i: int):
    """Case ``i``: the kernel's scores against the reference on the gathered keys (bits on grid inputs)."""
    B, S, Hi, Di, P, pp, grid, mx, cand = CASES[i]
    args = problem(B, S, Hi, Di, P, pp, i, grid, mx, cand)
    q, w, pool, pt, per_page, visible, valid, c = args
    keys = ik.paged_keys(pool, pt, per_page, jnp.bfloat16)
    want = np.asarray(ik.indexer_scores_reference(q, w, keys, visible, valid, c))
    got = kernel_scores(*args)
    fin = np.isfinite(want)
    same_mask = np.array_equal(fin, np.isfinite(got)) and np.array_equal(want[~fin], got[~fin])
    if grid:
        ok = same_mask and np.array_equal(got, want)
    else:
        ok = same_mask and bool(np.all(np.abs(got[fin] - want[fin]) <= np.abs(want[fin]) * 2.0 ** -7 + 1e-30))
    diff = float(np.max(np.abs(np.where(fin, got - want, 0)))) if fin.any() else 0.0
    print(f"{'ok  ' if ok else 'FAIL'} case {i} B{B} S{S} Hi{Hi} Di{Di} T{P * pp} grid={grid} mxfp4={mx} "
          f"cand={cand}: max |diff| {diff:.3g}, finite {int(fin.sum())}/{fin.size}", flush=True)
    assert ok


# each case in its own process, a failed one re-run once (interpret_isolation: the interpreter flake of NOTES.md,
# seen here in session 22's suite -- case 6 wholly wrong once, bit-equal on the re-run)
CHECKS = {f"case-{i}": functools.partial(check, i) for i in range(len(CASES))}


if __name__ == "__main__":
    interpret_isolation.main(__file__, CHECKS)
    if not sys.argv[1:]:
        print("all ok")
