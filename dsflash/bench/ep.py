"""Time the expert-parallel MoE per collective and mode (the measurement behind ``EPSettings.collective``).

    python -m dsflash.bench.ep --mesh dep=2 --experts 48 --tokens 64,512,4096

Per token count per rank, prints the median step time of ``ep_routed_moe`` for allgather / all_to_all
x prefill / decode, plus the single-device ``routed_moe`` on one rank's tokens with all experts local
(the no-EP reference point). Shapes default to V4.1's (d=5120, I=2304, top-6, MXFP4 experts); the
grouped GEMM is whatever ``--backend`` selects (the xla reference dequantises the local experts
every call, so absolute numbers are an upper bound; the collective difference is the point).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dsflash.kernels.moe_gemm import routed_moe
from dsflash import quant
from dsflash.sharding.ep_moe import EPSettings, ep_routed_moe
from dsflash.sharding.mesh import make_mesh, mesh_sizes


def _time(f, args, iters):
    out = f(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default=None, help="mesh spec (default dep=<all devices>)")
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=2304)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--tokens", default="64,512,4096", help="tokens per rank, comma separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--backend", default="xla")
    ap.add_argument("--json", default=None, help="append one JSON line per measurement to this file")
    a = ap.parse_args(argv)
    mesh = make_mesh(a.mesh or f"dep={len(jax.devices())}")
    n = int(np.prod(list(mesh_sizes(mesh).values())))
    E, d, I, k = a.experts, a.hidden, a.inter, a.topk
    exp_sh = NamedSharding(mesh, P("dep"))
    tok_sh = NamedSharding(mesh, P("dep"))

    @jax.jit
    def make_w(key):
        k1, k2, k3 = jax.random.split(key, 3)
        w1, s1 = quant.quantize_mxfp4_weight(jax.random.normal(k1, (E, I, d), jnp.bfloat16) * d ** -0.5)
        w3, s3 = quant.quantize_mxfp4_weight(jax.random.normal(k2, (E, I, d), jnp.bfloat16) * d ** -0.5)
        w2, s2 = quant.quantize_mxfp4_weight(jax.random.normal(k3, (E, d, I), jnp.bfloat16) * I ** -0.5)
        return w1, s1, w3, s3, w2, s2

    experts = jax.device_put(make_w(jax.random.PRNGKey(0)), exp_sh)
    print(f"# mesh {mesh.axis_names}={mesh.devices.shape} E={E} d={d} I={I} k={k} precision={a.precision} "
          f"backend={a.backend} device={jax.devices()[0].device_kind}")
    print(f"{'tok/rank':>8} {'variant':>22} {'ms':>9}")
    for tr in (int(t) for t in a.tokens.split(",")):
        T = tr * n
        key = jax.random.PRNGKey(tr)
        x = jax.device_put(jax.random.normal(key, (T, d), jnp.bfloat16), tok_sh)
        _, idx = jax.lax.top_k(jax.random.normal(jax.random.fold_in(key, 1), (T, E)), k)
        idx = jax.device_put(idx.astype(jnp.int32), tok_sh)
        w = jax.device_put(jnp.full((T, k), 1.0 / k, jnp.float32), tok_sh)
        rows = []
        for coll in ("allgather", "all_to_all"):
            for mode in ("prefill", "decode"):
                s = EPSettings(coll, mode)
                f = jax.jit(lambda x, i, w, *e, s=s: ep_routed_moe(x, i, w, *e, mesh=mesh, limit=10.0,
                                                                   precision=a.precision, backend=a.backend,
                                                                   settings=s))
                rows.append((f"{coll}/{mode}", _time(f, (x, idx, w, *experts), a.iters)))
        loc = jax.devices()[0]
        xl, il, wl = (jax.device_put(v[:tr], loc) for v in (x, idx, w))
        el = jax.device_put(make_w(jax.random.PRNGKey(0)), loc)
        f1 = jax.jit(lambda x, i, w, *e: routed_moe(x, i, w, *e, limit=10.0, precision=a.precision,
                                                     backend=a.backend))
        rows.append(("single-device (all E)", _time(f1, (xl, il, wl, *el), a.iters)))
        for name, t in rows:
            print(f"{tr:>8} {name:>22} {t * 1e3:>9.3f}")
            if a.json:
                with open(a.json, "a") as fh:
                    fh.write(json.dumps({"tokens_per_rank": tr, "variant": name, "ms": t * 1e3, "E": E, "d": d,
                                         "I": I, "k": k, "ranks": n, "precision": a.precision,
                                         "backend": a.backend}) + "\n")


if __name__ == "__main__":
    main()
