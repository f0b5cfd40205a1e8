"""CPU check of the Triton sparse sink attention kernels' logic in Triton's interpreter (TRITON_INTERPRET=1).

Runs every kernel kind of ``sparse_attention_triton`` (the fused two-pass kernel at several DV, and the split
path: chunk maxima -> chunk P.V partials -> XLA combine, at several chunk sizes incl. ones that do not divide K)
on numpy buffers at small shapes and compares with ``sparse_sink_attention_reference`` (fp32 and bf16 cases, idx
with -1 holes, a row with no valid entry, K not a multiple of the block). The interpreter's bf16 dot is wrong, so
the kernels' IEEE flag (fp32 dots of the same bf16 values: products are exact, so it is the same math) is set.
Each (config, case) check runs in its own process, a failed one re-run once (``interpret_isolation``).
v3 ("flash", ``flash.*`` / ``prod.flash*`` checks) goes through the real launcher ``sparse_sink_attention_triton``
with a jax_triton stand-in (outputs NaN-poisoned, so an unwritten element shows), and is checked against the per
element error band of ``sat.flash_bound`` (vs the bf16-P reference and vs the fp32 reference; it rounds P against
a running max, so it is not bit-comparable). ``mutant.*`` checks feed the kernel a wrong scale / sink / empty slots read
as row 0, and PASS only when that band is violated (the check is not vacuous). ``rope.*`` checks: the flash kernel
with RoPE applied to q and inverted on o in the kernel (``rope`` argument; band carried through the rotation), and
``_rope_tail``'s bits against ``rope.rotate_tail`` (bf16 rounding, forward and inverse); ``mutant.rope`` passes
only when a wrong table breaks the band.
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from dsflash.kernels import rope as rp, sparse_attention as sa, sparse_attention_triton as sat  # noqa: E402


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


def _inputs(B, S, H, D, N, K, dtype, seed, sink_shift, poison_row0=False, empty_prefix=0):
    """Random q / kv / idx (30 % empty slots, the last row wholly empty) / sink. ``poison_row0``: kv row 0 set
    to 8.0 and never selected (ids in [1, N)), so an empty slot read as row 0 shows in the output;
    ``empty_prefix``: row 0's first entries set to -1 (whole empty blocks or splits)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(dtype)
    kv = jax.random.normal(ks[1], (B, N, D), jnp.float32).astype(dtype)
    if poison_row0:
        kv = kv.at[:, 0].set(8.0)
    idx = jax.random.randint(ks[2], (B, S, K), 1 if poison_row0 else 0, N, jnp.int32)
    idx = jnp.where(jax.random.uniform(ks[3], (B, S, K)) < 0.3, -1, idx)
    if empty_prefix:
        idx = idx.at[0, 0, :empty_prefix].set(-1)
    if B * S > 1:
        idx = idx.at[B - 1, S - 1].set(-1)               # a row with no valid entry
    sink = jax.random.normal(ks[4], (H,), jnp.float32) + sink_shift
    return q, kv, idx, sink, D ** -0.5


def run(cfg, B=2, S=3, H=16, D=64, N=50, K=40, precision="reference", dtype=jnp.bfloat16, seed=0, sink_shift=0.0,
        label=""):
    q, kv, idx, sink, scale = _inputs(B, S, H, D, N, K, dtype, seed, sink_shift)
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


class _JtShim:
    """Stand-in for jax_triton.triton_call: the kernel run by the interpreter on owned numpy copies; every output is
    NaN-poisoned first (integer outputs: -7), so an element the kernel does not write fails the finiteness check --
    except an output aliased to an input (``input_output_aliases``), which is that input's buffer, as on the GPU."""

    @staticmethod
    def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=1, input_output_aliases=None,
                    enable_fp_fusion=True, **kw):
        multi = isinstance(out_shape, (tuple, list))
        shapes = out_shape if multi else (out_shape,)
        outs = [np.full(o.shape, np.nan if jnp.issubdtype(o.dtype, jnp.floating) else -7, o.dtype) for o in shapes]
        ins = [Fake(_np(a)) for a in args]
        for i, o in (input_output_aliases or {}).items():
            outs[o] = ins[i].a
        fakes = [Fake(o) for o in outs]
        for i, o in (input_output_aliases or {}).items():
            ins[i] = fakes[o]
        kernel[tuple(grid)](*ins, *fakes, **kw)
        res = [f.a for f in fakes]
        for r in res:
            assert not np.isnan(np.asarray(r, np.float32)).any(), f"{kernel.__name__}: unwritten output elements"
        return tuple(res) if multi else res[0]


def _rope_inputs(B, S, D, seed, rd=None):
    """A (cos, sin) table [B, S, rd/2] of random positions < 20000 with the model's frequencies (base 10000)."""
    rd = rd or min(64, D // 2)
    pos = jax.random.randint(jax.random.PRNGKey(seed + 100), (B, S), 0, 20000, jnp.int32)
    omega = 10000.0 ** (-2.0 * np.arange(rd // 2) / rd)
    return rp.rope_table(pos, omega.astype(np.float32))


def _pair_band(tol, rd):
    """A per-element band carried through a rotation of the last rd channels' pairs: |c e0 -/+ s e1| <= tol0 + tol1."""
    t = np.array(tol, copy=True)
    tail = t[..., -rd:].reshape(*t.shape[:-1], rd // 2, 2)
    t[..., -rd:] = np.repeat(tail.sum(-1), 2, axis=-1)
    return t


def run_flash(cfg, B=2, S=3, H=16, D=64, N=50, K=40, precision="reference", dtype=jnp.bfloat16, seed=0,
              sink_shift=0.0, label="", empty_prefix=0, mutate=None, rope=False):
    """v3 through the real launcher (jax_triton stand-in). Inputs are bf16 values; the kernel gets them as fp32
    arrays (IEEE dots: the interpreter's bf16 dot is wrong; products of bf16 values are exact in fp32) and rounds P
    with the same integer RNE as on the GPU. Returns (ok, message): ok = inside the error band everywhere, no NaN,
    a row with no valid entry exactly 0. ``empty_prefix``: row 0's first entries set to -1 (whole empty splits).
    ``mutate``: "scale" (kernel scale x 1.01), "sink" (kernel sink + 0.25) or "leak" (the kernel gets row 0 where
    the reference has an empty slot), "rope" (the kernel's sin table negated) -- must break the band. ``rope``: a
    (cos, sin) table given (q rotated / o inverted in the kernel; the reference gets q in fp32, as the kernel does,
    and the band is carried through the inverse rotation, ``_pair_band``)."""
    sys.modules["jax_triton"] = _JtShim
    q, kv, idx, sink, scale = _inputs(B, S, H, D, N, K, dtype, seed, sink_shift, poison_row0=True,
                                      empty_prefix=empty_prefix)
    table = _rope_inputs(B, S, D, seed) if rope or mutate == "rope" else None
    qr = q if table is None else q.astype(jnp.float32)
    ref = np.asarray(sa.sparse_sink_attention_reference(qr, kv, idx, sink, scale, out_dtype=jnp.float32,
                                                        precision=precision, rope=table))
    ref32 = np.asarray(sa.sparse_sink_attention_reference(qr, kv, idx, sink, scale, out_dtype=jnp.float32,
                                                          precision="fp32", rope=table))
    A = np.asarray(sat.flash_weights_abs(rp.rope_q(qr, table), kv, idx, sink, scale))
    k_table = table if mutate != "rope" else (table[0], -table[1])
    k_scale = scale * (1.01 if mutate == "scale" else 1.0)
    k_sink = sink + (0.25 if mutate == "sink" else 0.0)
    k_idx = jnp.where(idx < 0, 0, idx) if mutate == "leak" else idx   # empty slots turned into row-0 reads
    hs = sat.flash_heads(cfg, H)
    ns, bps = sat.flash_plan(cfg, B * S, K, hs)
    gc.collect()
    gc.disable()
    try:
        with np.errstate(over="ignore"):
            out = np.asarray(sat.sparse_sink_attention_triton(
                q.astype(jnp.float32), kv.astype(jnp.float32), k_idx, k_sink, k_scale, out_dtype=jnp.float32,
                precision=precision, config=cfg, rope=k_table, rope_in_kernel=True))
    finally:
        gc.enable()
    rounds = 0 if precision == "fp32" else 2
    band = (lambda t: t) if table is None else (lambda t: _pair_band(t, 2 * table[0].shape[-1]))
    viol_ref = np.abs(out - ref) / band(sat.flash_bound(A, ref, rounds))
    viol_32 = np.abs(out - ref32) / band(sat.flash_bound(A, ref32, min(rounds, 1)))
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    rel32 = np.linalg.norm(out - ref32) / np.linalg.norm(ref32)
    empty = np.abs(out[B - 1, S - 1]).max() if B * S > 1 else 0.0
    msg = (f"{label:>18} BK{cfg.BK} NS{ns} BPS{bps} HS{hs} | B{B} S{S} H{H} D{D} K{K} {precision}"
           f"{' rope' if table is not None else ''} "
           f"{'mutant ' + mutate if mutate else ''}: rel err vs ref {rel:.2e}, vs fp32 ref {rel32:.2e}; "
           f"max |err| / band: vs ref {viol_ref.max():.3f}, vs fp32 {viol_32.max():.3f}; empty row max {empty:.1e}")
    ok = bool(np.all(np.isfinite(out)) and viol_ref.max() <= 1.0 and viol_32.max() <= 1.0 and empty == 0.0
              and rel < 5e-3)
    return ok, msg


@triton.jit
def _tail_probe(x_ptr, c_ptr, s_ptr, o_ptr, H: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
                INVERSE: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    rows = x_ptr + row * (H * D) + tl.arange(0, H)[:, None] * D
    r = sat._rope_tail(rows, c_ptr + row * (RD // 2), s_ptr + row * (RD // 2), D, RD, INVERSE, ROUND)
    tl.store(o_ptr + row * (H * RD) + tl.arange(0, H)[:, None] * RD + tl.arange(0, RD)[None, :], r)


def run_tail_bits(inverse, label="", B=2, S=3, H=16, D=128, seed=20):
    """``_rope_tail`` on bf16 values (passed as fp32) with ROUND = 1 against ``rope.rotate_tail`` on the bf16 array:
    the same bits in every element (fp32 products and sums in the same order, then RNE to bf16)."""
    x = (jax.random.normal(jax.random.PRNGKey(seed), (B, S, H, D), jnp.float32) * 3).astype(jnp.bfloat16)
    c, s = _rope_inputs(B, S, D, seed)
    rd = 2 * c.shape[-1]
    want = np.asarray(rp.rotate_tail(x, c[:, :, None], s[:, :, None], inverse=inverse).astype(jnp.float32))
    out = np.full((B * S, H, rd), np.nan, np.float32)
    _tail_probe[(B * S,)](Fake(_np(x.astype(jnp.float32))), Fake(_np(c)), Fake(_np(s)), Fake(out), H=H, D=D, RD=rd,
                          INVERSE=int(inverse), ROUND=1)
    got = out.reshape(B, S, H, rd)
    diff = int((got.view(np.uint32) != want[..., -rd:].view(np.uint32)).sum())
    ok = diff == 0 and np.array_equal(np.asarray(x.astype(jnp.float32))[..., :-rd], want[..., :-rd])
    return ok, f"rope tail bits {'inverse' if inverse else 'forward'}: {diff} of {got.size} elements differ"


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
    # v3 ("flash"): real launcher, error band (see run_flash). BK shrunk to 16 at the small shapes so that the
    # splits are ragged (K=40: 3 blocks -> NS=2 gives splits of 2 + 1 blocks) and the auto planner splits.
    fcases = cases + [dict(B=1, S=2, H=16, D=64, N=80, K=64, seed=5, empty_prefix=48)]   # row 0: 3 empty blocks

    def fcheck(cfg_fn, label, kw, expect_ok=True):
        return interpret_isolation.expect(run_flash, cfg_fn, label, kw, expect_ok)
    fcfgs = [
        ("flash_auto", lambda: small("flash_bk64", BK=16)),                      # NS from the row count
        ("flash_ns2", lambda: small("flash_bk64", BK=16, NS=2)),                 # split + XLA combine, ragged
        ("flash_ns1", lambda: small("flash_bk64_ns1", BK=16)),                   # one program per row, final store
    ]
    for label, cfg_fn in fcfgs:
        for j, c in enumerate(fcases):
            out[f"flash.{label}.{j}"] = fcheck(cfg_fn, label, c)
    prod = dict(H=64, D=512, N=700, K=640)
    out["prod.flash_bk64.B1"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk64"], "flash_bk64",
                                       dict(prod, B=1, S=1, seed=6))                       # auto: NS=10
    out["prod.flash_bk32.B1"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk32"], "flash_bk32",
                                       dict(prod, B=1, S=1, seed=7))                       # auto: NS=20
    out["prod.flash_bk64_ns1.B2"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk64_ns1"], "flash_bk64_ns1",
                                           dict(prod, B=2, S=1, seed=8, empty_prefix=200))  # row 1 all -1
    out["prod.flash_bk64_ns4.B1S2"] = fcheck(lambda: small("flash_bk64", NS=4), "flash_bk64_ns4",
                                             dict(prod, B=1, S=2, seed=9, empty_prefix=192))  # split 0 empty
    out["prod.flash_bk32_ns1.fp32"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk32_ns1"], "flash_bk32_ns1",
                                             dict(prod, B=1, S=2, seed=10, precision="fp32", dtype=jnp.float32))
    # head split (HS, 2026-12-01): grid (rows, NS, HS), H / HS heads per program; H = 64 at small D so that HS = 4
    # really splits (H = 32: capped to 2 groups of 16, H = 16: no split); NS auto / forced 1 (final-output kernel,
    # grid (rows, 1, HS)) / forced 2 (ragged); empty splits, a row with no valid entry, the fp32-P path
    hcases = [dict(H=64), dict(H=64, precision="fp32", dtype=jnp.float32, seed=1),
              dict(B=1, S=2, H=64, D=64, N=80, K=64, seed=5, empty_prefix=48),       # row 0: 3 empty blocks
              dict(B=1, S=1, H=32, D=256, N=700, K=200, seed=3), dict()]
    for label, cfg_fn in [("hs4_auto", lambda: small("flash_bk64_hs4", BK=16)),
                          ("hs4_ns1", lambda: small("flash_bk64_hs4", BK=16, NS=1)),
                          ("hs4_ns2", lambda: small("flash_bk32_hs4", BK=16, NS=2))]:
        for j, c in enumerate(hcases):
            out[f"flash.{label}.{j}"] = fcheck(cfg_fn, label, c)
    out["prod.flash_bk64_hs4.B1"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk64_hs4"], "flash_bk64_hs4",
                                           dict(prod, B=1, S=1, seed=14))                  # auto: NS=10, 40 programs
    out["prod.flash_bk32_hs4.B1S2"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk32_hs4"], "flash_bk32_hs4",
                                             dict(prod, B=1, S=2, seed=15, empty_prefix=96))  # NS 10: split 0 empty
    out["prod.flash_bk64_hs4_ns1.B2"] = fcheck(lambda: small("flash_bk64_hs4", NS=1), "flash_bk64_hs4_ns1",
                                               dict(prod, B=2, S=1, seed=16, empty_prefix=200))  # row 1 all -1
    # not vacuous: a 1 % wrong scale, or a sink off by 0.25 where the sink carries real mass, must break the band
    out["mutant.scale"] = fcheck(lambda: small("flash_bk64", BK=16, NS=2), "flash_ns2",
                                 dict(seed=11, mutate="scale"), expect_ok=False)
    out["mutant.sink"] = fcheck(lambda: small("flash_bk64", BK=16, NS=2), "flash_ns2",
                                dict(seed=12, sink_shift=6.0, mutate="sink"), expect_ok=False)
    out["mutant.leak"] = fcheck(lambda: small("flash_bk64", BK=16, NS=2), "flash_ns2",
                                dict(seed=13, mutate="leak"), expect_ok=False)
    out["mutant.scale.hs4"] = fcheck(lambda: small("flash_bk64_hs4", BK=16, NS=2), "hs4_ns2",
                                     dict(H=64, seed=11, mutate="scale"), expect_ok=False)
    out["mutant.scale.prod"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk64"], "flash_bk64",
                                      dict(prod, B=1, S=1, seed=6, mutate="scale"), expect_ok=False)
    # RoPE in the kernel (session 21): q's tail rotated into o's tail before the loop, o's tail rotated back after the
    # store (NS = 1); NS > 1 rotates in XLA around the split kernel; the real head shape with V4.1's rd = 64
    for inverse in (False, True):
        out[f"rope.tail_bits.{'inv' if inverse else 'fwd'}"] = interpret_isolation.expect(
            run_tail_bits, lambda inv=inverse: inv, "tail", {})
    out["rope.flash_ns1"] = fcheck(lambda: small("flash_bk64_ns1", BK=16), "flash_ns1", dict(rope=True, D=128))
    out["rope.flash_ns2"] = fcheck(lambda: small("flash_bk64", BK=16, NS=2), "flash_ns2", dict(rope=True, D=128))
    out["rope.hs4_ns1"] = fcheck(lambda: small("flash_bk64_hs4", BK=16, NS=1), "hs4_ns1",
                                 dict(H=64, rope=True, D=128, seed=3))
    out["rope.prod.flash_bk64_ns1.B2"] = fcheck(lambda: sat.NAMED_CONFIGS["flash_bk64_ns1"], "flash_bk64_ns1",
                                                dict(prod, B=2, S=1, seed=8, empty_prefix=200, rope=True))
    out["mutant.rope"] = fcheck(lambda: small("flash_bk64_ns1", BK=16), "flash_ns1",
                                dict(D=128, seed=21, mutate="rope"), expect_ok=False)
    # the real V4.1 head count / width at one row, K = 640 (window + compressed), with the production configs
    for name in ("fused_dv512", "split_ch128_dv128"):
        out[f"prod.{name}"] = check(lambda n=name: sat.NAMED_CONFIGS[n], name,
                                    dict(B=1, S=1, H=64, D=512, N=700, K=640, seed=4))
    return out


if __name__ == "__main__":
    interpret_isolation.main(__file__, checks())
