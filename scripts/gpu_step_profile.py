"""Whole-step per-op profile on the GPU machine (issue 19): ceilings, then per point and variant the step time, the
kernel-busy time and the per-op table with each op's own floor (dsflash.bench.step_floor under the ceilings measured
in this run). One call, a short table last; everything in $OUT/step_profile.json. From the repo root:

  python3 scripts/gpu_step_profile.py --preset bench-4l-96e --backend triton \
      --decode 32@4096 1@4096 --prefill 4096@0 --variants new,old --out $OUT

Variants: ``new`` = the code as it is; ``old`` = the dense linears / head / gate / compressor with fp32-widened
operands (``layers.tensor_cores`` forced False: the pre-change path, for the A/B in the same run); ``fp8lin`` = the
dense FP8 linears through the Triton FP8-weight kernel at every row count and weight size; ``fp8big`` = only the
weights of >= 16 M elements (wq_b, wo_b) at <= 384 rows; ``fp8off`` = none of them (XLA's dequantised copy); ``fp8grp`` = the default plus the grouped wo_a
launch (``fp8_linear.GROUPED``); ``moe32`` = the default with ``sw_eo_np_bm32`` (BM 32 token tiles) as the MoE decode
config above 384 slots; ``grp32`` = both; ``gather`` = the default with the paged indexer off (decode calls gather every
index key to bf16 and score with the "indexer" kernel, the path before 2026-12-02); ``topk`` = the default with the
Triton radix top-k (kernels/topk_triton.py) at every row length; ``notopk`` = the default with it off; ``fp8bn64`` =
the FP8 linears' decode band on the "decode" config (BN 64, the default before run 29) instead of "decode_bn128";
``moeil`` = the default with the routed experts' weights repacked once into the load-time "il" layout
(``dsflash.model.params.moe_il_weights``; decode then runs the MoE config ``sw_il``, prefill converts back per call);
``moeil_ffi`` / ``moeil_legacy`` = ``moeil`` with the Triton launches in jaxlib's FFI custom-call form (which XLA
can record into its command buffers) / in jax-triton's legacy form (which it cannot): ``kernels.triton_call.USE_FFI``
on / off, the A/B; ``moeil_paged`` = ``moeil`` with the paged sparse attention (``sparse_attention_paged_triton``:
the picked compressed entries read from the NVFP4 pool, no bf16 gather or concatenation) at every row count;
``moeil_ropek`` / ``moeil_ropex`` = ``moeil`` with RoPE in the one-split flash kernel / in XLA around it
(``sparse_attention_triton.ROPE_IN_KERNEL`` on / off); ``moeil_fullrows`` = ``moeil_ropex`` with the radix top-k
reading whole rows (``topk_triton.READ_TO_VISIBLE`` off, as before session 22); ``moeil_cvt`` = ``moeil_ropex`` with
the indexer scorer's rounding as the convert alone (``indexer_topk_triton.HW_ROUND_DEFAULT`` 2); ``moeil_ropei`` =
``moeil_ropex`` with the tails rotated in place by a small kernel (``sparse_attention_triton.ROPE_INPLACE``);
``moeil_gluon`` = ``moeil`` with the Gluon flash kernel from 257 rows (``sparse_attention_triton.GLUON_FROM_ROWS``,
4,096 by default since session 26); ``moeil_nogluon`` = ``moeil`` with the Triton flash kernel at every row count.
``moeil_lastred`` / ``moeil_fp8bm256`` = ``moeil`` with the dense FP8 decode band on ``dec_bn128_lastred`` (split K
summed by each tile's last program) / ``dec_bn64_bm256_bk64`` (kernels/experimental/fp8_configs.py, session 27).
``moeil_planes`` = ``moeil`` with the dense FP8 decode band on ``dec_bn128_planes`` (E4M3 decoded by bit placement
into even / odd K planes; session 28). ``moeil_sd3`` = ``moeil`` with the il band of 9-32 slots per expert on ``sw_il_bm32_sd3`` (the down launch at 3
stages: 6 programs per SM instead of 4; session 28); ``moeil_xbs3`` = ``moeil`` with the two decode bands on
``sw_il_xb_s3`` / ``sw_il_bm32_xb_s3`` (x dequantised once before the up kernel, 3 stages; session 28);
``moeil_epirow`` / ``moeil_epiblk`` = ``moeil`` with mHC's kernel B one program a token below 512 tokens / in
16-token blocks everywhere (``mhc_fused_plan.EPI_ROWS_BELOW`` 512 -- the default since session 29 -- / 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())


def ceilings(gb=None):
    """Measured ceilings (moved to dsflash.bench.ceilings: 1-D streaming read, device copy, bf16 / FP8 GEMMs, torch
    peers)."""
    from dsflash.bench.ceilings import measure
    return measure(read_bytes=int(gb * 1e9) if gb else None)      # None: 4 GB on a GPU, small elsewhere


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
    ap.add_argument("--cb-modes", nargs="*", default=[],
                    help="also time the step compiled with each of these xla_gpu_enable_command_buffer values "
                         "(comma-separated command types, e.g. FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL; '' = off)")
    ap.add_argument("--mhc-plan", default="",
                    help="an experiment's overrides of the fused mHC kernel plan for every call, KEY:VALUE/KEY:VALUE "
                         "(as bench kernels --mhc-plans, one plan)")
    ap.add_argument("--no-profile", action="store_true",
                    help="time the step (and --cb-modes) and count its command buffers; no trace, no per-op table")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import jax

    if a.mhc_plan:                          # an experiment only: the served model takes kernel_plan as it is
        from dsflash.bench.kernels import mhc_plan_overrides
        from dsflash.kernels import mhc_fused_triton
        ov, base_config = mhc_plan_overrides(f"x={a.mhc_plan}")["x"], mhc_fused_triton.launch_config
        mhc_fused_triton.launch_config = lambda *x, plan=None, **k: base_config(*x, plan=plan or ov, **k)

    from dsflash.bench import step_floor as SF
    from dsflash.bench import step_profile as SP
    from dsflash.bench.ceilings import format_ceilings
    from dsflash.bench.forward import ForwardBench, build_parser, parse_points
    from dsflash.model import layers

    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(a), "points": []}
    if not a.no_ceilings:
        res["ceilings"] = ceilings()
        print("ceilings", json.dumps(res["ceilings"]), flush=True)
        print(format_ceilings(res["ceilings"]), flush=True)
    fargs = build_parser().parse_args(["--preset", a.preset, "--backend", a.backend, "--precision", a.precision,
                                       "--reps", str(a.reps), "--warmup", "2", "--draft-rows", str(a.draft_rows)])
    t0 = time.perf_counter()
    bench = ForwardBench(fargs)
    bench.ceilings = res.get("ceilings")
    print(f"params placed in {time.perf_counter() - t0:.1f} s", flush=True)
    pts = [("decode", n, c) for n, c in parse_points(a.decode)] + [("prefill", n, c) for n, c in parse_points(a.prefill)]
    summary = []
    il_params = None          # bench.params with the routed experts in the il layout (variant "moeil"), made once
    real_tc = layers.tensor_cores
    from dsflash.kernels import dispatch, fp8_linear
    real_fp8 = (dispatch.GATES["fp8_linear"], fp8_linear.MIN_WEIGHT_ELEMENTS)
    real_grouped = fp8_linear.GROUPED
    from dsflash.kernels import moe_plan
    real_moe = moe_plan.DECODE_CONFIG
    real_bands = moe_plan.IL_BANDS
    from dsflash.kernels import mhc_fused_plan
    real_epi_rows = mhc_fused_plan.EPI_ROWS_BELOW
    real_paged = dispatch.GATES["indexer_paged"]
    real_attn_paged = dispatch.GATES["sparse_attention_paged"]
    real_topk = dispatch.GATES["topk"]
    from dsflash.kernels import fp8_linear_triton
    real_fp8cfg = fp8_linear_triton.DECODE_CONFIG
    from dsflash.kernels import triton_call
    real_ffi = triton_call.USE_FFI
    from dsflash.kernels import sparse_attention_triton
    real_rope, real_inplace = sparse_attention_triton.ROPE_IN_KERNEL, sparse_attention_triton.ROPE_INPLACE
    real_gluon = sparse_attention_triton.GLUON_FROM_ROWS
    from dsflash.kernels import indexer_topk_triton, topk_triton
    real_vis, real_hw = topk_triton.READ_TO_VISIBLE, indexer_topk_triton.HW_ROUND_DEFAULT
    fp8_gates = {"fp8lin": (real_fp8[0].replace(triton=((1, None),)), 0),
                 "fp8big": (real_fp8[0].replace(triton=((1, 384),)), 16 << 20),
                 "fp8off": (real_fp8[0].replace(triton=()), 0),
                 # the il layout's A/B of the dense FP8 kernel's upper row bound (384 until session 24, 256 since):
                 # the band to 256 / 384 rows, or XLA's dequantised copy at every row count
                 "moeil_fp8_256": (real_fp8[0].replace(triton=((1, 256),)), real_fp8[1]),
                 "moeil_fp8_384": (real_fp8[0].replace(triton=((1, 384),)), real_fp8[1]),
                 "moeil_fp8off": (real_fp8[0].replace(triton=()), real_fp8[1])}
    for phase, n, C in pts:
        S, rows = (a.draft_rows, n) if phase == "decode" else (n, 1)
        for var in a.variants.split(","):
            layers.tensor_cores = (lambda: False) if var == "old" else real_tc
            dispatch.GATES["fp8_linear"], fp8_linear.MIN_WEIGHT_ELEMENTS = fp8_gates.get(var, real_fp8)
            fp8_linear.GROUPED = var in ("fp8grp", "grp32") or real_grouped
            moe_plan.DECODE_CONFIG = moe_plan.named_config("sw_eo_np_bm32") if var in ("moe32", "grp32") else real_moe
            band_swap = {"moeil_sd3": {"sw_il_bm32": "sw_il_bm32_sd3"},
                         "moeil_xbs3": {"sw_il": "sw_il_xb_s3", "sw_il_bm32": "sw_il_bm32_xb_s3"}}.get(var, {})
            moe_plan.IL_BANDS = tuple((m, band_swap.get(n, n)) for m, n in real_bands)
            mhc_fused_plan.EPI_ROWS_BELOW = {"moeil_epirow": 512, "moeil_epiblk": 0}.get(var, real_epi_rows)
            dispatch.GATES["indexer_paged"] = real_paged.replace(triton=()) if var == "gather" else real_paged
            fp8_linear_triton.DECODE_CONFIG = {"fp8bn64": "decode", "moeil_lastred": "dec_bn128_lastred",
                                               "moeil_fp8bm256": "dec_bn64_bm256_bk64",
                                               "moeil_planes": "dec_bn128_planes"}.get(var, real_fp8cfg)
            dispatch.GATES["topk"] = real_topk.replace(triton=((1, None),)) if var == "topk" else \
                real_topk.replace(triton=()) if var == "notopk" else real_topk
            triton_call.USE_FFI = {"moeil_ffi": True, "moeil_legacy": False}.get(var, real_ffi)
            dispatch.GATES["sparse_attention_paged"] = real_attn_paged.replace(triton=((1, None),)) \
                if var == "moeil_paged" else real_attn_paged
            sparse_attention_triton.ROPE_IN_KERNEL = {"moeil_ropek": True, "moeil_ropex": False, "moeil_fullrows": False,
                                                      "moeil_cvt": False, "moeil_ropei": False}.get(var, real_rope)
            sparse_attention_triton.ROPE_INPLACE = {"moeil_ropei": True, "moeil_ropex": False}.get(var, real_inplace)
            sparse_attention_triton.GLUON_FROM_ROWS = {"moeil_gluon": 257, "moeil_nogluon": None}.get(var, real_gluon)
            topk_triton.READ_TO_VISIBLE = False if var == "moeil_fullrows" else real_vis
            indexer_topk_triton.HW_ROUND_DEFAULT = 2 if var == "moeil_cvt" else real_hw
            uses_il = var.startswith("moeil")           # moeil and its A/B variants run the il layout
            if uses_il and il_params is None:
                from dsflash.model.params import moe_il_weights
                t1 = time.perf_counter()
                il_params = moe_il_weights(bench.cfg, bench.params)
                jax.block_until_ready(il_params)
                print(f"routed experts repacked to the il layout in {time.perf_counter() - t1:.1f} s", flush=True)
            params = il_params if uses_il else bench.params
            try:
                batch, state = bench.make_inputs(S, [C] * rows)
                with SP.scoped_model():
                    fn = bench.step_fn("full", phase)
                    t1 = time.perf_counter()
                    lowered = jax.jit(fn, donate_argnums=(2,)).lower(params, batch, state)
                    compiled = lowered.compile()
                    cs = time.perf_counter() - t1
                stats, state, loads, finite = bench.time_step(compiled, params, batch, state)
                census = {"default": SP.command_buffer_census(compiled.as_text())}
                print(f"   command buffers (XLA default): step {stats['median']:.3f} ms, host enqueue "
                      f"{stats['enqueue_median']:.3f} ms, back to back {stats['pipelined_mean']:.3f} ms; "
                      f"{census['default']}", flush=True)
                touched = [int((l > 0).sum()) for l in loads] if loads.size else []
                cb_note = "command buffers on (XLA default)"
                if a.profile_no_cb:
                    try:
                        compiled = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
                        cb_note = "traced without command buffers"
                    except Exception as e:  # noqa: BLE001
                        cb_note = f"command buffers could not be turned off: {e!r}"[:200]
                    stats_nocb, state, _, _ = bench.time_step(compiled, params, batch, state)
                else:
                    stats_nocb = None
                cb_modes = {}
                for mode in a.cb_modes:         # which command types XLA records changes the gaps between kernels
                    try:
                        c2 = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": mode})
                        st, state, _, _ = bench.time_step(c2, params, batch, state)
                        census[mode] = SP.command_buffer_census(c2.as_text())
                        cb_modes[mode] = st
                        print(f"   command buffers {mode!r}: step {st['median']:.3f} ms, host enqueue "
                              f"{st['enqueue_median']:.3f} ms, back to back {st['pipelined_mean']:.3f} ms; "
                              f"{census[mode]}", flush=True)
                        del c2
                    except Exception as e:  # noqa: BLE001
                        cb_modes[mode] = {"error": repr(e)[:300]}
                        print(f"   command buffers {mode!r}: {e!r}"[:300], flush=True)
                if a.no_profile:          # timings and the census only (an A/B of whole steps), no trace
                    res["points"].append({"phase": phase, "n": n, "C": C, "S": S, "rows": rows, "variant": var,
                                          "compile_s": cs, "step_ms": stats, "step_ms_no_command_buffers": stats_nocb,
                                          "step_ms_cb_modes": cb_modes, "command_buffer_census": census,
                                          "finite": finite})
                    summary.append((f"{phase} {n}x{S}@{C}", var, stats["median"], float("nan"), 0, None))
                    del state, compiled
                else:
                    hlo = compiled.as_text()
                    if a.dump_hlo:
                        with open(os.path.join(a.out, f"hlo_{phase}_{n}_{C}_{var}.txt"), "w") as f:
                            f.write(hlo)
                    box = {"state": state}

                    def once():
                        lg, box["state"], _ = compiled(params, batch, box["state"])
                        jax.block_until_ready((lg, box["state"]))

                    prof = SP.profile_step(once, hlo, calls=a.calls)
                    floor = SF.step_floor(bench.cfg, rows, S, C, a.precision, loads if loads.size else None,
                                          ceilings=bench.ceilings, logits=bench.logits_for(phase),
                                          ring_slack=bench.geometry(1, S, C)[0].ring_slack)
                    extra = None
                    if phase == "decode" and bench.cfg.n_stages:
                        extra = {"draft": (None, SF.draft_floor(bench.cfg, rows, S, C, a.precision,
                                                                ceilings=bench.ceilings)["total"])}
                    tab = SF.op_table(prof, floor, extra)
                    rec = {"phase": phase, "n": n, "C": C, "S": S, "rows": rows, "variant": var, "compile_s": cs,
                           "step_ms": stats, "step_ms_no_command_buffers": stats_nocb, "step_ms_cb_modes": cb_modes,
                           "command_buffer_census": census,
                           "finite": finite,
                           "logits": bench.logits_for(phase), "experts_touched_per_layer": touched, "trace": cb_note,
                           "profile": prof, "floor": floor, "op_table": tab}
                    res["points"].append(rec)
                    print(f"\n== {phase} {n}x{S}@{C} variant={var}: step {stats['median']:.3f} ms"
                          + (f" ({stats_nocb['median']:.3f} without command buffers)" if stats_nocb else "")
                          + f" (compile {cs:.0f} s, finite {finite}, logits {rec['logits']}, experts touched {touched}; "
                          f"{cb_note})", flush=True)
                    print(SF.format_table(tab, prof, floor, stats["median"]), flush=True)
                    print("largest gaps:", json.dumps(prof["gaps"]["largest_us"][:6]), flush=True)
                    print("graphs (trace):", json.dumps(prof["graphs"]), flush=True)
                    summary.append((f"{phase} {n}x{S}@{C}", var, stats["median"], prof["busy_ms"],
                                    prof["kernels_per_step"], floor["total"].get("floor_ms"),
                                    floor["total"].get("exact_floor_ms")))
                    del state, box, compiled
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                summary.append((f"{phase} {n}x{S}@{C}", var, float("nan"), float("nan"), 0, None, None))
            with open(os.path.join(a.out, "step_profile.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
    layers.tensor_cores = real_tc
    dispatch.GATES["fp8_linear"], fp8_linear.MIN_WEIGHT_ELEMENTS = real_fp8
    fp8_linear.GROUPED = real_grouped
    moe_plan.DECODE_CONFIG = real_moe
    dispatch.GATES["indexer_paged"] = real_paged
    dispatch.GATES["topk"] = real_topk
    fp8_linear_triton.DECODE_CONFIG = real_fp8cfg
    triton_call.USE_FFI = real_ffi
    sparse_attention_triton.ROPE_IN_KERNEL, sparse_attention_triton.ROPE_INPLACE = real_rope, real_inplace
    sparse_attention_triton.GLUON_FROM_ROWS = real_gluon
    topk_triton.READ_TO_VISIBLE, indexer_topk_triton.HW_ROUND_DEFAULT = real_vis, real_hw
    dispatch.GATES["sparse_attention_paged"] = real_attn_paged
    # %exact: against the floor with every GEMM at the bf16 rate (step_floor.EXACT_FLOOR)
    print("\npoint                 variant   step ms   busy ms   kernels  floor ms  %floor  %exact")
    for p, v, ms, busy, k, fl, ex in summary:
        pct = f"{100 * fl / ms:>8.1f}" if fl and ms == ms else f"{'-':>8}"
        pex = f"{100 * ex / ms:>8.1f}" if ex and ms == ms else f"{'-':>8}"
        print(f"{p:<22}{v:<8}{ms:>9.3f}{busy:>10.3f}{k:>10.0f}{(fl if fl else float('nan')):>10.4f}{pct}{pex}")


if __name__ == "__main__":
    main()
