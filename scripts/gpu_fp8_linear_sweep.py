"""The FP8 dense linear kernel's configs at the decode row counts, kernel by kernel (issue 19: at 32 x 6 rows the
dense linears are 1.4 ms of the 10.3 ms step at 11-20 % of their floors). Per V4.1 weight shape and M, each config
of ``fp8_linear_triton`` (named ones + candidates for the 64-384-row band) and XLA's path (the reference:
dequantised bf16 copy + cuBLAS) are timed as 16 unrolled calls on distinct inputs in one program (so the host's
dispatch is paid once, not per call), checked against the reference (max |diff| / max |ref|), and set against the
call's floor (weight bytes / read bandwidth, 2 M N K / bf16 GEMM rate). Each of the 16 calls has its own weight
(separate arguments: with one shared weight XLA computes its dequantised copy once for all 16 calls, which
flattered XLA 2-3x in the first run of this script, run 28), and the time is the kernels' busy time in a
``jax.profiler`` trace (``bench.step_profile.profile_step``) per call, beside the wall time per call. Table last,
JSON in $OUT/fp8_sweep.json:

  python3 scripts/gpu_fp8_linear_sweep.py --rows 6 192 --out $OUT
  python3 scripts/gpu_fp8_linear_sweep.py --rows 192 --configs decode_bn128 dec_bn128_lastred --out $OUT   # by name
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
          "shared_w13": (2304, 5120), "shared_w2": (5120, 2304)}
CALLS = 16


def candidates(names=None):
    """``names``: configs by name (``fp8_linear_triton.named_config``: defaults or kernels/experimental/fp8_configs.py's
    candidates); None: the run-29 set below."""
    from dsflash.kernels.fp8_linear_triton import NAMED_CONFIGS, Fp8LinearConfig, named_config
    if names:
        return {n: named_config(n) for n in names}
    c = {k: v for k, v in NAMED_CONFIGS.items() if k in ("decode", "decode_bn128", "prefill")}
    c["sw_bm128"] = Fp8LinearConfig(BM_MAX=128)                                     # 2 row tiles at 192
    c["sw_bm256_w8"] = Fp8LinearConfig(BM_MAX=256, warps=8)                          # 1 row tile: weights read once
    c["ns_bm64_bn128"] = Fp8LinearConfig(BM=64, BN=128, BK=128, swap=False, warps=4, stages=4)
    c["ns_bm128_bn64"] = Fp8LinearConfig(BM=128, BN=64, BK=128, swap=False, warps=8, stages=3)
    c["ns_bm64_bn64"] = Fp8LinearConfig(BM=64, BN=64, BK=128, swap=False, warps=4, stages=4)
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[6, 192])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--read-tbs", type=float, default=4.4, help="streaming read bandwidth for the floor, TB/s")
    ap.add_argument("--gemm-tflops", type=float, default=800.0, help="bf16 GEMM rate for the floor, TFLOP/s")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="config names to time beside XLA (default: run 29's set, see candidates())")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsflash import quant
    from dsflash.bench import step_profile as SP
    from dsflash.kernels import fp8_linear as fl, fp8_linear_triton as flt

    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(a), "points": []}
    cfgs = candidates(a.configs)
    key = jax.random.PRNGKey(0)
    for name in a.shapes:
        N, K = SHAPES[name]
        quantize = jax.jit(quant.quantize_fp8_weight)
        wts = [quantize(jax.random.normal(jax.random.fold_in(key, N * K + i), (N, K), jnp.float32) * 0.02)
               for i in range(CALLS)]
        ws, ss = [w for w, _ in wts], [s_ for _, s_ in wts]
        for M in a.rows:
            xs = [jax.random.normal(jax.random.fold_in(key, M * 100 + i), (M, K), jnp.float32).astype(jnp.bfloat16)
                  for i in range(CALLS)]
            ref = jax.jit(lambda x, w, s_: fl.fp8_linear_reference(x, w, s_))(xs[0], ws[0], ss[0]).astype(jnp.float32)
            floor = max(N * K * (1 + 1 / 1024) / (a.read_tbs * 1e12), 2 * M * N * K / (a.gemm_tflops * 1e12)) * 1e3
            fns = {"xla": lambda x, w, s_: fl.fp8_linear_reference(x, w, s_)}
            for cn, cfg in cfgs.items():
                fns[cn] = lambda x, w, s_, cfg=cfg: flt.fp8_linear_triton(x, w, s_, config=cfg)
            for fn_name, fn in fns.items():
                if M <= 16 and not a.configs and fn_name not in ("xla", "decode", "decode_bn128"):
                    continue          # the 64-384-row candidates only where they differ from "decode"
                row = {"shape": name, "N": N, "K": K, "M": M, "impl": fn_name, "floor_ms": floor}
                try:
                    many = jax.jit(lambda xs, ws, ss, fn=fn: [fn(x, w, s_) for x, w, s_ in zip(xs, ws, ss)])
                    compiled = many.lower(xs, ws, ss).compile()
                    out = compiled(xs, ws, ss)
                    jax.block_until_ready(out)
                    got = out[0].astype(jnp.float32)
                    row["rel_err"] = float(jnp.max(jnp.abs(got - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
                    ts = []
                    for _ in range(a.reps):
                        t0 = time.perf_counter()
                        jax.block_until_ready(compiled(xs, ws, ss))
                        ts.append(time.perf_counter() - t0)
                    row["wall_ms"] = 1e3 * sorted(ts)[len(ts) // 2] / CALLS
                    prof = SP.profile_step(lambda: jax.block_until_ready(compiled(xs, ws, ss)), compiled.as_text(),
                                           calls=2)
                    row["ms"] = prof["busy_ms"] / CALLS
                    row["kernels_per_call"] = prof["kernels_per_step"] / CALLS
                    row["pct_floor"] = 100 * floor / row["ms"]
                    if fn_name in cfgs:
                        row["plan"] = {k: v for k, v in flt.plan(cfgs[fn_name], M, N, K).items()}
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:300]
                res["points"].append(row)
                print(json.dumps(row), flush=True)
            with open(os.path.join(a.out, "fp8_sweep.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
    print(f"\n{'shape':<11}{'M':>5}  " + "".join(f"{n:>14}" for n in ["floor", "xla", *cfgs]) + "   (us per call: kernel busy time)")
    for name in a.shapes:
        for M in a.rows:
            rows = {r["impl"]: r for r in res["points"] if r["shape"] == name and r["M"] == M}
            fl_us = 1e3 * next(iter(rows.values()))["floor_ms"]
            cells = [f"{fl_us:>14.1f}"] + [f"{1e3 * rows[n]['ms']:>14.1f}" if "ms" in rows.get(n, {}) else
                                           f"{'err' if n in rows else '-':>14}" for n in ["xla", *cfgs]]
            print(f"{name:<11}{M:>5}  " + "".join(cells))


if __name__ == "__main__":
    main()
