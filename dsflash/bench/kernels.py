"""``python -m dsflash.bench kernels``: the hot kernels at V4.1 shapes on one GPU, all ratios from one run.

For the routed-expert MoE grouped GEMM (d=5120, I=2304, E local experts, top-k, MXFP4 weights) at decode
(1-256 tokens per rank) and prefill (4K-16K tokens) sizes it measures, in the same process:
* dsflash Triton kernel (``moe_gemm_triton``, reference numerics: FP8 activations, MXFP4 weights decoded
  in-kernel), the whole op including the JAX-side routing sort and activation quantisation;
* the XLA lowering of the pure-JAX reference (jit of ``routed_moe_reference``: dequantise to bf16 +
  ``ragged_dot``), up to ``--xla-max-tokens``;
* peers: ``torch._grouped_mm`` bf16 and ``torch._scaled_grouped_mm`` FP8 (row-wise scales) on pre-sorted rows
  with the same group sizes: gate/up GEMM (N=2I) + SwiGLU/clamp/weight in torch + down GEMM (the peer is
  given sorted rows: no routing sort, gather or combine, so it is a lower bound for a torch pipeline);
* the roofline: max(bytes / copy bandwidth, flops / bf16 matmul rate), with the copy bandwidth
  (device-to-device copy, bytes read + written) and the bf16 matmul rate (8192^3) measured in this run.
  Bytes = the FP4 bytes + UE8M0 scales of the experts the batch touches + x (bf16) + out (fp32);
  flops = 6 * slots * I * d.

Timing (METHOD.md): JAX ops run ``n`` times inside one jitted ``fori_loop`` over rotating input sets (no host
dispatch in the numbers), after a warm-up call, median of ``--reps`` runs divided by ``n``; torch ops use
CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), falling back to ``do_bench``.
Writes benchmarks/results/kernels_<date>_<device>.json (or --out DIR) and prints a table last.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

import numpy as np

from dsflash.kernels.dispatch import BACKENDS, resolve_backend, use_triton


def _commit():
    c = os.environ.get("DSFLASH_COMMIT")
    if c:
        return c
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(__file__)).decode().strip()
    except Exception:  # noqa: BLE001
        return "unknown"


# ------------------------------------------------------------------------------------------ timing
def time_jax_loop(op, varying, fixed, *, reps=5, target_s=0.08, max_n=400):
    """Median seconds per call of ``op(*varying[j], *fixed)``, run n times in one jitted fori_loop, with
    j rotating over the stacked input sets in ``varying`` (a tuple of arrays with a leading set axis)."""
    import jax
    import jax.numpy as jnp

    nsets = varying[0].shape[0]

    @jax.jit
    def loop(n, varying, fixed):
        def body(i, acc):
            j = i % nsets
            out = op(*(v[j] for v in varying), *fixed)
            return acc + jnp.sum(out.astype(jnp.float32))
        return jax.lax.fori_loop(0, n, body, jnp.float32(0))

    jax.block_until_ready(loop(jnp.int32(1), varying, fixed))       # compile + warm-up
    t0 = time.perf_counter()
    jax.block_until_ready(loop(jnp.int32(1), varying, fixed))
    est = time.perf_counter() - t0
    n = int(max(1, min(max_n, math.ceil(target_s / max(est, 1e-6)))))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(jnp.int32(n), varying, fixed))
        ts.append((time.perf_counter() - t0) / n)
    return float(np.median(ts)), n


def time_torch(fn):
    import triton.testing as tt
    try:
        return float(tt.do_bench_cudagraph(fn, rep=60, return_mode="median")) * 1e-3, "cudagraph"
    except Exception:  # noqa: BLE001
        import torch
        torch.cuda.synchronize()
        return float(tt.do_bench(fn, warmup=10, rep=60, return_mode="median")) * 1e-3, "events"


# ------------------------------------------------------------------------------------------ ceilings
def jax_copy_bandwidth(nbytes: int, reps: int = 5, device=None) -> float:
    """Bytes/s of one device reading and writing a ``nbytes`` bf16 buffer once (``v * 2``, median of ``reps``)."""
    import jax
    import jax.numpy as jnp
    x = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), device or jax.devices()[0])
    f = jax.jit(lambda v: v * 2)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 2 * x.nbytes / float(np.median(ts))


def measure_ceilings(quick=False):
    res = {}
    try:
        import torch
        nbytes = (1 if quick else 4) << 30
        src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t, how = time_torch(lambda: dst.copy_(src))
        res["copy_TBps_torch"] = 2 * nbytes / t / 1e12
        del src, dst
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        t, _ = time_torch(lambda: a @ b)
        res["bf16_matmul_TFLOPs_torch"] = 2 * n ** 3 / t / 1e12
        try:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device="cuda", dtype=torch.float32)
            t, _ = time_torch(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            res["fp8_matmul_TFLOPs_torch"] = 2 * n ** 3 / t / 1e12
        except Exception as e:  # noqa: BLE001
            res["fp8_matmul_error"] = repr(e)[:200]
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        res["torch_error"] = repr(e)[:300]
    try:
        res["copy_TBps_jax_elementwise"] = jax_copy_bandwidth((1 if quick else 4) << 30, reps=7) / 1e12
    except Exception as e:  # noqa: BLE001
        res["jax_copy_error"] = repr(e)[:300]
    res["copy_TBps"] = max(res.get("copy_TBps_torch", 0), res.get("copy_TBps_jax_elementwise", 0))
    res["bf16_TFLOPs"] = res.get("bf16_matmul_TFLOPs_torch", 0)
    return res


# ------------------------------------------------------------------------------------------ peers
def torch_peers(gs, T, k, d, I, E, limit, reps_note):
    """torch._grouped_mm (bf16) and torch._scaled_grouped_mm (fp8 row-wise) pipelines on sorted rows."""
    import torch
    import torch.nn.functional as F

    out = {}
    S = int(sum(gs))
    offs = torch.tensor(np.cumsum(gs), device="cuda", dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(S, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    rw = torch.rand(S, device="cuda", dtype=torch.float32, generator=gen)
    W13 = (torch.randn(E, 2 * I, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
    W2 = (torch.randn(E, d, I, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)

    def swiglu(gu):
        g, u = gu[:, :I].float(), gu[:, I:].float()
        return (F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * rw[:, None]).to(torch.bfloat16)

    try:
        w13t, w2t = W13.transpose(1, 2), W2.transpose(1, 2)

        def bf16_pipe():
            h = swiglu(torch._grouped_mm(A, w13t, offs=offs, out_dtype=torch.bfloat16))
            return torch._grouped_mm(h, w2t, offs=offs, out_dtype=torch.bfloat16)
        bf16_pipe()
        out["torch_grouped_mm_bf16_s"], out["torch_bf16_timer"] = time_torch(bf16_pipe)
    except Exception as e:  # noqa: BLE001
        out["torch_grouped_mm_bf16_error"] = repr(e)[:300]
    try:
        f8 = torch.float8_e4m3fn
        A8 = A.to(f8)
        sa = torch.ones(S, device="cuda", dtype=torch.float32)
        W13_8 = W13.to(f8)
        W2_8 = W2.to(f8)
        sb13 = torch.ones(E, 2 * I, device="cuda", dtype=torch.float32)
        sb2 = torch.ones(E, d, device="cuda", dtype=torch.float32)
        w13t8, w2t8 = W13_8.transpose(1, 2), W2_8.transpose(1, 2)

        def fp8_pipe():
            gu = torch._scaled_grouped_mm(A8, w13t8, sa, sb13, offs=offs, out_dtype=torch.bfloat16)
            h = swiglu(gu).float()
            amax = h.abs().amax(dim=1).clamp(min=1e-4)
            sh = amax / 448.0
            h8 = (h / sh[:, None]).to(f8)
            return torch._scaled_grouped_mm(h8, w2t8, sh, sb2, offs=offs, out_dtype=torch.bfloat16)
        fp8_pipe()
        out["torch_scaled_grouped_mm_fp8_s"], out["torch_fp8_timer"] = time_torch(fp8_pipe)
    except Exception as e:  # noqa: BLE001
        out["torch_scaled_grouped_mm_fp8_error"] = repr(e)[:300]
    del A, W13, W2
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------ MoE GEMM
def bench_moe(args, ceilings, log, rows, save=lambda: None):
    import jax
    import jax.numpy as jnp

    from dsflash.kernels import moe_gemm, moe_gemm_triton as mt, moe_plan

    d, I, E, k, limit = args.d, args.inter, args.experts, args.topk, 10.0
    key = jax.random.PRNGKey(0)
    # one weight set (1.8 GB of MXFP4 at E=96) for all sizes; fresh routing / activations per size
    _, _, _, w1, s1, w3, s3, w2, s2 = moe_plan.random_moe_problem(key, 1, k, E, d, I)
    fixed = (w1, s1, w3, s3, w2, s2)
    jax.block_until_ready(fixed)
    fixed_il = None     # the same weights in the load-time il layout (mma "swap_il" configs), repacked once
    fixed_tm = {}       # ... and tile-major (configs with tile_major), permuted once per level

    def weights_for(cfg_):
        nonlocal fixed_il
        if not (cfg_.kind == "sk" and cfg_.mma == "swap_il"):
            return fixed
        from dsflash.kernels import moe_layout
        if fixed_il is None:
            fixed_il = moe_layout.repack_experts(*fixed)
            jax.block_until_ready(fixed_il)
        if not cfg_.tile_major:
            return fixed_il
        if cfg_.tile_major not in fixed_tm:
            fixed_tm[cfg_.tile_major] = moe_layout.tile_experts(*fixed_il, level=cfg_.tile_major)
            jax.block_until_ready(fixed_tm[cfg_.tile_major])
        return fixed_tm[cfg_.tile_major]
    tokens = [int(t) for t in args.tokens.split(",")]
    for T in tokens:
        nsets = 4 if T <= 256 else 2
        sets = [moe_plan.random_moe_problem(jax.random.fold_in(key, 1000 * T + j), T, k, E, 32, 32)[:3]
                for j in range(nsets)]
        xs = jnp.stack([jax.random.normal(jax.random.fold_in(key, 7 * T + j), (T, d), jnp.float32)
                        .astype(jnp.bfloat16) for j in range(nsets)])
        idxs = jnp.stack([s[1] for s in sets])
        ws = jnp.stack([s[2] for s in sets])
        varying = (xs, idxs, ws)
        S = T * k
        gs0 = np.bincount(np.asarray(idxs[0]).reshape(-1), minlength=E)
        active = float(np.mean([np.count_nonzero(np.bincount(np.asarray(idxs[j]).reshape(-1), minlength=E))
                                for j in range(nsets)]))
        wbytes = active * 3 * I * d // 2 + active * 3 * I * d // 32
        bytes_min = wbytes + T * d * 2 + T * d * 4
        flops = 6.0 * S * I * d
        t_roof = max(bytes_min / (max(ceilings["copy_TBps"], 1e-9) * 1e12),
                     flops / (max(ceilings["bf16_TFLOPs"], 1e-9) * 1e12))
        row = dict(T=T, slots=S, experts=E, topk=k, active_experts=active, weight_bytes=wbytes,
                   bytes_min=bytes_min, flops=flops, roofline_s=t_roof, configs={})

        def tri(cfg_, precision="reference"):
            return lambda x, i, w, *f: mt.routed_moe_triton(x, i, w, *f, limit=limit, precision=precision,
                                                            config=cfg_)
        names = [n for n in (args.decode_configs if S <= 32 * E else args.prefill_configs).split(",") if n]
        for name in names:
            try:
                ncfg = moe_plan.named_config(name)
                row["configs"][name], _ = time_jax_loop(tri(ncfg), varying, weights_for(ncfg), reps=args.reps)
            except Exception as e:  # noqa: BLE001
                row["configs"][name] = None
                row.setdefault("config_errors", {})[name] = repr(e)[:400]
                log(traceback.format_exc()[-2000:])
        ok = {n: v for n, v in row["configs"].items() if v}
        if ok:
            best = min(ok, key=ok.get)
            row["triton_best_config"], row["triton_s"] = best, ok[best]
            bcfg = moe_plan.named_config(best)
            # the two kernel launches alone, on prepared inputs (no routing sort / activation quantisation)
            try:
                keys = ("xq", "xs", "tok", "rw", "order", "tile_e", "tile_s", "tile_end")
                ps = [moe_plan.prepare(xs[j], idxs[j], ws[j], E=E, BM=bcfg.BM, act_fp8=True) for j in range(nsets)]
                pv = tuple(jnp.stack([pp[kk] for pp in ps]) for kk in keys)
                w8 = tuple(mt._as_u8(a) for a in weights_for(bcfg))

                def kern_only(*a):
                    p_ = dict(zip(keys, a[:len(keys)]))
                    w1_, s1_, w3_, s3_, w2_, s2_ = a[len(keys):]
                    return mt._launch(p_, w1_, s1_, w3_, s3_, w2_, s2_, T=T, k=k, d=d, I=I, E=E, limit=limit,
                                      act_fp8=True, cfg=bcfg)[0]
                row["kernels_only_s"], _ = time_jax_loop(kern_only, pv, w8, reps=args.reps)
                del ps, pv
            except Exception as e:  # noqa: BLE001
                row["kernels_only_error"] = repr(e)[:400]
                log(traceback.format_exc()[-2000:])
            if T in [int(v) for v in args.bf16_tokens.split(",") if v]:
                try:
                    fcfg = bcfg if (bcfg.kind, bcfg.mma) != ("sk", "fp8") else moe_plan.pick_config(S, E, False)
                    row["triton_bf16_variant_s"], _ = time_jax_loop(tri(fcfg, "bf16"), varying, weights_for(fcfg),
                                                                    reps=3)
                except Exception as e:  # noqa: BLE001
                    row["triton_bf16_variant_error"] = repr(e)[:300]
        ref_op = lambda x, i, w, *f: moe_gemm.routed_moe_reference(x, i, w, *f, limit=limit)  # noqa: E731
        if T <= args.xla_max_tokens:
            try:
                row["xla_ref_s"], row["xla_ref_n"] = time_jax_loop(ref_op, varying, fixed,
                                                                   reps=3 if T >= 1024 else args.reps)
            except Exception as e:  # noqa: BLE001
                row["xla_ref_error"] = repr(e)[:500]
                log(traceback.format_exc()[-2000:])
        if T <= args.check_max_tokens and ok:
            try:
                a = (xs[0], idxs[0], ws[0]) + fixed
                ref_eager = np.asarray(ref_op(*a))          # op by op: every rounding of the reference happens
                ref_jit = np.asarray(jax.jit(ref_op)(*a))   # one XLA program (may keep excess precision)
                got = np.asarray(jax.jit(tri(bcfg))(*((xs[0], idxs[0], ws[0]) + weights_for(bcfg))))
                nrm = np.linalg.norm(ref_eager)
                row["rel_err_vs_ref"] = float(np.linalg.norm(got - ref_eager) / nrm)
                row["max_abs_err_vs_ref"] = float(np.abs(got - ref_eager).max())
                row["rel_err_vs_jit_ref"] = float(np.linalg.norm(got - ref_jit) / nrm)
                row["jit_ref_vs_eager_ref_rel"] = float(np.linalg.norm(ref_jit - ref_eager) / nrm)
                row["nan"] = bool(np.isnan(got).any())
            except Exception as e:  # noqa: BLE001
                row["check_error"] = repr(e)[:500]
                log(traceback.format_exc()[-2000:])
        if not args.no_torch:
            try:
                row.update(torch_peers(gs0, T, k, d, I, E, limit, None))
            except Exception as e:  # noqa: BLE001
                row["torch_error"] = repr(e)[:300]
        t = row.get("triton_s")
        if t:
            row["weight_TBps"] = wbytes / t / 1e12
            row["TFLOPs"] = flops / t / 1e12
            row["frac_of_roofline"] = t_roof / t
            for name in ("xla_ref_s", "torch_grouped_mm_bf16_s", "torch_scaled_grouped_mm_fp8_s"):
                if row.get(name):
                    row["speedup_vs_" + name[:-2]] = row[name] / t
        rows.append(row)
        log(json.dumps({kk: (round(v, 6) if isinstance(v, float) else v) for kk, v in row.items()}))
        save()
        del xs, idxs, ws, varying
    return rows


# ------------------------------------------------------------------------------------------ sparse attention
def bench_sparse_attn(args, ceilings, log, rows, save=lambda: None):
    """Sparse sink attention decode (V4.1: 64 heads x 512, one shared latent, 128 window + 512 compressed entries
    per query row) at B sequences x S query rows over N cached rows per sequence: Triton kernel vs the XLA
    lowering of the reference vs the roofline (unique KV bytes read / copy bandwidth, flops / bf16 rate). No torch
    peer: SDPA / flex attention cannot gather per-row index lists without materialising them."""
    import jax
    import jax.numpy as jnp

    from dsflash.kernels import sparse_attention as sa

    H, D, K, N = 64, 512, 640, args.attn_ctx
    scale = D ** -0.5
    for spec in args.attn_shapes.split(","):
        B, S = (int(v) for v in spec.split("x"))
        key = jax.random.PRNGKey(B * 100 + S)
        ks = jax.random.split(key, 6)
        nsets = 3
        kv = jax.random.normal(ks[0], (B, N, D), jnp.float32).astype(jnp.bfloat16)
        qs = (jax.random.normal(ks[1], (nsets, B, S, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
        win = jnp.arange(N - 128, N, dtype=jnp.int32)                       # the SWA window: last 128 rows
        sel = jax.random.randint(ks[2], (nsets, B, S, K - 128), 0, N - 128, jnp.int32)
        idxs = jnp.concatenate([jnp.broadcast_to(win, (nsets, B, S, 128)), sel], axis=-1)
        sink = jax.random.normal(ks[3], (H,), jnp.float32)
        uniq = float(np.mean([len(np.unique(np.asarray(idxs[0, b]))) for b in range(B)]))
        bytes_min = B * uniq * D * 2 + 2 * B * S * H * D * 2
        flops = 4.0 * B * S * H * K * D
        t_roof = max(bytes_min / (max(ceilings["copy_TBps"], 1e-9) * 1e12),
                     flops / (max(ceilings["bf16_TFLOPs"], 1e-9) * 1e12))
        row = dict(B=B, S=S, H=H, D=D, K=K, N=N, unique_rows_per_seq=uniq, bytes_min=bytes_min, flops=flops,
                   roofline_s=t_roof)
        # "triton" = the kernel with the shape's PICK_TABLE config (what the dispatch runs where its crossover table
        # allows it); each named variant (--attn-variants) is timed and error-checked into row["variants"].
        from dsflash.kernels import sparse_attention_triton as sat
        names = [None] + [v for v in args.attn_variants.split(",") if v]
        row["picked_variant"] = next(n for m, n in sat.PICK_TABLE if m is None or B * S <= m)
        row["variants"], row["variant_rel_err"] = {}, {}
        a = (qs[0], kv, idxs[0], sink)
        ref = np.asarray(sa.sparse_sink_attention_reference(*a, scale, out_dtype=jnp.float32))
        for name in names + ["xla_ref"]:
            if name == "xla_ref":
                op = lambda q, i, kv_, sk: sa.sparse_sink_attention_reference(q, kv_, i, sk, scale)  # noqa: E731
            else:
                op = lambda q, i, kv_, sk, c=name: sat.sparse_sink_attention_triton(q, kv_, i, sk, scale,  # noqa: E731
                                                                                   config=c)
            try:
                t_, _ = time_jax_loop(op, (qs, idxs), (kv, sink), reps=args.reps)
                if name is None or name == "xla_ref":
                    row[("triton" if name is None else name) + "_s"] = t_
                else:
                    row["variants"][name] = t_
                if name not in (None, "xla_ref"):
                    got = np.asarray(jax.jit(lambda *x, c=name: sat.sparse_sink_attention_triton(
                        *x, scale, out_dtype=jnp.float32, config=c))(*a))
                    row["variant_rel_err"][name] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            except Exception as e:  # noqa: BLE001
                row[f"{name or 'triton'}_error"] = repr(e)[:400]
                log(traceback.format_exc()[-1500:])
        if row["picked_variant"] in row["variant_rel_err"]:
            row["rel_err_vs_ref"] = row["variant_rel_err"][row["picked_variant"]]
        if row["variants"]:
            row["best_variant"] = min(row["variants"], key=row["variants"].get)
        t = row.get("triton_s")
        if t:
            row["frac_of_roofline"] = t_roof / t
            row["TBps"] = bytes_min / t / 1e12
            if row.get("xla_ref_s"):
                row["speedup_vs_xla_ref"] = row["xla_ref_s"] / t
        rows.append(row)
        log(json.dumps(row))
        save()
        del kv, qs, idxs


# ------------------------------------------------------------------------------------------ indexer + top-k
def _roof(bytes_, flops, ceilings):
    return max(bytes_ / (max(ceilings["copy_TBps"], 1e-9) * 1e12), flops / (max(ceilings["bf16_TFLOPs"], 1e-9) * 1e12))


def loop_floor_op(op, varying, fixed):
    """An op with ``op``'s output shape and dtype that does no work (one broadcast of an input element): timed in the
    same ``time_jax_loop`` it gives the loop's own per-iteration cost (run 20, H200: ~25-30 us, the device
    ``fori_loop``'s predicate round trip plus the output sum), which small kernels' times include."""
    import jax
    import jax.numpy as jnp
    out = jax.eval_shape(op, *(v[0] for v in varying), *fixed)
    return lambda *a: jnp.broadcast_to(a[0].reshape(-1)[0].astype(out.dtype), out.shape)


def _time_pair(row, ops, varying, fixed, args, log):
    """Time each named op (same inputs) into row[name + '_s'], then the ratios to the first ('triton'). Also the
    loop's own floor (``loop_floor_s``) and each time less it (``name + '_net_s'``); the ratios stay on whole times."""
    for name, op in ops.items():
        try:
            row[name + "_s"], _ = time_jax_loop(op, varying, fixed, reps=args.reps)
        except Exception as e:  # noqa: BLE001
            row[name + "_error"] = repr(e)[:400]
            log(traceback.format_exc()[-1500:])
    try:
        floor, _ = time_jax_loop(loop_floor_op(next(iter(ops.values())), varying, fixed), varying, fixed,
                                 reps=args.reps)
        row["loop_floor_s"] = floor
        for name in ops:
            if row.get(name + "_s"):
                row[name + "_net_s"] = max(row[name + "_s"] - floor, 0.0)
    except Exception as e:  # noqa: BLE001
        row["loop_floor_error"] = repr(e)[:400]
    t = row.get("triton_s")
    if t:
        row["frac_of_roofline"] = row["roofline_s"] / t
        if row.get("xla_ref_s"):
            row["speedup_vs_xla_ref"] = row["xla_ref_s"] / t


def bench_indexer(args, ceilings, log, rows, save=lambda: None):
    """Lightning indexer (Hi=32 x Di=128, top-512) at B sequences x S query rows over T compressed entries per
    sequence: the whole op (scores + lax.top_k selection) with the Triton scorer vs the XLA reference, and the
    Triton scores alone. Roofline: K + q + w read and fp32 scores written once / copy bandwidth vs the QK flops."""
    import jax
    import jax.numpy as jnp

    from dsflash.kernels import indexer_topk as ik, indexer_topk_triton as it

    Hi, Di, K = 32, 128, 512
    for spec in args.indexer_shapes.split(","):
        B, S, T = (int(v) for v in spec.split("x"))
        ks = jax.random.split(jax.random.PRNGKey(B * 7 + S * 3 + T), 4)
        nsets = 2
        q = jax.random.normal(ks[0], (nsets, B, S, Hi, Di), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(ks[1], (nsets, B, S, Hi), jnp.float32) * 0.1).astype(jnp.bfloat16)
        k = jax.random.normal(ks[2], (B, T, Di), jnp.float32).astype(jnp.bfloat16)
        # causal prefill chunk ending at the last entry (ratio 1), decode rows see everything
        visible = jnp.broadcast_to(jnp.minimum(T - S + 1 + jnp.arange(S, dtype=jnp.int32), T), (B, S))
        valid = jnp.ones((B, S), bool)
        bytes_min = B * T * Di * 2 + B * S * Hi * (Di + 1) * 2 + B * S * T * 4
        flops = 2.0 * B * S * Hi * T * Di
        row = dict(B=B, S=S, T=T, Hi=Hi, Di=Di, topk=K, bytes_min=bytes_min, flops=flops,
                   roofline_s=_roof(bytes_min, flops, ceilings))
        # the kernel path itself (indexer_topk(backend="triton") keeps tiny shapes on XLA: kernels/dispatch.py)
        ops = {"triton": lambda q_, w_, k_, v_, m_: ik.select(it.indexer_scores_triton(q_, w_, k_, v_, m_), v_,
                                                              topk=K)[0],
               "triton_scores_only": lambda q_, w_, k_, v_, m_: it.indexer_scores_triton(q_, w_, k_, v_, m_)}
        if S >= it.ROWS_FORM_MIN_S:   # prefill sizes run the row form: time the tile form beside it (same bits)
            ops["triton_scores_tiles"] = lambda q_, w_, k_, v_, m_: it.indexer_scores_triton(q_, w_, k_, v_, m_,
                                                                                             form="tiles")
        if getattr(args, "indexer_hw_round", False):   # the integer bf16 rounding beside the default (hardware)
            ops["triton_scores_int"] = lambda q_, w_, k_, v_, m_: it.indexer_scores_triton(q_, w_, k_, v_, m_,
                                                                                           hw_round=False)
            ops["triton_scores_cvt"] = lambda q_, w_, k_, v_, m_: it.indexer_scores_triton(q_, w_, k_, v_, m_,
                                                                                           hw_round=2)
        if B * S <= args.indexer_xla_max_rows:
            ops["xla_ref"] = lambda q_, w_, k_, v_, m_: ik.indexer_topk(q_, w_, k_, v_, m_, topk=K, backend="xla")[0]
        _time_pair(row, ops, (q, w), (k, visible, valid), args, log)
        if row.get("triton_scores_only_s"):
            row["scores_TBps"] = bytes_min / row["triton_scores_only_s"] / 1e12
        try:
            a = (q[0], w[0], k, visible, valid)
            ref = np.asarray(ik.indexer_scores_reference(*a))   # op by op
            got = np.asarray(jax.jit(it.indexer_scores_triton)(*a))
            fin = np.isfinite(ref)
            row["score_exact_share"] = float(np.mean(got[fin] == ref[fin]))
            if "triton_scores_tiles" in ops:
                tiles = np.asarray(jax.jit(lambda *x: it.indexer_scores_triton(*x, form="tiles"))(*a))
                row["rows_vs_tiles_bits_equal"] = bool(np.array_equal(got.view(np.uint32), tiles.view(np.uint32)))
            if "triton_scores_int" in ops:
                i = np.asarray(jax.jit(lambda *x: it.indexer_scores_triton(*x, hw_round=False))(*a))
                row["hw_vs_int_bits_equal"] = bool(np.array_equal(got.view(np.uint32), i.view(np.uint32)))
                c = np.asarray(jax.jit(lambda *x: it.indexer_scores_triton(*x, hw_round=2))(*a))
                row["cvt_vs_int_bits_equal"] = bool(np.array_equal(c.view(np.uint32), i.view(np.uint32)))
            row["nan"] = bool(np.isnan(got).any())
        except Exception as e:  # noqa: BLE001
            row["check_error"] = repr(e)[:400]
        rows.append(row)
        log(json.dumps(row))
        save()
        del q, w, k


# ------------------------------------------------------------------------------------------ fused mHC
def mhc_plan_overrides(spec: str) -> dict:
    """``--mhc-plans`` "name=KEY:VALUE/KEY:VALUE,..." -> {name: {KEY: int}} (overrides of ``kernel_plan``, e.g.
    "b1=warps_b:1,ds40=BD:128/DS:40"); each is timed beside the default plan as ``triton_<name>``."""
    out = {}
    for item in filter(None, (x.strip() for x in (spec or "").split(","))):
        name, _, body = item.partition("=")
        if not name or not body:
            raise ValueError(f"--mhc-plans: {item!r} is not name=KEY:VALUE[/KEY:VALUE...]")
        ov = {}
        for kv in body.split("/"):
            k, _, v = kv.partition(":")
            if not k or not v.isdigit():
                raise ValueError(f"--mhc-plans: {kv!r} in {item!r} is not KEY:INTEGER")
            ov[k] = int(v)
        out[name] = ov
    return out


def mhc_inputs(key, lead, n, d):
    """Random post-side mHC inputs of leading shape ``lead``: streams X [*lead, n, d] and sublayer output y
    [*lead, d] (bf16), a, post [*lead, n] and comb [*lead, n, n] (fp32, in their ranges)."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(key, 5)
    X = jax.random.normal(ks[0], (*lead, n, d), jnp.float32).astype(jnp.bfloat16)
    y = jax.random.normal(ks[1], (*lead, d), jnp.float32).astype(jnp.bfloat16)
    a = jax.nn.sigmoid(jax.random.normal(ks[2], (*lead, n)))
    post = 2 * jax.nn.sigmoid(jax.random.normal(ks[3], (*lead, n)))
    comb = jax.nn.softmax(jax.random.normal(ks[4], (*lead, n, n)), axis=-1)
    return X, y, a, post, comb


def bench_mhc(args, ceilings, log, rows, save=lambda: None):
    """Fused mHC at a sublayer boundary (post side: expand + coefficients/Sinkhorn(20) + collapse; n=4,
    d=5120) for T tokens per rank: Triton kernel vs the XLA reference. Roofline: X and y read, X1 and h written,
    fn once (bf16 / fp32) / copy bandwidth. Both timed ops also sum their outputs (the loop needs a use)."""
    import jax
    import jax.numpy as jnp

    from dsflash.kernels import mhc_fused as mf

    n, d, it_ = 4, args.d, 20
    nc = 2 * n + n * n
    kw = dict(eps=1e-6, rms_eps=1e-20, iters=it_, out_dtype=jnp.bfloat16)
    key = jax.random.PRNGKey(1)
    fn = jax.random.normal(key, (nc, n * d), jnp.float32) * (n * d) ** -0.5
    base = jnp.zeros((nc,), jnp.float32)
    scale = jnp.ones((3,), jnp.float32)
    for T in [int(v) for v in args.mhc_tokens.split(",") if v]:
        X, y, a, post, comb = mhc_inputs(jax.random.fold_in(key, T), (2, T), n, d)
        bytes_min = 2 * T * n * d * 2 + 2 * T * d * 2 + nc * n * d * 4
        flops = 2.0 * T * n * d * (nc + 2 * n)
        row = dict(T=T, n=n, d=d, iters=it_, bytes_min=bytes_min, flops=flops,
                   roofline_s=_roof(bytes_min, flops, ceilings))

        def summed(call):        # the timed op: every output summed (the loop needs a use)
            def op(X_, y_, a_, p_, c_, fn_, b_, s_):
                Xo, h, (pr, po, cb) = call(X_, a_, fn_, b_, s_, (y_, p_, c_))
                return (jnp.sum(Xo.astype(jnp.float32)) + jnp.sum(h.astype(jnp.float32)) + jnp.sum(pr)
                        + jnp.sum(po) + jnp.sum(cb))
            return op

        def op_for(backend):
            return summed(lambda *z: mf.mhc_fused(*z, **kw, backend=backend))

        def plan_op(ov):
            from dsflash.kernels import mhc_fused_triton as mt
            return summed(lambda *z: mt.mhc_fused_triton(*z, **kw, plan=ov))

        plans = mhc_plan_overrides(args.mhc_plans)
        row["plans"] = dict(plans)
        _time_pair(row, {"triton": op_for("triton"), "xla_ref": op_for("xla"),
                         **{f"triton_{name}": plan_op(ov) for name, ov in plans.items()}},
                   (X, y, a, post, comb), (fn, base, scale), args, log)
        try:
            args0 = (X[0], a[0], fn, base, scale, (y[0], post[0], comb[0]))
            r = mf.mhc_fused_reference(*args0, **kw)
            g = jax.jit(lambda *z: mf.mhc_fused(*z, **kw, backend="triton"))(*args0)
            for name, gi, ri in (("X1", g[0], r[0]), ("h", g[1], r[1]), ("comb", g[2][2], r[2][2])):
                gi, ri = np.asarray(gi, np.float32), np.asarray(ri, np.float32)
                row[f"rel_err_{name}"] = float(np.linalg.norm(gi - ri) / np.linalg.norm(ri))
            from dsflash.kernels import mhc_fused_triton as mt
            for pname, ov in plans.items():       # each variant against the default plan's outputs
                v = jax.jit(lambda *z, ov=ov: mt.mhc_fused_triton(*z, **kw, plan=ov))(*args0)
                row[f"max_diff_vs_default_{pname}"] = max(
                    float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(x0, np.float32))))
                    for x, x0 in zip(jax.tree.leaves(v), jax.tree.leaves(g)))
        except Exception as e:  # noqa: BLE001
            row["check_error"] = repr(e)[:400]
        rows.append(row)
        log(json.dumps(row))
        save()
        del X, y, a, post, comb


# ------------------------------------------------------------------------------------------ dense FP8 linears
FP8_LINEAR_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
                     "wo_a": (8192, 4096), "sh_w13": (2304, 5120), "sh_w2": (5120, 2304)}     # [N, K] (out, in)


def bench_fp8_linear(args, ceilings, log, rows, save=lambda: None):
    """Dense FP8-stored linears (E4M3 [N, K] + UE8M0 32x32 scales) at M rows: the Triton kernel
    (``fp8_linear_triton``, the picked config and each of ``--fp8linear-configs`` at decode sizes) vs the XLA path
    the model runs today (jit of ``fp8_linear_reference`` == ``layers.linear_fp8``: a dequantised bf16 weight copy +
    bf16 tensor-core GEMM), "reference" precision. Weight TB/s = (N K + N K / 1024) bytes / time; roofline: weight +
    x + out bytes / copy bandwidth vs 2 M N K flops / bf16 rate."""
    import jax
    import jax.numpy as jnp

    from dsflash.kernels import fp8_linear as fl, fp8_linear_triton as ft
    from dsflash import quant

    shapes = list(FP8_LINEAR_SHAPES) if args.fp8linear_shapes == "all" else args.fp8linear_shapes.split(",")
    for name in shapes:
        N, K = FP8_LINEAR_SHAPES[name]
        kw, ks = jax.random.split(jax.random.PRNGKey(N + K))
        w = (jax.random.normal(kw, (N, K), jnp.float32) * 2.0).astype(jnp.float8_e4m3fn)
        s = jax.random.randint(ks, (N // 32, K // 32), 118, 124, jnp.int32).astype(jnp.uint8)
        wbytes = N * K + N * K // 1024
        for M in (int(m) for m in args.fp8linear_rows.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(M), (2, M, K), jnp.float32).astype(jnp.bfloat16)
            bytes_min = wbytes + M * K * 2 + M * N * 2
            flops = 2.0 * M * N * K
            picked = ft.pick_config(M)
            pname = next(n for n, c in ft.NAMED_CONFIGS.items() if c is picked)
            row = dict(shape=name, N=N, K=K, M=M, bytes_min=bytes_min, flops=flops, config=pname,
                       plan={k: v for k, v in ft.plan(picked, M, N, K).items() if k != "grid"},
                       roofline_s=_roof(bytes_min, flops, ceilings))
            ops = {"triton": lambda x_, w_, s_, c=picked: ft.fp8_linear_triton(x_, w_, s_, config=c),
                   "xla_ref": lambda x_, w_, s_: fl.fp8_linear_reference(x_, w_, s_, precision="reference")}
            if M <= ft.DECODE_MAX_ROWS:
                for cn in args.fp8linear_configs.split(","):
                    if cn and cn != pname:
                        ops["triton_" + cn] = lambda x_, w_, s_, c=cn: ft.fp8_linear_triton(x_, w_, s_, config=c)
            _time_pair(row, ops, (x,), (w, s), args, log)
            for k in list(row):
                if k.startswith("triton") and k.endswith("_s") and row[k]:
                    row[k[:-2] + "_weight_TBps"] = wbytes / row[k] / 1e12
            try:
                ref = np.asarray(jax.jit(lambda a: fl.fp8_linear_reference(a, w, s))(x[0]), np.float32)
                got = np.asarray(jax.jit(lambda a: ft.fp8_linear_triton(a, w, s, config=picked))(x[0]), np.float32)
                row["bf16_changed_frac"] = float(np.mean(got != ref))
                row["rel_err_vs_ref"] = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
            except Exception as e:  # noqa: BLE001
                row["check_error"] = repr(e)[:400]
            rows.append(row)
            log(json.dumps(row))
            save()


def _fmt(v, scale=1e3, nd=3):
    return "-" if v is None else f"{v * scale:.{nd}f}"


def table(rows, ceilings):
    lines = [f"copy {ceilings.get('copy_TBps', 0):.2f} TB/s, bf16 matmul {ceilings.get('bf16_TFLOPs', 0):.0f} TFLOP/s"
             f", fp8 matmul {ceilings.get('fp8_matmul_TFLOPs_torch', 0):.0f} TFLOP/s (measured in this run)",
             f"{'T':>6} {'slots':>6} {'act':>5} {'triton ms':>10} {'xla ms':>9} {'bf16peer':>9} {'fp8peer':>9} "
             f"{'roof ms':>8} {'%roof':>6} {'wTB/s':>6} {'TFLOP/s':>8} {'xXLA':>6} {'xbf16':>6} {'xfp8':>6} {'relerr':>8}"]
    for r in rows:
        g = r.get
        lines.append(
            f"{r['T']:>6} {r['slots']:>6} {r['active_experts']:>5.0f} {_fmt(g('triton_s')):>10} {_fmt(g('xla_ref_s')):>9} "
            f"{_fmt(g('torch_grouped_mm_bf16_s')):>9} {_fmt(g('torch_scaled_grouped_mm_fp8_s')):>9} "
            f"{_fmt(g('roofline_s')):>8} {_fmt(g('frac_of_roofline'), 100, 1):>6} {_fmt(g('weight_TBps'), 1, 2):>6} "
            f"{_fmt(g('TFLOPs'), 1, 0):>8} {_fmt(g('speedup_vs_xla_ref'), 1, 2):>6} "
            f"{_fmt(g('speedup_vs_torch_grouped_mm_bf16'), 1, 2):>6} "
            f"{_fmt(g('speedup_vs_torch_scaled_grouped_mm_fp8'), 1, 2):>6} "
            f"{(format(g('rel_err_vs_ref'), '.1e') if g('rel_err_vs_ref') is not None else '-'):>8}")
    return "\n".join(lines)


# the size each section's row means to kernels/dispatch.py (use_triton's ``size``)
DISPATCH_SIZES = {"moe_gemm": ("moe", lambda r: r["slots"]),
                  "sparse_attention": ("sparse_attention", lambda r: r["B"] * r["S"]),
                  "indexer": ("indexer", lambda r: r["B"] * r["S"] * r["T"]),
                  "mhc": ("mhc", lambda r: r["T"])}


def mark_dispatch(result, backend):
    """Record per row what the dispatch runs at that shape under ``backend`` ("triton" | "xla"), so one JSON holds
    the timings and the crossover tables' decision side by side (precision "reference", as timed)."""
    result["backend"], result["backend_resolved"] = backend, resolve_backend(backend)
    for sec, (kernel, size) in DISPATCH_SIZES.items():
        for r in result.get(sec, []):
            r["dispatch"] = "triton" if use_triton(kernel, backend, size(r), precision="reference") else "xla"
    if result.get("fp8_linear"):
        from dsflash.kernels import fp8_linear
        for r in result["fp8_linear"]:
            r["dispatch"] = "triton" if fp8_linear.use_triton(backend, r["M"], "reference") else "xla"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsflash.bench kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,16,64,256,4096,16384", help="tokens per rank, comma-separated")
    ap.add_argument("--experts", type=int, default=96, help="local routed experts")
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--d", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=2304)
    ap.add_argument("--xla-max-tokens", type=int, default=4096, help="skip the XLA reference above this")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-configs",
                    default="fp8mma_decode,ds_decode_rt,sk_bf16,sk_bf16_bk256,sk_bf16_w8,slab_bf16,sk_fp8,sk_gemv,"
                    "sk_gemv_bk256",
                    help="named configs (moe_plan.named_config) timed when slots <= 32 * experts")
    ap.add_argument("--prefill-configs", default="ds_prefill_rt,ds_prefill_bn128",
                    help="named configs timed above that")
    ap.add_argument("--bf16-tokens", default="64,4096", help="sizes where the bf16-activation variant is timed")
    ap.add_argument("--check-max-tokens", type=int, default=4096, help="error vs reference up to this size")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--attn-shapes", default="1x1,32x1,128x1,32x6",
                    help="sparse attention decode shapes BxS (sequences x query rows); empty to skip")
    ap.add_argument("--attn-ctx", type=int, default=4096, help="cached rows per sequence for sparse attention")
    ap.add_argument("--attn-variants", default="fused_dv128,fused_dv256,fused_dv256_bk32,fused_dv512,fused_dv512_bk32,"
                    "split_ch128_dv128,split_ch64_dv128,split_ch128_dv512,split_auto_dv256,"
                    "flash_bk32,flash_bk32_s7,flash_bk32_s3,flash_bk64,flash_bk64_s2,flash_bk32_ns1,flash_bk64_ns1,"
                    "flash_bk32_ns2",
                    help="sparse_attention_triton.NAMED_CONFIGS timed per shape (a column each)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="the model's backend setting: each row records what kernels/dispatch.py runs at its shape "
                         "under it (\"dispatch\"); the kernels and the XLA reference are timed either way")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--ops", default="moe,attn,indexer,mhc", help="sections to run, comma-separated (also: fp8linear)")
    ap.add_argument("--indexer-shapes", default="1x1x8192,64x1x16384,256x1x8192,32x1x65536,128x6x16384,"
                    "1x4096x4096,1x16384x16384",
                    help="indexer shapes BxSxT (sequences x query rows x compressed entries)")
    ap.add_argument("--indexer-xla-max-rows", type=int, default=4096,
                    help="skip the XLA indexer reference above B*S rows (it materialises [B,S,32,T] bf16)")
    ap.add_argument("--indexer-hw-round", action="store_true",
                    help="also time the indexer scores with hw_round=False (the integer bf16 rounding the "
                    "default hardware rounding replaced; column triton_scores_int, bits in hw_vs_int_bits_equal) and "
                    "hw_round=2 (the convert alone: triton_scores_cvt, cvt_vs_int_bits_equal)")
    ap.add_argument("--mhc-tokens", default="1,16,64,256,4096,16384", help="fused mHC token counts")
    ap.add_argument("--mhc-plans", default="", help="plan overrides timed beside the default, as "
                    "name=KEY:VALUE/KEY:VALUE,... (e.g. b1=warps_b:1,ds40=BD:128/DS:40; keys of kernel_plan)")
    ap.add_argument("--fp8linear-rows", default="1,6,32,192,384,4096", help="dense FP8 linear row counts M")
    ap.add_argument("--fp8linear-shapes", default="all",
                    help="names of FP8_LINEAR_SHAPES (wq_a,wq_b,wkv,wo_b,wo_a,sh_w13,sh_w2) or all")
    ap.add_argument("--fp8linear-configs", default="decode,decode_bn128,decode_xrt",
                    help="fp8_linear_triton.NAMED_CONFIGS also timed at M <= 384 (columns triton_<name>)")
    ap.add_argument("--quick", action="store_true", help="smaller ceiling measurements")
    ap.add_argument("--out", default=None, help="directory for the JSON (default benchmarks/results)")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # dry run of the code paths
    args = ap.parse_args(argv)

    import jax
    dev = jax.devices()[0]
    if dev.platform != "gpu" and not args.allow_cpu:
        print(f"bench kernels needs a CUDA GPU (jax sees {dev.platform}); set JAX_PLATFORMS=cuda", file=sys.stderr)
        return 2
    log_lines = []

    def log(s):
        log_lines.append(s)
        print(s, flush=True)

    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for m in ("jaxlib", "triton", "jax_triton", "torch"):
        try:
            versions[m] = __import__(m).__version__
        except Exception:  # noqa: BLE001
            versions[m] = None
    t0 = time.time()
    now = _dt.datetime.now(_dt.timezone.utc)
    kind = dev.device_kind.replace(" ", "_").lower()
    out_dir = args.out or os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    short = "h200" if "h200" in kind else kind
    path = os.path.join(out_dir, f"kernels_{now.strftime('%Y%m%d')}_{short}.json")
    result = dict(benchmark="kernels/moe_gemm", device=dev.device_kind, commit=_commit(),
                  date=now.isoformat(timespec="seconds"), versions=versions,
                  command="python -m dsflash.bench kernels " + " ".join(sys.argv[1:] if argv is None else argv),
                  config=dict(d=args.d, inter=args.inter, experts=args.experts, topk=args.topk,
                              tokens=args.tokens, reps=args.reps,
                              weights="MXFP4 (E2M1 + UE8M0/32), random bytes, scales 2^-8..2^-4",
                              precision="reference (FP8 E4M3/32 activations)", routing="uniform random distinct"),
                  ceilings={}, moe_gemm=[], sparse_attention=[], indexer=[], mhc=[], fp8_linear=[])
    ops = set(args.ops.split(","))

    def save():   # after every size, so a run cut short still leaves its numbers
        result["wall_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    result["ceilings"] = ceilings = measure_ceilings(args.quick)
    log(json.dumps(ceilings))
    save()
    if not args.skip_moe and "moe" in ops:
        bench_moe(args, ceilings, log, result["moe_gemm"], save)
    rows = result["moe_gemm"]
    result["sparse_attention"] = []
    if args.attn_shapes and "attn" in ops:
        bench_sparse_attn(args, ceilings, log, result["sparse_attention"], save)
    if "indexer" in ops:
        bench_indexer(args, ceilings, log, result["indexer"], save)
    if "mhc" in ops:
        bench_mhc(args, ceilings, log, result["mhc"], save)
    if "fp8linear" in ops:
        bench_fp8_linear(args, ceilings, log, result["fp8_linear"], save)
    mark_dispatch(result, args.backend)
    save()
    print(f"\nwrote {path}")
    print("per-config ms (best marked *):")
    for r in rows:
        cells = []
        for n, v in r["configs"].items():
            mark = "*" if n == r.get("triton_best_config") else ""
            cells.append(f"{n}{mark}={_fmt(v) if v else 'ERR'}")
        extra = f" kernels-only {_fmt(r.get('kernels_only_s'))}"
        if r.get("triton_bf16_variant_s"):
            extra += f" bf16-act {_fmt(r['triton_bf16_variant_s'])}"
        if r.get("jit_ref_vs_eager_ref_rel") is not None:
            extra += f" | err vs jit-ref {r['rel_err_vs_jit_ref']:.1e}, jit-ref vs eager-ref {r['jit_ref_vs_eager_ref_rel']:.1e}"
        print(f"  T={r['T']:>6} " + " ".join(cells) + extra)
    print(table(rows, ceilings))
    if result["sparse_attention"]:
        print("sparse sink attention (H=64, D=512, K=640):")
        print(f"{'B':>5} {'S':>3} {'triton ms':>10} {'xla ms':>9} {'roof ms':>8} {'%roof':>6} {'TB/s':>6} {'xXLA':>6} {'relerr':>8}")
        for r in result["sparse_attention"]:
            g = r.get
            print(f"{r['B']:>5} {r['S']:>3} {_fmt(g('triton_s')):>10} {_fmt(g('xla_ref_s')):>9} {_fmt(g('roofline_s')):>8} "
                  f"{_fmt(g('frac_of_roofline'), 100, 1):>6} {_fmt(g('TBps'), 1, 2):>6} "
                  f"{_fmt(g('speedup_vs_xla_ref'), 1, 2):>6} "
                  f"{(format(g('rel_err_vs_ref'), '.1e') if g('rel_err_vs_ref') is not None else '-'):>8}")
        print("  per-variant ms (triton = picked variant; * = best; rel err vs ref):")
        for r in result["sparse_attention"]:
            cells = [f"{n}{'*' if n == r.get('best_variant') else ''}={_fmt(v)}"
                     f"({r['variant_rel_err'].get(n, float('nan')):.0e})" for n, v in r.get("variants", {}).items()]
            print(f"  B{r['B']} S{r['S']} picked {r.get('picked_variant')}: " + " ".join(cells))
    for sec, keys in (("indexer", ("B", "S", "T")), ("mhc", ("T",))):
        if result[sec]:
            print(f"{sec}: " + "x".join(keys) + "  triton ms / xla ms / roof ms / %roof / xXLA")
            for r in result[sec]:
                g = r.get
                extra = f" scores-only {_fmt(g('triton_scores_only_s'))}" + (
                    f" (tile form {_fmt(g('triton_scores_tiles_s'))}, same bits {g('rows_vs_tiles_bits_equal')})"
                    if g("triton_scores_tiles_s") else "") + (
                    f" int-round {_fmt(g('triton_scores_int_s'))} (same bits {g('hw_vs_int_bits_equal')})"
                    f" convert-alone {_fmt(g('triton_scores_cvt_s'))} (same bits {g('cvt_vs_int_bits_equal')})"
                    if g("triton_scores_int_s") else "") if sec == "indexer" else \
                    f" relerr X1 {g('rel_err_X1', float('nan')):.1e} comb {g('rel_err_comb', float('nan')):.1e}"
                print(f"  {'x'.join(str(r[k]) for k in keys):>16} {_fmt(g('triton_s')):>9} {_fmt(g('xla_ref_s')):>9} "
                      f"{_fmt(g('roofline_s')):>8} {_fmt(g('frac_of_roofline'), 100, 1):>6} "
                      f"{_fmt(g('speedup_vs_xla_ref'), 1, 2):>6}{extra}")
    if result["fp8_linear"]:
        print("dense FP8 linears: shape M config  triton ms / weight TB/s / xla ms / roof ms / xXLA / bf16 changed;"
              " other configs ms")
        for r in result["fp8_linear"]:
            g = r.get
            alt = " ".join(f"{k[7:-2]}={_fmt(v)}" for k, v in r.items()
                           if k.startswith("triton_") and k.endswith("_s") and "TBps" not in k)
            print(f"  {r['shape']:>7} {r['M']:>5} {r['config']:>8} {_fmt(g('triton_s')):>8} "
                  f"{_fmt(g('triton_weight_TBps'), 1, 2):>6} {_fmt(g('xla_ref_s')):>8} {_fmt(g('roofline_s')):>8} "
                  f"{_fmt(g('speedup_vs_xla_ref'), 1, 2):>6} {_fmt(g('bf16_changed_frac'), 100, 2):>6}%  {alt}")
    return 0
