"""Fused mHC plan overrides timed precisely at decode sizes: N chained calls inside one jitted loop (X1 of a call
is X of the next), so the time per call is the device time of the op's launches and glue alone, not the bench's
per-call dispatch and output sums (whose noise, ~+-15 us, hid the differences in `bench kernels --ops mhc`).

    python3 scripts/gpu_mhc_plans.py --tokens 1,6,48,192 --plans ds40=BD:128/DS:40,ds20=BD:128/DS:20

Prints, per token count, us per call for the default plan and each override, and the override's plan."""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from dsflash.bench.kernels import mhc_inputs, mhc_plan_overrides
from dsflash.kernels import mhc_fused as mf
from dsflash.kernels import mhc_fused_triton as mt


def per_call_us(T, ov, *, n=4, d=5120, calls=64, reps=5, flush_mb=0):
    """Device us per call of ``calls`` chained calls with plan overrides ``ov`` (None: the default plan);
    ``flush_mb`` > 0: each call follows a pass over a buffer of that size (fn and X leave L2 before the call, not
    between its two launches, where the step's sublayer evicts kernel A's partials: NOTES.md, session 13), and the
    same chain of passes alone is timed and subtracted."""
    nc = 2 * n + n * n
    k_fn, k_in = jax.random.split(jax.random.PRNGKey(T))
    fn = jax.random.normal(k_fn, (nc, n * d), jnp.float32) * (n * d) ** -0.5
    base, scale = jnp.zeros((nc,), jnp.float32), jnp.ones((3,), jnp.float32)
    X, y, a, post, comb = mhc_inputs(k_in, (T,), n, d)
    kw = dict(eps=1e-6, rms_eps=1e-20, iters=20, out_dtype=jnp.bfloat16)

    junk = jnp.zeros((max(flush_mb, 1) << 18,), jnp.float32)     # flush_mb MB of fp32

    def timed(with_op):
        @jax.jit
        def chain(X, junk):
            def body(_, c):
                X, junk = c
                if flush_mb:
                    junk = junk + X[0, 0, 0].astype(jnp.float32)     # read + write the whole buffer, after X
                    X = X + (junk[0] * 0).astype(X.dtype)           # ... and before the next call
                if with_op:
                    Xo, h, _ = mt.mhc_fused_triton(X, a, fn, base, scale, (y, post, comb), **kw, plan=ov)
                    X = Xo + h[:, None, :] * 0     # keeps h live; X1 feeds the next call
                return X, junk
            return jax.lax.fori_loop(0, calls, body, (X, junk))

        jax.block_until_ready(chain(X, junk))
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(chain(X, junk))
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2] / calls * 1e6

    return timed(True) - (timed(False) if flush_mb else 0.0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,6,48,192")
    ap.add_argument("--plans", default="ds40=BD:128/DS:40")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--flush-mb", type=int, default=0, help="evict L2 between calls with a pass over this many MB")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    plans = {"default": None, **mhc_plan_overrides(a.plans)}
    rows = []
    for T in [int(v) for v in a.tokens.split(",")]:
        row = {"T": T, "default_plan": mf.kernel_plan(T, 4, 5120)}
        for name, ov in plans.items():
            row[name] = round(per_call_us(T, ov, calls=a.calls, flush_mb=a.flush_mb), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"us per mHC call (chained, device time{f', L2 evicted by {a.flush_mb} MB between calls' if a.flush_mb else ''}):")
    for r in rows:
        print(f"  T={r['T']:5d} " + " ".join(f"{k}={r[k]:.1f}" for k in plans))
    if a.json:
        json.dump(dict(device=str(jax.devices()[0]), flush_mb=a.flush_mb, plans=plans, rows=rows),
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
