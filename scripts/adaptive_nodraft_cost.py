"""What an adaptive engine's decode call costs when it does not draft, next to the plain engine's (issue 23: H100,
demo, documentation prompts, batch 8: adaptive drafted in 0 % of the timed calls yet ran 0.81x plain, its decode
iterations 2.46 ms against 2.02).

Two parts, same model, same engine geometry as ``python3 -m dsflash.bench engine`` (max_model_len 256, page 32,
budget 128, prefill bucket 4x32, 4 decode iterations a call):

1. ``--programs``: the compiled decode programs timed directly, interleaved, on identical inputs (every slot running
   from ``--pos``, the draft context current): the plain engine's, the adaptive engine's draft-length-0 one, and
   variants of the latter compiled here with one difference from the plain program each (``--variants``):
   ``notaps`` (no taps recorded, the adaptive program's output buffers), ``smallbuf`` (taps recorded, output
   buffers sized for one row per iteration), ``both`` (neither: the plain program on the adaptive engine's rows).
   Prints ms per iteration (min / median) and each over the plain engine's, and the optimised HLO's size (fusions,
   custom calls) of each program as a proxy for its kernel count.
2. ``--engines``: closed-batch passes of ``--batch`` documentation prompts through ``plain`` (speculative off) and
   ``adaptive_nodraft`` (speculative_mode adaptive, drafting forced off through the policy: ``force_plain``),
   interleaved; per engine the median pass's tokens/s, the decode-only steps' ms per step, per iteration and host
   ms per step (the step's time outside the device call), and the decode calls' own wall time (the cost model's
   sample, ``elapsed_s``) per iteration.

    PYTHONPATH=$PWD python3 scripts/adaptive_nodraft_cost.py --model demo --batch 8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from adaptive_common import force_plain, iteration_timer


def build(model, mode, args):
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine.backend import ModelBackend
    return LLMEngine(ModelBackend(model, moe_weight_layout="auto"), background_compile=False, speculative_mode=mode, max_num_seqs=args.batch,
                     max_model_len=args.max_model_len, page_size=args.page_size, max_num_batched_tokens=128,
                     decode_steps=args.decode_steps, enable_prefix_caching=False, prefill_buckets=[(4, 32)])


def hlo_size(compiled) -> dict:
    try:
        txt = compiled.as_text()
    except Exception:  # noqa: BLE001
        return {}
    return {"fusions": txt.count(" fusion("), "custom_calls": txt.count("custom-call("),
            "scatters": txt.count(" scatter("), "whiles": txt.count(" while(")}


def variant(eng, name):
    """The adaptive engine's draft-length-0 program compiled with one difference from the plain engine's."""
    import functools
    r = eng.runner
    patch = {"notaps": {"spec": False, "lazy_ctx": False}, "smallbuf": {"T_out": r.max_iters, "K1": 1},
             "both": {"spec": False, "lazy_ctx": False, "T_out": r.max_iters, "K1": 1}}[name]
    old = {k: getattr(r, k) for k in patch}
    inp = r.place(r.empty_decode_inputs())        # the engine's own inputs (its K1 mask positions)
    try:
        for k, v in patch.items():
            setattr(r, k, v)
        fn = jax.jit(functools.partial(r._decode_impl, drafting=False), donate_argnums=(1, 2))
        return fn.lower(r.params, r.state, r.rows, inp).compile()
    finally:
        for k, v in old.items():
            setattr(r, k, v)


def caller(eng, fn, pos0):
    return iteration_timer(eng, fn, pos0)


def programs(model, args, out):
    plain, adaptive = build(model, "off", args), build(model, "adaptive", args)
    progs = {"plain/draft0": (plain, plain.runner._compiled[("decode", 0)]),
             "adaptive/draft0": (adaptive, adaptive.runner._compiled[("decode", 0)])}
    for v in [x for x in args.variants.split(",") if x]:
        progs[f"adaptive/draft0/{v}"] = (adaptive, variant(adaptive, v))
    calls = {n: caller(e, fn, args.pos) for n, (e, fn) in progs.items()}
    for c in calls.values():
        c(), c()
    times = {n: [] for n in calls}
    for _ in range(args.repeats):
        for n, c in calls.items():
            times[n].append(c())
    base = min(times["plain/draft0"])
    res = {}
    for n, ts in times.items():
        size = hlo_size(progs[n][1])
        res[n] = {"ms_min": 1e3 * min(ts), "ms_median": 1e3 * statistics.median(ts), "over_plain": min(ts) / base,
                  "hlo": size}
        print(f"{n:28s} ms/iter min {1e3 * min(ts):7.3f}  median {1e3 * statistics.median(ts):7.3f}  "
              f"min / plain {min(ts) / base:.3f}x  hlo {size}", flush=True)
    out["programs"] = res


def engines(model, args, out):
    from dsflash.bench.engine import text_prompts
    from dsflash.serve.types import SamplingParams
    engs = {"plain": build(model, "off", args), "adaptive_nodraft": build(model, "adaptive", args)}
    force_plain(engs["adaptive_nodraft"].speculation)
    prompts = text_prompts(engs["plain"].tokenizer, args.batch, args.prompt_len)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    calls = {n: [] for n in engs}
    for n, e in engs.items():
        orig = e._observe_speculation

        def obs(plan, dc, n=n, orig=orig):
            calls[n].append((dc["elapsed_s"], int(dc["iters"]), int(dc["draft_len"])))
            return orig(plan, dc)
        e._observe_speculation = obs

    def one_pass(e, tag):
        for i, p in enumerate(prompts):
            e.add_request(f"{tag}{i}", p, sp)
        t, n_tok, steps = time.perf_counter(), 0, []
        while e.has_unfinished_requests():
            m0 = e.metrics_snapshot()
            ts = time.perf_counter()
            outs = e.step()
            dt = time.perf_counter() - ts
            m1 = e.metrics_snapshot()
            n_tok += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
            if m1["num_prefill_calls"] == m0["num_prefill_calls"] and m1["num_decode_iters"] > m0["num_decode_iters"]:
                steps.append((dt, m1["num_decode_iters"] - m0["num_decode_iters"], m1["host_time_s"][-1]))
        return n_tok / (time.perf_counter() - t), steps

    for n, e in engs.items():
        one_pass(e, "warm")
    per = {n: [] for n in engs}
    for i in range(args.passes):
        for n, e in engs.items():
            k0 = len(calls[n])
            tps, steps = one_pass(e, f"p{i}")
            per[n].append({"tokens_per_s": tps, "steps": steps, "calls": calls[n][k0:]})
    res = {}
    for n, ps in per.items():
        med = sorted(ps, key=lambda p: p["tokens_per_s"])[len(ps) // 2]
        st = [s for p in ps for s in p["steps"]]
        full = [c for p in ps for c in p["calls"] if c[1] == args.decode_steps]
        res[n] = {"tokens_per_s_median": med["tokens_per_s"], "tokens_per_s": [p["tokens_per_s"] for p in ps],
                  "decode_only_steps": len(st),
                  "decode_only_ms_per_step_median": 1e3 * statistics.median(s for s, _, _ in st),
                  "decode_only_ms_per_iter": 1e3 * sum(s for s, _, _ in st) / sum(i for _, i, _ in st),
                  "decode_only_host_ms_per_step_median": 1e3 * statistics.median(h for _, _, h in st),
                  "full_calls": len(full), "drafted_calls": sum(c[2] > 0 for p in ps for c in p["calls"]),
                  "call_ms_per_iter_median": 1e3 * statistics.median(c[0] / c[1] for c in full)}
        print(n, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res[n].items()
                  if k != "tokens_per_s"}, flush=True)
    a, p = res["adaptive_nodraft"], res["plain"]
    res["ratios"] = {"tokens_per_s": a["tokens_per_s_median"] / p["tokens_per_s_median"],
                     "decode_only_ms_per_step": a["decode_only_ms_per_step_median"]
                     / p["decode_only_ms_per_step_median"],
                     "call_ms_per_iter": a["call_ms_per_iter_median"] / p["call_ms_per_iter_median"],
                     "host_ms_per_step": a["decode_only_host_ms_per_step_median"]
                     / p["decode_only_host_ms_per_step_median"]}
    print("adaptive_nodraft / plain:", {k: round(v, 3) for k, v in res["ratios"].items()}, flush=True)
    out["engines"] = res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--precision", default="reference")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--parts", default="programs,engines")
    p.add_argument("--variants", default="notaps,smallbuf,both")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--pos", type=int, default=80)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from dsflash.serve.engine.backend import load_model
    from dsflash.serve.engine.config import resolve_backend
    model = load_model(args.model, precision=args.precision, backend=resolve_backend("auto"))
    out = {"args": vars(args), "platform": jax.default_backend(),
           "device": str(jax.devices()[0].device_kind)}
    parts = args.parts.split(",")
    if "programs" in parts:
        programs(model, args, out)
    if "engines" in parts:
        engines(model, args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
