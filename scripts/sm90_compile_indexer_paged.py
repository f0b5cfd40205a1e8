"""sm_90 compile report of the paged indexer scorer (dsflash/kernels/indexer_paged_triton.py) on a CPU-only host.

Records the real launcher's ``triton_call`` (``sm90_compile._Recorder``; arrays as shapes only) at V4.1's decode
shape -- 32 index heads x head dim 128, bf16 queries, an MXFP4 pool ('q' packed nibbles [rows, 64], 's' UE8M0
[rows, 4]), S query rows per sequence, B sequences, C tokens of context -> C / ratio entries in pages of
page_size / ratio entries -- compiles it with ``sm90_compile.compile_kernel`` (triton's bundled ptxas / nvdisasm)
and prints registers, spills, shared memory, occupancy, the grid and waves, and the SASS of the per-row loop.
Usage: python scripts/sm90_compile_indexer_paged.py [--B 32] [--S 6] [--context 131072] [--ratios 1,2] [--cand 0,1]
       [--sass DIR] [--stages N] [--maxnreg R] [--key-decode where|table] [--paired 0|1] [--relu1 0|1]
       [--extra NAME=VALUE ...]   (--extra: constexprs over the launcher's, e.g. an opt-in variant)
--key-decode / --paired / --relu1 set the module switches indexer_paged_triton.KEY_DECODE / PAIRED_ROUND /
RELU_ONE_COMPARE for the recorded launch
(session 30's opt-in candidates); each report also prints the prologue (instructions before the row loop) and the
epilogue after it, per warp.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_compile  # noqa: E402


def launch(B, S, C, ratio, cand, page_size=64, Hi=32, Di=128, extra=None, key_decode=None, paired=None, relu1=None):
    import jax
    import jax.numpy as jnp
    from dsflash.kernels import indexer_paged_triton as ipt
    switches = (ipt.KEY_DECODE, ipt.PAIRED_ROUND, ipt.RELU_ONE_COMPARE)
    if key_decode is not None:
        ipt.KEY_DECODE = key_decode
    if paired is not None:
        ipt.PAIRED_ROUND = bool(paired)
    if relu1 is not None:
        ipt.RELU_ONE_COMPARE = bool(relu1)
    per_page = page_size // ratio
    P = C // page_size
    npool = B * P * per_page + per_page
    rec = sm90_compile._Recorder()
    old = sys.modules.get("jax_triton")
    sys.modules["jax_triton"] = rec
    try:
        sd = jax.ShapeDtypeStruct
        pool = {"q": sd((npool, Di // 2), jnp.uint8), "s": sd((npool, Di // 32), jnp.uint8)}
        args = (sd((B, S, Hi, Di), jnp.bfloat16), sd((B, S, Hi), jnp.bfloat16), sd((B, P), jnp.int32),
                sd((B, S), jnp.int32), sd((B, S), bool), sd((B, S, P * per_page), bool) if cand else None)
        jax.eval_shape(lambda q, w, pt, vis, val, c, pl: ipt.indexer_scores_paged_triton(q, w, pl, pt, per_page, vis,
                                                                                         val, c), *args, pool)
    finally:
        ipt.KEY_DECODE, ipt.PAIRED_ROUND, ipt.RELU_ONE_COMPARE = switches
        if old is None:
            sys.modules.pop("jax_triton", None)
        else:
            sys.modules["jax_triton"] = old
    (c,) = rec.calls
    if extra:
        c["constexprs"].update(extra)
    return c


def report(B, S, C, ratio, cand, extra=None, sass=None, stages=None, options=None, key_decode=None, paired=None,
           relu1=None):
    c = launch(B, S, C, ratio, cand, extra=extra, key_decode=key_decode, paired=paired, relu1=relu1)
    if stages:
        c["num_stages"] = stages
    fn = c["kernel"]
    names = [p.name for p in fn.params if not p.is_constexpr]
    sig = {n: "*" + t for n, t in zip(names, c["args"])}
    kw = c["constexprs"]
    label = (f"_indexer_paged_kernel B={B} S={S} C={C} ratio={ratio} T={kw['T']} grid {c['grid']} "
             + " ".join(f"{k}={kw[k]}" for k in ("SB", "BT", "HAS_CAND", "DECODE", "KTAB", "PAIR", "RELU1") if k in kw)
             + "".join(f" {k}={v}" for k, v in {**(extra or {}), **(options or {})}.items()))
    r = sm90_compile.compile_kernel(fn, sig, kw, num_warps=c["num_warps"], num_stages=c["num_stages"], label=label,
                                    **(options or {}))
    if sass:
        os.makedirs(sass, exist_ok=True)
        sw = "".join(f"_{k.lower()}{kw[k]}" for k in ("KTAB", "PAIR", "RELU1") if kw.get(k))
        stem = os.path.join(sass, f"ratio{ratio}_cand{int(cand)}_s{c['num_stages']}{sw}"
                            + "".join(f"_{k}{v}" for k, v in {**(extra or {}), **(options or {})}.items()))
        for ext, text in (("sass", r.sass), ("ptx", r.ptx), ("ptxas.log", r.ptxas_log)):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(text)
    return c, r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--S", type=int, default=6)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--ratios", default="1,2")
    ap.add_argument("--cand", default="0")
    ap.add_argument("--sass", default=None)
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--stages", type=int, default=None, help="override the launch's num_stages")
    ap.add_argument("--maxnreg", type=int, default=None, help="compile option maxnreg")
    ap.add_argument("--key-decode", default=None, choices=("where", "table"),
                    help="indexer_paged_triton.KEY_DECODE for the launch (default: the module's)")
    ap.add_argument("--paired", type=int, default=None, choices=(0, 1),
                    help="indexer_paged_triton.PAIRED_ROUND for the launch (default: the module's)")
    ap.add_argument("--relu1", type=int, default=None, choices=(0, 1),
                    help="indexer_paged_triton.RELU_ONE_COMPARE for the launch (default: the module's)")
    a = ap.parse_args(argv)
    extra = {k: sm90_compile._value(v) for k, v in (s.split("=", 1) for s in a.extra)}
    for ratio in (int(x) for x in a.ratios.split(",")):
        for cand in (int(x) for x in a.cand.split(",")):
            c, r = report(a.B, a.S, a.context, ratio, cand, extra, a.sass, a.stages,
                          {"maxnreg": a.maxnreg} if a.maxnreg else None, a.key_decode, a.paired, a.relu1)
            print(r.summary(a.top))
            lp = r.main_loop
            if lp is not None:
                n = sum(r.ops.values())
                print(f"   prologue {lp.start} SASS before the row loop, loop {lp.n}, after it {n - lp.end - 1} "
                      f"(per warp and program: {lp.start} + {c['constexprs']['SB']} x {lp.n} + {n - lp.end - 1} = "
                      f"{lp.start + c['constexprs']['SB'] * lp.n + n - lp.end - 1})")
            g = c["grid"]
            progs = g[0] * g[1]
            occ = sm90_compile._occupancy(r.regs, r.num_warps, r.smem)
            per_sm = int(occ.split()[0]) if occ[0].isdigit() else 0
            print(f"   grid {g} = {progs} programs; {per_sm} a SM x 132 SMs = {per_sm * 132} resident -> "
                  f"{progs / max(1, per_sm * 132):.1f} waves", flush=True)


if __name__ == "__main__":
    main()
