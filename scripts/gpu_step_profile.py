"""Whole-step per-op profile on the GPU machine (issue 19): ceilings, then per point and variant the step time, the
kernel-busy time and the per-op table. One call, a short table last. From the repo root:

  python3 scripts/gpu_step_profile.py --preset bench-4l-96e --backend triton \
      --decode 32@4096 1@4096 --prefill 4096@0 --variants new,old --out $OUT

Variants: ``new`` = the code as it is; ``old`` = the dense linears / head / gate / compressor with fp32-widened
operands (``layers.tensor_cores`` forced False: the pre-change path, for the A/B in the same run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())


def ceilings(gb=4):
    import jax
    import jax.numpy as jnp
    res = {}
    n = (gb << 30) // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (n // 8192, 8192), jnp.bfloat16)
    jax.block_until_ready(x)

    def t(f, *a, reps=10):
        jax.block_until_ready(f(*a))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    s = t(jax.jit(lambda v: jnp.sum(v.astype(jnp.float32), axis=0)), x)
    res["read_TBps_jax_colsum"] = x.nbytes / s / 1e12
    x1 = x.reshape(-1)
    s = t(jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32)), x1)
    res["read_TBps_jax_sum"] = x1.nbytes / s / 1e12
    del x1
    s = t(jax.jit(lambda v: v + 1), x)
    res["copy_TBps_jax_rw"] = 2 * x.nbytes / s / 1e12
    del x
    m = 8192
    a = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (m, m), jnp.bfloat16)
    s = t(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), a, b)
    res["bf16_TFLOPs_jax"] = 2 * m ** 3 / s / 1e12
    try:
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
        s = t(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), a8, b8)
        res["fp8_TFLOPs_jax"] = 2 * m ** 3 / s / 1e12
    except Exception as e:  # noqa: BLE001
        res["fp8_jax_error"] = repr(e)[:200]
    try:
        from dsflash.bench.kernels import measure_ceilings
        res.update({f"torch_{k}": v for k, v in measure_ceilings().items()})
    except Exception as e:  # noqa: BLE001
        res["torch_error"] = repr(e)[:200]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench-4l-96e")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--precision", default="reference")
    ap.add_argument("--decode", nargs="*", default=["32@4096"])
    ap.add_argument("--prefill", nargs="*", default=[])
    ap.add_argument("--variants", default="new")
    ap.add_argument("--profile-no-cb", action="store_true",
                    help="time with XLA's command buffers (default), then trace a second compile without them "
                         "(every kernel carries its own HLO op, so the per-op table is exact)")
    ap.add_argument("--draft-rows", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--dump-hlo", action="store_true")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import jax

    from dsflash.bench import step_profile as SP
    from dsflash.bench.forward import ForwardBench, build_parser, parse_points
    from dsflash.model import layers

    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(a), "points": []}
    if not a.no_ceilings:
        res["ceilings"] = ceilings()
        print("ceilings", json.dumps(res["ceilings"]), flush=True)
    fargs = build_parser().parse_args(["--preset", a.preset, "--backend", a.backend, "--precision", a.precision,
                                       "--reps", str(a.reps), "--warmup", "2", "--draft-rows", str(a.draft_rows)])
    t0 = time.perf_counter()
    bench = ForwardBench(fargs)
    print(f"params placed in {time.perf_counter() - t0:.1f} s", flush=True)
    pts = [("decode", n, c) for n, c in parse_points(a.decode)] + [("prefill", n, c) for n, c in parse_points(a.prefill)]
    summary = []
    real_tc = layers.tensor_cores
    for phase, n, C in pts:
        S, rows = (a.draft_rows, n) if phase == "decode" else (n, 1)
        for var in a.variants.split(","):
            layers.tensor_cores = real_tc if var == "new" else (lambda: False)
            try:
                batch, state = bench.make_inputs(S, [C] * rows)
                with SP.scoped_model():
                    fn = bench.step_fn("full", phase)
                    t1 = time.perf_counter()
                    lowered = jax.jit(fn, donate_argnums=(2,)).lower(bench.params, batch, state)
                    compiled = lowered.compile()
                    cs = time.perf_counter() - t1
                stats, state, loads, finite = bench.time_step(compiled, bench.params, batch, state)
                touched = [int((l > 0).sum()) for l in loads] if loads.size else []
                cb_note = "command buffers on (XLA default)"
                if a.profile_no_cb:
                    try:
                        compiled = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
                        cb_note = "traced without command buffers"
                    except Exception as e:  # noqa: BLE001
                        cb_note = f"command buffers could not be turned off: {e!r}"[:200]
                    stats_nocb, state, _, _ = bench.time_step(compiled, bench.params, batch, state)
                else:
                    stats_nocb = None
                hlo = compiled.as_text()
                if a.dump_hlo:
                    with open(os.path.join(a.out, f"hlo_{phase}_{n}_{C}_{var}.txt"), "w") as f:
                        f.write(hlo)
                box = {"state": state}

                def once():
                    lg, box["state"], _ = compiled(bench.params, batch, box["state"])
                    jax.block_until_ready((lg, box["state"]))

                prof = SP.profile_step(once, hlo, calls=a.calls)
                rec = {"phase": phase, "n": n, "C": C, "S": S, "rows": rows, "variant": var, "compile_s": cs,
                       "step_ms": stats, "step_ms_no_command_buffers": stats_nocb, "finite": finite,
                       "experts_touched_per_layer": touched, "trace": cb_note, "profile": prof}
                res["points"].append(rec)
                print(f"\n== {phase} {n}x{S}@{C} variant={var}: step {stats['median']:.3f} ms"
                      + (f" ({stats_nocb['median']:.3f} without command buffers)" if stats_nocb else "")
                      + f" (compile {cs:.0f} s, finite {finite}, experts touched {touched}; {cb_note})", flush=True)
                print(SP.format_ops(prof), flush=True)
                print("largest gaps:", json.dumps(prof["gaps"]["largest_us"][:6]), flush=True)
                summary.append((f"{phase} {n}x{S}@{C}", var, stats["median"], prof["busy_ms"],
                                prof["kernels_per_step"]))
                del state, box, compiled
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                summary.append((f"{phase} {n}x{S}@{C}", var, float("nan"), float("nan"), 0))
            with open(os.path.join(a.out, "step_profile.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
    layers.tensor_cores = real_tc
    print("\npoint                 variant   step ms   busy ms   kernels")
    for p, v, ms, busy, k in summary:
        print(f"{p:<22}{v:<8}{ms:>9.3f}{busy:>10.3f}{k:>10.0f}")


if __name__ == "__main__":
    main()
