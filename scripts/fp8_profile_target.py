"""A program for Nsight Compute: the dense FP8 linear kernel (``fp8_linear_triton``) at one of the model's shapes
and a decode row count, a few launches.

    python scripts/fp8_profile_target.py --shape wo_b --rows 192 [--config decode_bn128] [--reps 3]

Run under ncu by ``scripts/gpu_queue.sh fp8_stalls`` (kernel regex ``_fp8_linear``); alone it prints the plan
(block sizes, K split, programs) and the median wall time per call. ``--plan-only`` prints the plan without a GPU."""
from __future__ import annotations

import argparse
import time


def main(argv=None):
    from dsflash.bench.kernels import FP8_LINEAR_SHAPES
    from dsflash.kernels import fp8_linear_triton as ft
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="wo_b", choices=sorted(FP8_LINEAR_SHAPES))
    ap.add_argument("--rows", type=int, default=192)
    ap.add_argument("--config", default=None,
                    help="a default or experimental config name (fp8_linear_triton.named_config); default: the one "
                         "the model picks at --rows (fp8_linear_triton.pick_config)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--plan-only", action="store_true")
    a = ap.parse_args(argv)
    N, K = FP8_LINEAR_SHAPES[a.shape]
    cfg = ft.named_config(a.config) if a.config else ft.pick_config(a.rows)
    name = a.config or (ft.DECODE_CONFIG if a.rows <= ft.DECODE_MAX_ROWS else "prefill")     # pick_config's choice
    pl = ft.plan(cfg, a.rows, N, K)
    print(f"{a.shape} [N {N}, K {K}] x {a.rows} rows, config {name}: {pl}")
    if a.plan_only:
        return 0
    import jax
    import jax.numpy as jnp
    kw, ks = jax.random.split(jax.random.PRNGKey(N + K))
    w = (jax.random.normal(kw, (N, K), jnp.float32) * 2.0).astype(jnp.float8_e4m3fn)
    s = jax.random.randint(ks, (N // 32, K // 32), 118, 124, jnp.int32).astype(jnp.uint8)
    x = jax.random.normal(jax.random.PRNGKey(a.rows), (a.rows, K), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda x_: ft.fp8_linear_triton(x_, w, s, config=cfg))
    jax.block_until_ready(f(x))                      # compile + first launch
    ts = []
    for _ in range(a.reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    print(f"median {sorted(ts)[len(ts) // 2] * 1e3:.3f} ms per call (wall, incl. dispatch)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
