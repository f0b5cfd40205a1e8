"""Sparse attention at a prefill shape, in isolation: the flash kernel on the materialised buffer (what the model's
prefill runs: window rows ++ every compressed entry decoded to bf16) against the paged kernel (compressed entries read
as NVFP4 from the pool, decoded in registers), and flash configs side by side. Why (session 23): at 4K-16K tokens
every query row gathers 640 rows of 1 KB (128 window + 512 picked), ~2.7 GB a layer at 4096 tokens from a buffer of
a few MB -- L2 traffic, not DRAM. If the flash kernel is bound by that traffic, reading the picks as 288-byte NVFP4
rows (the paged kernel) should win at prefill although it lost at decode; Nsight Compute (``--once`` under ncu, see
``gpu_queue.sh attn_prefill``) says which bound holds.

Inputs as the model builds them at a prefill from position 0 with compression ratio 4: row t attends to window
rows t-127..t and to min(512, (t+1) // 4) distinct visible compressed entries (random, ascending).

  python3 scripts/gpu_attn_prefill_probe.py --tokens 4096 16384 --configs flash_bk64,flash_bk32,flash_bk64_s2
  python3 scripts/gpu_attn_prefill_probe.py --tokens 4096 --once       # one call of each kernel (for ncu)
  python3 scripts/gpu_attn_prefill_probe.py --configs flash_bk64_s2,gluon_ov0,gluon_ov1,gluon_ws   # + the Gluon kernels
TFLOP/s counts QK + PV over the valid entries (4 H D flops each), for the bf16 GEMM rate as ceiling.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

H, D, W, RATIO, K = 64, 512, 128, 4, 512


def inputs(T: int, seed: int = 0):
    """q [1, T, H, D] bf16, win [1, T, D] bf16, win_idx [1, T, W], pool (NVFP4, T / RATIO rows), sel [1, T, K]
    (entry ids, ascending, -1 padded), sink [H]."""
    from dsflash.model import state as st
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    P = T // RATIO
    q = (jax.random.normal(ks[0], (1, T, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
    win = jax.random.normal(ks[1], (1, T, D), jnp.float32).astype(jnp.bfloat16)
    t = jnp.arange(T, dtype=jnp.int32)[:, None]
    wi = t - (W - 1) + jnp.arange(W, dtype=jnp.int32)[None]
    win_idx = jnp.where(wi >= 0, wi, -1)[None]
    pool = st.encode_main_kv(jax.random.normal(ks[2], (P, D), jnp.float32), "reference")
    visible = (t + 1) // RATIO                                                   # [T, 1]
    e = jnp.arange(P, dtype=jnp.int32)[None]
    key = jnp.where(e < visible, jax.random.uniform(ks[3], (T, P)), 2.0)          # invisible entries rank last
    _, pick = jax.lax.top_k(-key, min(K, P))                                     # the min(K, visible) smallest keys
    pick = jnp.where(jnp.arange(min(K, P))[None] < visible, pick, P)              # past visible: empty
    pick = jnp.sort(pick, axis=-1)
    sel = jnp.where(pick < P, pick, -1).astype(jnp.int32)
    if sel.shape[-1] < K:
        sel = jnp.pad(sel, ((0, 0), (0, K - sel.shape[-1])), constant_values=-1)
    sink = jax.random.normal(ks[4], (H,), jnp.float32)
    return q, win, win_idx, pool, sel[None], sink


def ops(T: int, configs, paged=True):
    """(q, {name: jitted fn(q) -> the attention output [1, T, H, D] bf16}, the rows gathered and their bytes)."""
    from dsflash.kernels import sparse_attention_paged_triton as spt, sparse_attention_triton as sat
    from dsflash.model import state as st
    q, win, win_idx, pool, sel, sink = inputs(T)
    scale = D ** -0.5
    kv = jnp.concatenate([win, st.decode_main_kv(pool)[None].astype(jnp.bfloat16)], axis=1)
    idx = jnp.concatenate([win_idx, jnp.where(sel >= 0, sel + T, -1)], axis=-1)
    out = {}
    for c in configs:
        if c.startswith("gluon_ov"):       # the Gluon kernel (kernels/sparse_attention_gluon.py)
            from dsflash.kernels import sparse_attention_gluon as sag
            out[c] = jax.jit(lambda q_, ov=int(c[-1]): sag.flash_prefill_gluon(q_, kv, idx, sink, scale, overlap=ov))
            continue
        if c == "gluon_ws":                # the channel-split one (kernels/experimental/sparse_attention_gluon_ws.py)
            from dsflash.kernels.experimental import sparse_attention_gluon_ws as ws
            out[c] = jax.jit(lambda q_: ws.flash_prefill_gluon_ws(q_, kv, idx, sink, scale))
            continue
        out[c] = jax.jit(lambda q_, c=c: sat.sparse_sink_attention_triton(q_, kv, idx, sink, scale, config=c))
        if paged:
            out[f"paged_{c}"] = jax.jit(lambda q_, c=c: spt.sparse_sink_attention_paged_triton(
                q_, win, win_idx, pool["q"], pool["s"], jnp.maximum(sel, 0), sel >= 0, sink, scale, config=c))
    picks = int(jnp.sum(sel >= 0))
    wins = int(jnp.sum(win_idx >= 0))
    return q, out, dict(window_rows=wins, picked_rows=picks, bytes_flash=(wins + picks) * D * 2,
                        bytes_paged=wins * D * 2 + picks * (D // 2 + D // 16))


def time_op(fn, q, reps=7):
    qs = [q, q * 1.5]
    jax.block_until_ready(fn(qs[0]))
    ts = []
    for r in range(reps):
        t0 = time.perf_counter()
        for j in range(4):
            y = fn(qs[j % 2])
        jax.block_until_ready(y)
        ts.append((time.perf_counter() - t0) / 4)
    ts.sort()
    return ts[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--configs", default="flash_bk64,flash_bk32,flash_bk64_s2,flash_bk32_s3")
    ap.add_argument("--once", action="store_true", help="one call of each op, untimed (for Nsight Compute)")
    ap.add_argument("--no-paged", action="store_true", help="only the flash configs, not their paged twins")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    rows = []
    for T in args.tokens:
        q, fns, info = ops(T, configs, paged=not args.no_paged)
        ref = None
        for name, fn in fns.items():
            try:
                if args.once:
                    jax.block_until_ready(fn(q))
                    continue
                s = time_op(fn, q)
                y = fn(q).astype(jnp.float32)
                ref = y if ref is None else ref
                err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                b = info["bytes_paged" if name.startswith("paged_") else "bytes_flash"]
                rows_valid = info["window_rows"] + info["picked_rows"]
                row = dict(tokens=T, op=name, ms=1e3 * s, gathered_GB=b / 1e9, gathered_TBps=b / s / 1e12,
                           tflops=4 * H * D * rows_valid / s / 1e12, rel_diff_vs_first=err, **info)
            except Exception as e:  # noqa: BLE001 -- a config that does not compile is a result, not the end
                row = dict(tokens=T, op=name, error=repr(e)[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if rows:
        print(f"{'tokens':>6} {'op':<24} {'ms':>8} {'GB':>7} {'TB/s':>6} {'TFLOP/s':>8} {'rel diff':>9}")
        for r in rows:
            if "ms" in r:
                print(f"{r['tokens']:>6} {r['op']:<24} {r['ms']:8.3f} {r['gathered_GB']:7.2f} "
                      f"{r['gathered_TBps']:6.2f} {r['tflops']:8.1f} {r['rel_diff_vs_first']:9.2e}")
            else:
                print(f"{r['tokens']:>6} {r['op']:<24} error {r['error'][:80]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
