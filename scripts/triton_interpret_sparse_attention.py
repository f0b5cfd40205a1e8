"""CPU check of the Triton sparse sink attention kernels' logic in Triton's interpreter (TRITON_INTERPRET=1).

Runs every kernel kind of ``sparse_attention_triton`` (the fused two-pass kernel at several DV, and the split
path: chunk maxima -> chunk P.V partials -> XLA combine, at several chunk sizes incl. ones that do not divide K)
on numpy buffers at small shapes and compares with ``sparse_sink_attention_reference`` (fp32 and bf16 cases, idx
with -1 holes, a row with no valid entry, K not a multiple of the block). The interpreter's bf16 dot is wrong, so
the kernels' IEEE flag (fp32 dots of the same bf16 values: products are exact, so it is the same math) is set.
Each (config, case) check runs in its own process, a failed one re-run once (``interpret_isolation``).
Usage: python scripts/triton_interpret_sparse_attention.py [--list | --check NAME]   (needs `pip install triton`)"""
import dataclasses
import gc
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
from dsflash.kernels import sparse_attention as sa, sparse_attention_triton as sat  # noqa: E402


def _np(a):
    # owned, writable copies: never hand the interpreter a zero-copy view of a jax buffer
    return np.array(a, copy=True)


def run_kernel(cfg, q, kv, idx, sink, scale, precision):
    B, S, H, D = q.shape
    N, K, R = kv.shape[1], idx.shape[2], B * S
    dv = min(cfg.DV, D)
    ka = sat.launch_args(cfg, B, S, H, D, N, K, scale, precision, jnp.float32)   # IEEE=1 always here
    p_bf16 = int(precision != "fp32")
    qn, kvn, idn, skn = _np(q), _np(kv), _np(idx), _np(sink)
    if cfg.kind == "fused":
        out = np.zeros((B, S, H, D), np.float32)
        sat._fused_kernel[(R, D // dv)](Fake(qn), Fake(kvn), Fake(idn), Fake(skn), Fake(out), DV=dv, P_BF16=p_bf16,
                                        **ka)
        return out
    ch = sat.split_chunk(cfg, R, D, K)
    ns = -(-K // ch)
    mpart = np.full((R, ns, H), np.nan, np.float32)          # NaN-filled: a slot left unwritten shows up
    accp = np.full((R, ns, H, D), np.nan, np.float32)
    denp = np.full((R, ns, H), np.nan, np.float32)
    sat._chunk_max_kernel[(R, ns)](Fake(qn), Fake(kvn), Fake(idn), Fake(mpart), CH=ch, NS=ns, **ka)
    sat._chunk_pv_kernel[(R, ns, D // dv)](Fake(qn), Fake(kvn), Fake(idn), Fake(mpart), Fake(accp), Fake(denp),
                                           DV=dv, CH=ch, NS=ns, P_BF16=p_bf16, **ka)
    assert not (np.isnan(mpart).any() or np.isnan(accp).any() or np.isnan(denp).any()), "unwritten partials"
    return np.asarray(sat.split_combine(jnp.asarray(mpart), jnp.asarray(accp), jnp.asarray(denp), sink,
                                        (B, S, H, D), jnp.float32))


def run(cfg, B=2, S=3, H=16, D=64, N=50, K=40, precision="reference", dtype=jnp.bfloat16, seed=0, sink_shift=0.0,
        label=""):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(dtype)
    kv = jax.random.normal(ks[1], (B, N, D), jnp.float32).astype(dtype)
    idx = jax.random.randint(ks[2], (B, S, K), 0, N, jnp.int32)
    idx = jnp.where(jax.random.uniform(ks[3], (B, S, K)) < 0.3, -1, idx)
    if B * S > 1:
        idx = idx.at[B - 1, S - 1].set(-1)               # a row with no valid entry
    sink = jax.random.normal(ks[4], (H,), jnp.float32) + sink_shift
    scale = D ** -0.5
    ref = np.asarray(sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=jnp.float32,
                                                        precision=precision))
    # Known flake (NOTES.md), cause not found: now and then a kernel run in the interpreter computes a wholly
    # wrong (but repeatable) result or leaves stores unlanded; reproduced 2026-11-30 with owned input copies, the
    # reference awaited and OPENBLAS_NUM_THREADS=1; turning the cyclic GC off (below) did not prevent it. Worked
    # around by running each check in a fresh process, re-run once on failure (``interpret_isolation``).
    gc.collect()
    gc.disable()
    try:
        with np.errstate(over="ignore"):   # exp(sink - (-1e30)) = inf for the empty row, as in the reference
            out = run_kernel(cfg, q, kv, idx, sink, scale, precision)
    finally:
        gc.enable()
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    empty = np.abs(out[B - 1, S - 1]).max()
    ch = sat.split_chunk(cfg, B * S, D, K) if cfg.kind == "split" else K
    print(f"{label:>18} BK{cfg.BK} DV{min(cfg.DV, D)} CH{ch} | B{B} S{S} H{H} D{D} K{K} {precision} "
          f"{jnp.dtype(dtype).name}: rel err {rel:.2e}, max abs {np.abs(out - ref).max():.2e}, "
          f"empty row max {empty:.1e}")
    assert np.all(np.isfinite(out))
    if B * S > 1:
        assert empty == 0.0, empty
    return rel


def small(name, **kw):
    cfg = sat.NAMED_CONFIGS[name]
    # the interpreter is slow: shrink BK / DV / CH to the small shapes, keep the kind
    return dataclasses.replace(cfg, **kw)


def checks():
    """{name: check}: every (config, case) pair, then the production configs at the real head shape. Each runs in
    its own process (``interpret_isolation``)."""
    cases = [
        dict(),                                                                  # bf16, K=40 (not a BK multiple)
        dict(precision="fp32", dtype=jnp.float32, seed=1),
        dict(K=64, D=128, seed=2, sink_shift=3.0),
        dict(B=1, S=1, H=32, D=256, N=700, K=200, seed=3),                        # one row, long K
    ]
    cfgs = [
        ("fused_dv128", lambda: small("fused_dv128", BK=16, DV=32)),             # v1 layout (D/DV programs)
        ("fused_dv512", lambda: small("fused_dv512", BK=16)),                    # all channels, QK twice
        ("split_ch128_dv128", lambda: small("split_ch128_dv128", BK=16, CH=32, DV=32)),  # ragged last chunk at K=40
        ("split_ch64_dv128", lambda: small("split_ch64_dv128", BK=16, CH=16, DV=64)),
        ("split_auto_dv256", lambda: small("split_auto_dv256", BK=16)),          # CH from the row count
    ]
    out = {}

    def check(cfg_fn, label, kw):
        def f():
            rel = run(cfg_fn(), label=label, **kw)
            assert rel < 1e-5, rel
        return f
    for label, cfg_fn in cfgs:
        for j, c in enumerate(cases):
            out[f"{label}.{j}"] = check(cfg_fn, label, c)
    # the real V4.1 head count / width at one row, K = 640 (window + compressed), with the production configs
    for name in ("fused_dv512", "split_ch128_dv128"):
        out[f"prod.{name}"] = check(lambda n=name: sat.NAMED_CONFIGS[n], name,
                                    dict(B=1, S=1, H=64, D=512, N=700, K=640, seed=4))
    return out


if __name__ == "__main__":
    interpret_isolation.main(__file__, checks())
