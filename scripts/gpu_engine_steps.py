"""The engine's prefill and mixed steps at real widths (issue 19 targets: TTFT of a lone prompt, "mixed steps no
slower than their parts"). One engine per prefill-bucket set, same model (placed once), no speculation:

1. start-up (compiling every program) and the TTFT of a lone ``--prompt-len``-token prompt (median of
   ``--lone`` prompts after a warm one) with the number of prefill steps it took;
2. ``--decoding`` sequences in their decode phase, then one new prompt: the wall time of decode-only steps vs the
   steps that also carry a prefill chunk (mixed), and of a prefill-only step of the same chunk;
3. ``--trace N``: N decode-only steps under ``jax.profiler``, the decode program's kernels per model op
   (``dsflash.bench.step_profile``; engine ops outside the model show as ``unscoped:file:line``);
4. ``--call-overhead N``: one decode call replayed N times at 0, 1 and ``--decode-steps`` loop iterations, its wall
   time split into inputs to the device, dispatch, run and results to the host (the fixed cost of a call).

A short table last; everything in ``--out``/engine_steps.json. From the repo root (GPU machine):

  python3 scripts/gpu_engine_steps.py --model bench-4l-96e --buckets default 4x256 --out $OUT

CPU check: ``JAX_PLATFORMS=cpu python3 scripts/gpu_engine_steps.py --model tiny --prompt-len 96 --budget 64
--decoding 4 --max-model-len 256 --buckets default 4x16``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())


def _buckets(spec: str):
    if spec == "default":
        return None
    return [tuple(int(v) for v in b.split("x")) for b in spec.split(",")]


def _run_until(eng, pred, limit=10_000, strict=True):
    """Step until ``pred()`` (at most ``limit`` steps; ``strict``: not reaching it is an error); returns
    [(wall s, prefill calls, decode iters)] per step."""
    rows = []
    for _ in range(limit):
        if pred():
            return rows
        m0 = eng.metrics_snapshot()
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        m1 = eng.metrics_snapshot()
        rows.append((dt, m1["num_prefill_calls"] - m0["num_prefill_calls"],
                     m1["num_decode_iters"] - m0["num_decode_iters"]))
    if strict:
        raise RuntimeError("engine did not reach the state asked for")
    return rows


def call_overhead(eng, reps: int) -> list[dict]:
    """Where a decode call's wall time goes beyond its kernels: one decode-only step's inputs, replayed through
    the compiled program with ``max_iters`` 0 (the loop body never runs: the fixed cost of a call), 1 and the
    engine's ``decode_steps``, each call split into inputs to the device (``Runner.place``, which packs them, +
    ``device_put`` + wait), dispatch (until the call returns), run (until its results are ready), and results to the
    host (``packed.to_host``). The replays
    advance the device rows past the host's view, so only aborts follow."""
    import jax
    import numpy as np
    from dsflash.serve.engine.packed import to_host
    r = eng.runner
    seen = {}
    run_step = r.run_step

    def spy(pf, dc, *args, **kw):
        seen.setdefault("dc", dc)
        return run_step(pf, dc, *args, **kw)

    r.run_step = spy
    eng.step()
    r.run_step = run_step
    base = seen["dc"]
    out = []
    for iters in sorted({0, 1, r.max_iters}):
        inp = {**base, "max_iters": np.int32(iters)}
        rows = []
        for i in range(reps + 1):                      # the first call warms up
            jax.block_until_ready(r.state)
            t0 = time.perf_counter()
            dev = jax.block_until_ready(jax.device_put(r.place(inp)))     # (packed into one buffer: packed.py)
            t1 = time.perf_counter()
            res = r.decode(dev)
            t2 = time.perf_counter()
            jax.block_until_ready(res)
            t3 = time.perf_counter()
            host = to_host(res)
            t4 = time.perf_counter()
            if i:
                rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, int(host["iters"])))
        # the same bytes as one array: what packing the inputs into one transfer would cost
        flat = np.concatenate([np.asarray(v).reshape(-1).view(np.uint8) for v in jax.tree.leaves(inp)])
        packed = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(jax.device_put(flat))
            packed.append(time.perf_counter() - t0)
        med = lambda j: 1e3 * statistics.median(x[j] for x in rows)          # noqa: E731
        d = {"max_iters": iters, "iters_run": rows[-1][5], "inputs_ms": med(0), "dispatch_ms": med(1),
             "run_ms": med(2), "results_ms": med(3), "total_ms": med(4), "reps": reps,
             "inputs_one_array_ms": 1e3 * statistics.median(packed), "input_bytes": int(flat.nbytes),
             "input_arrays": len(jax.tree.leaves(inp)), "transfers": len(jax.tree.leaves(r.place(inp))),
             "result_arrays": len(jax.tree.leaves(res))}
        out.append(d)
        print("call overhead " + " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in d.items()), flush=True)
    return out


def one_set(model, a, spec: str, rng) -> dict:
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.types import SamplingParams
    from dsflash.bench import step_profile as SP
    t0 = time.perf_counter()
    with SP.scoped_model():            # named scopes in the compiled programs: the trace maps kernels to model ops
        eng = LLMEngine(model, speculative_mode="off", max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                        max_num_batched_tokens=a.budget, prefill_buckets=_buckets(spec), enable_prefix_caching=False,
                        decode_steps=a.decode_steps)
    startup = time.perf_counter() - t0
    V = eng.backend.vocab_size
    prompt = lambda n: [int(t) for t in rng.integers(4, V, size=n)]          # noqa: E731
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttft, psteps = [], []
    for i in range(a.lone + 1):                    # the first one warms up
        eng.add_request(f"lone{i}", prompt(a.prompt_len), first)
        t = time.perf_counter()
        rows = _run_until(eng, lambda: not eng.has_unfinished_requests())
        if i:
            ttft.append(time.perf_counter() - t)
            psteps.append(sum(1 for r in rows if r[1]))
    # mixed steps: decoding sequences, then a new prompt whose chunks share steps with their decode rows
    long = SamplingParams(max_tokens=a.max_model_len - 64, temperature=0.0, ignore_eos=True)
    n_dec = min(a.decoding, a.max_num_seqs - 1)
    for i in range(n_dec):
        eng.add_request(f"dec{i}", prompt(64), long)
    _run_until(eng, lambda: all(s.status == "decode" for s in eng.running) and len(eng.running) == n_dec)
    m0 = eng.metrics_snapshot()
    decode_only = [r[0] / max(1, r[2]) for r in _run_until(eng, lambda: False, limit=a.steps, strict=False) if not r[1]]
    host = eng.metrics_snapshot()["host_time_s"][-a.steps:]
    dec = eng.runner._compiled.get(("decode", 0))
    census = SP.command_buffer_census(dec.as_text()) if dec is not None else None
    print(f"decode program: {census}", flush=True)     # launches inside / outside XLA's command buffers (HLO text;
    # blind on jax 0.11, which forms them after HLO: the trace's "graphs" line below is the measure there)
    prof = None
    if a.trace:                        # the engine's decode program per op (kernels of the traced steps)
        prof = SP.profile_step(eng.step, dec.as_text(), calls=a.trace)
        print(f"decode program, {n_dec} sequences x {a.decode_steps} iterations: busy {prof['busy_ms']:.3f} ms, "
              f"wall {prof['wall_ms']:.3f} ms, {prof['kernels_per_step']:.0f} kernels a step", flush=True)
        for op, v in list(prof["ops"].items())[:24]:
            print(f"  {op:<44}{v['ms_per_step']:>9.3f} ms{v['kernels_per_step']:>7.0f} kernels", flush=True)
        print("  largest gaps:", json.dumps(prof["gaps"]["largest_us"][:6]), flush=True)
        print("  decode program graphs (trace):", json.dumps(prof["graphs"]), flush=True)
    eng.add_request("new", prompt(a.prompt_len), first)
    rows = _run_until(eng, lambda: "new" not in {s.request_id for s in list(eng.running) + list(eng.waiting)})
    mixed = [r[0] for r in rows if r[1] and r[2]]
    over = call_overhead(eng, a.call_overhead) if a.call_overhead else None      # last: it desyncs the rows
    for s in list(eng.running):
        eng.abort_request(s.request_id)
    _run_until(eng, lambda: not eng.has_unfinished_requests())
    med = lambda v: 1e3 * statistics.median(v) if v else None                 # noqa: E731
    return {"buckets": spec, "resolved_buckets": [list(b) for b in eng.runner.prefill_buckets],
            "startup_s": startup, "lone_ttft_ms": [1e3 * v for v in ttft], "lone_ttft_ms_median": med(ttft),
            "lone_prefill_steps": psteps, "decoding": n_dec, "decode_only_step_ms": med(decode_only), "decode_steps": a.decode_steps,
            "decode_only_host_ms": med(host),
            "mixed_step_ms": med(mixed), "mixed_steps": len(mixed), "decode_profile": prof, "decode_census": census, "call_overhead": over,
            "lone_prefill_step_ms": med(ttft) / max(1, statistics.median(psteps)) if ttft else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-4l-96e")
    ap.add_argument("--buckets", nargs="+", default=["default"],
                    help="prefill bucket sets, each 'default' or a comma list of ROWSxTOKENS")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--decoding", type=int, default=31)
    ap.add_argument("--lone", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=1, help="decode iterations per device call")
    ap.add_argument("--steps", type=int, default=8, help="decode-only steps timed before the new prompt")
    ap.add_argument("--trace", type=int, default=0, metavar="STEPS",
                    help="trace this many decode-only steps (jax.profiler) and print the decode program's per-op table")
    ap.add_argument("--call-overhead", type=int, default=0, metavar="REPS",
                    help="replay one decode call's inputs REPS times at 0, 1 and decode_steps iterations, split into "
                         "inputs / dispatch / run / results (after the trace)")
    ap.add_argument("--time-limit", type=float, default=None, help="skip the remaining bucket sets after this many s")
    ap.add_argument("--triton-launch", choices=("default", "ffi", "legacy"), default="default",
                    help="the Triton launches' custom-call form (kernels/triton_call.USE_FFI; default: its default)")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.triton_launch != "default":
        from dsflash.kernels import triton_call
        triton_call.USE_FFI = a.triton_launch == "ffi"
    import numpy as np

    from dsflash.serve.engine.backend import load_model
    t0 = time.perf_counter()
    model = load_model(a.model)
    print(f"model {a.model} loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    res = []
    for spec in a.buckets:
        if a.time_limit and time.perf_counter() - t0 > a.time_limit:
            print(f"skipped {spec}: past --time-limit", flush=True)
            continue
        r = one_set(model, a, spec, np.random.default_rng(0))
        print(json.dumps(r), flush=True)
        res.append(r)
        with open(os.path.join(a.out, "engine_steps.json"), "w") as f:
            json.dump({"args": vars(a), "results": res}, f, indent=2)
    print(f"\n{'buckets':<16} {'resolved':<24} {'start s':>8} {'TTFT ms':>8} {'pf steps':>8} {'dec ms':>8} "
          f"{'mixed ms':>9} {'pf step ms':>10}")
    for r in res:
        f = lambda v: f"{v:.2f}" if v is not None else "-"                   # noqa: E731
        print(f"{r['buckets']:<16} {str(r['resolved_buckets']):<24} {r['startup_s']:>8.1f} "
              f"{f(r['lone_ttft_ms_median']):>8} {str(r['lone_prefill_steps']):>8} {f(r['decode_only_step_ms']):>8} "
              f"{f(r['mixed_step_ms']):>9} {f(r['lone_prefill_step_ms']):>10}")


if __name__ == "__main__":
    main()
