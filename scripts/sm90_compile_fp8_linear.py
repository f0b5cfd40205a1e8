"""sm_90 compile report of the dense FP8 linear kernel (dsflash/kernels/fp8_linear_triton.py) on a CPU-only host.

Records the real launcher's ``triton_call``s (``sm90_compile._Recorder``, weights as shapes only) for a named config
at a row count and one of V4.1's dense FP8 linears, compiles each kernel with ``sm90_compile.compile_kernel``
(triton's bundled ptxas / nvdisasm) and prints registers, spills, shared memory, wgmma / mma.sync use and the main
loop's SASS per weight element.
Usage: python scripts/sm90_compile_fp8_linear.py [--configs decode,prefill] [--rows 6,192] [--shapes all|wq_a,...]
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_compile  # noqa: E402

# V4.1's dense FP8-stored linears, [N, K] (out, in); wo_a is grouped in the model (8 groups, applied as bf16 there)
SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
          "wo_a": (8192, 4096), "sh_w13": (2304, 5120), "sh_w2": (5120, 2304)}


def launches(config, M, N, K, precision="reference"):
    import jax
    import jax.numpy as jnp
    from dsflash.kernels import fp8_linear_triton as ft
    rec = sm90_compile._Recorder()
    old = sys.modules.get("jax_triton")
    sys.modules["jax_triton"] = rec
    try:
        x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((N, K), jnp.uint8)
        s = jax.ShapeDtypeStruct((N // 32, K // 32), jnp.uint8)
        jax.eval_shape(lambda x_: ft.fp8_linear_triton(x_, w, s, precision=precision, config=config), x)
    finally:
        if old is None:
            sys.modules.pop("jax_triton", None)
        else:
            sys.modules["jax_triton"] = old
    return ft.plan(ft.named_config(config), M, N, K), rec.calls


def reports(config, M, N, K, precision="reference"):
    pl, calls = launches(config, M, N, K, precision)
    out = []
    for c in calls:
        fn = c["kernel"]
        names = [p.name for p in fn.params if not p.is_constexpr]
        sig = {n: "*" + t for n, t in zip(names, c["args"])}
        main = fn.__name__ in ("_fp8_linear_kernel", "_fp8_linear_lastred_kernel")
        kw = c["constexprs"]
        label = (f"{config} M={M} N={N} K={K} {fn.__name__} grid {c['grid']} "
                 + " ".join(f"{k}={v}" for k, v in kw.items() if k in ("BM", "BN", "BK", "KS", "SWAP", "ACT_RT")))
        out.append(sm90_compile.compile_kernel(fn, sig, kw, num_warps=c["num_warps"], num_stages=c["num_stages"],
                                               label=label, loop_elems=kw["BN"] * kw["BK"] if main else 0))
    return pl, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="decode")
    ap.add_argument("--rows", default="6,192")
    ap.add_argument("--shapes", default="wq_a")
    ap.add_argument("--precision", default="reference", choices=("reference", "bf16"))
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--brief", action="store_true", help="one line per kernel")
    a = ap.parse_args(argv)
    shapes = list(SHAPES) if a.shapes == "all" else a.shapes.split(",")
    for cfg in a.configs.split(","):
        for M in (int(m) for m in a.rows.split(",")):
            for sh in shapes:
                N, K = SHAPES[sh]
                pl, reps = reports(cfg, M, N, K, a.precision)
                for r in reps:
                    if a.brief:
                        lp = r.main_loop
                        pe = r.per_elem()
                        f = r.features
                        print(f"{sh:7s} {cfg:12s} M={M:<5d} {r.name:22s} grid={pl['grid'] if '_kernel' in r.name else ''}"
                              f" regs {r.regs} spills {r.spill_stores}/{r.spill_loads} smem {r.smem} "
                              f"HGMMA {f.get('HGMMA(sass)', 0)} HMMA {f.get('HMMA(sass)', 0)} "
                              f"loop {lp.n if lp else '-'} per-elem {pe:.2f}" if pe else
                              f"{sh:7s} {cfg:12s} M={M:<5d} {r.name:22s} regs {r.regs} spills "
                              f"{r.spill_stores}/{r.spill_loads} smem {r.smem}", flush=True)
                    else:
                        print(r.summary(a.top), flush=True)


if __name__ == "__main__":
    main()
