"""Split the adaptive engine's measured decode-call costs into their parts, next to the other engines' in the same
process and workload (issue 23: adaptive measured drafting at 1.6-1.8x plain where always-drafting's iterations
cost 1.39x).

Engines (interleaved passes of the same prompts): ``plain`` (speculative_mode off), ``spec`` (always, batched
verify: the bench's "spec"), ``spec_seq`` (always, sequential verify: adaptive's drafting program without the lazy
context), ``adaptive`` (the default). Every decode call is recorded: draft length, wall time (the cost model's
sample), iterations, verifications, accepted drafts, and (adaptive) how many positions the draft context was behind
at the call's start (the lazy context's catch-up). Prints ms per iteration grouped by engine / draft length /
catch-up / iterations, the policy's EMAs, and writes every call as JSON (``--json``).

    PYTHONPATH=$PWD python3 scripts/adaptive_cost_split.py --model demo --batch 1 --passes 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np


def instrument(name, eng, log, old=False):
    """Record every decode call of ``eng`` into ``log`` (a list of dicts). ``old``: the policy as before the
    verify-row charge and the short-call rule (no verify rows, no planned iterations: the same arithmetic)."""
    from dsflash.serve.engine.packed import to_host
    r = eng.runner
    pending = {}

    def run_step(pf_inp, dc_inp, restores=(), saves=(), draft_len=None, on_prefill=None):
        if restores:
            r.state = r.snap.restore(r.state, list(restores))
        pf = r.prefill(pf_inp) if pf_inp is not None else None
        if saves:
            r.state = r.snap.save(r.state, list(saves))
        dc = None
        if dc_inp is not None:
            pf = to_host(pf)
            if pf is not None and on_prefill is not None:
                on_prefill(pf)
            jax.block_until_ready(r.state)
            stale = None
            if "ctx_pos" in r.rows:        # outside the timed region (a host read of two small arrays)
                rows = jax.device_get({k: r.rows[k] for k in ("ctx_pos", "pos", "active")})
                steps = dc_inp["row_steps"] > 0
                stale = int(np.max(np.where(steps, rows["pos"] - rows["ctx_pos"], 0), initial=0))
            t = time.perf_counter()
            dc = to_host(r.decode(dc_inp, draft_len))
            dc["elapsed_s"] = time.perf_counter() - t
            dc["draft_len"] = r.k if draft_len is None else draft_len
            pending.update(stale=stale, prefill=pf_inp is not None)
        return to_host(pf), dc

    r.run_step = run_step
    pol = eng.speculation
    orig = pol.observe

    def observe(draft_len, seconds, iters, per_seq=(), verify_rows=None, planned_iters=None):
        per_seq = list(per_seq)
        log.append({"engine": name, "draft_len": int(draft_len), "s": seconds, "iters": int(iters),
                    "verifies": sum(v for _, v, _ in per_seq), "accepted": sum(a for _, _, a in per_seq),
                    "stale": pending.get("stale"), "with_prefill": pending.get("prefill"),
                    "ema0": pol.costs[0].seconds if pol.costs else None,
                    "ratio": pol.costs[pol.block].ratio if pol.costs else None,
                    "verify_rows": verify_rows, "planned": planned_iters})
        if old:
            return orig(draft_len, seconds, iters, per_seq)
        return orig(draft_len, seconds, iters, per_seq, verify_rows, planned_iters)

    pol.observe = observe
    if old:
        pol.sequential_verify = False


def one_pass(eng, prompts, sp, tag):
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, sp)
    t, n = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                n += len(o.outputs[0].token_ids)
    return n / (time.perf_counter() - t)


def summary(calls, key):
    groups = {}
    for c in calls:
        groups.setdefault(key(c), []).append(c)
    for k in sorted(groups, key=str):
        g = groups[k]
        per = [1e3 * c["s"] / c["iters"] for c in g]
        acc = sum(c["accepted"] for c in g) / max(1, sum(c["verifies"] for c in g))
        print(f"  {str(k):48s} calls {len(g):3d}  ms/iter median {statistics.median(per):7.2f}  "
              f"mean {statistics.mean(per):7.2f}  min {min(per):7.2f}  acc/verify {acc:.2f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--engines", default="plain,spec,spec_seq,adaptive,adaptive_old")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("dsflash.serve.engine").setLevel(logging.INFO)
    from dsflash.bench.engine import text_prompts
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine.backend import ModelBackend, load_model
    from dsflash.serve.types import SamplingParams
    model = load_model(args.model, precision="reference")
    kinds = {"plain": dict(speculative_mode="off"), "spec": dict(speculative_mode="always"),
             "spec_seq": dict(speculative_mode="always", sequential_verify=True),
             "adaptive": dict(speculative_mode="adaptive"), "adaptive_old": dict(speculative_mode="adaptive")}
    B = args.batch
    engs, log = {}, []
    for name in args.engines.split(","):
        engs[name] = LLMEngine(ModelBackend(model, moe_weight_layout="auto"), background_compile=False, max_num_seqs=B, max_model_len=256,
                               page_size=32, max_num_batched_tokens=128, decode_steps=args.decode_steps,
                               enable_prefix_caching=False, prefill_buckets=[(4, 32)], **kinds[name])
        instrument(name, engs[name], log, old=name == "adaptive_old")
    prompts = text_prompts(next(iter(engs.values())).tokenizer, B, args.prompt_len)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    for name, eng in engs.items():
        one_pass(eng, prompts, sp, "warm")
    for c in log:
        c["pass"] = "warm"
    tps = {n: [] for n in engs}
    for i in range(args.passes):
        for name, eng in engs.items():
            n0 = len(log)
            tps[name].append(one_pass(eng, prompts, sp, f"p{i}"))
            for c in log[n0:]:
                c["pass"] = i
    timed = [c for c in log if c["pass"] != "warm"]
    print("tok/s per pass:", {n: [round(x, 1) for x in v] for n, v in tps.items()})
    print("decode calls without prefill, by engine / draft length / behind (positions) / iterations:")
    summary([c for c in timed if not c["with_prefill"]],
            lambda c: (c["engine"], c["draft_len"], None if c["stale"] is None else min(c["stale"], 99), c["iters"]))
    print("by engine / draft length:")
    summary([c for c in timed if not c["with_prefill"]], lambda c: (c["engine"], c["draft_len"]))
    plain = [c for c in timed if c["engine"] == "plain" and not c["with_prefill"] and c["iters"] == args.decode_steps]
    p_ms = statistics.median(1e3 * c["s"] / c["iters"] for c in plain) if plain else None
    for name in engs:
        full = [c for c in timed if c["engine"] == name and c["draft_len"] and not c["with_prefill"]
                and c["iters"] == args.decode_steps]
        if full and p_ms:
            acc = sum(c["accepted"] for c in full) / max(1, sum(c["verifies"] for c in full))
            print(f"{name}: full drafting calls {len(full)}, median {statistics.median(1e3 * c['s'] / c['iters'] for c in full) / p_ms:.2f}x "
                  f"the plain engine's median full call per iteration, at {acc:.2f} accepted drafts per verification")
    for name, eng in engs.items():
        pol = eng.speculation
        if pol.mode == "adaptive":
            ck = pol.costs[pol.block]
            mean = pol.engine_mean
            print(f"{name}: model ratio at no extra rows {ck.ratio:.2f}, per extra row {ck.row_ratio:.2f}, at the "
                  f"engine mean {mean:.2f} accepted: {pol.current_costs([mean] * B)[pol.block] / pol.costs[0].seconds:.2f}x")
        m = eng.metrics_snapshot()
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in m.items() if k.startswith("spec_")
                     and k not in ("spec_accepted_per_pos",)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens_per_s": tps,
                       "metrics": {n: e.metrics_snapshot() for n, e in engs.items()}, "calls": log}, f, indent=1)


if __name__ == "__main__":
    main()
