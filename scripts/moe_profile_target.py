"""A program for Nsight Compute: the Triton MoE GEMM at V4.1 decode shapes, one config, a few launches.

    python scripts/moe_profile_target.py --config sk_fp8 --tokens 1 [--reps 3]

Run under `scripts/gpu_ncu_moe.sh` (ncu profiles the kernels of the last launch); alone it only checks that the
config compiles and prints the median wall time per call."""
from __future__ import annotations

import argparse
import time

import jax

from dsflash.kernels import moe_gemm_triton as mt, moe_plan


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="sk_fp8", choices=sorted(moe_plan.named_configs()))
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--d", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=2304)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    args = moe_plan.random_moe_problem(jax.random.PRNGKey(0), a.tokens, a.topk, a.experts, a.d, a.inter)
    cfg = moe_plan.named_config(a.config)
    if cfg.mma == "swap_il":        # these kernels read the load-time il layout: repack once, as the engine does
        from dsflash.kernels import moe_layout
        args = tuple(args[:3]) + tuple(moe_layout.repack_experts(*args[3:]))
        if cfg.tile_major:          # the experimental tile-major permutation those configs read
            args = tuple(args[:3]) + tuple(moe_layout.tile_experts(*args[3:], level=cfg.tile_major))
    f = jax.jit(lambda *x: mt.routed_moe_triton(*x, limit=10.0, config=cfg))
    jax.block_until_ready(f(*args))                 # compile + first launch
    ts = []
    for _ in range(a.reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    print(f"{a.config} T={a.tokens}: median {sorted(ts)[len(ts) // 2] * 1e3:.3f} ms per call (wall, incl. dispatch)")


if __name__ == "__main__":
    main()
