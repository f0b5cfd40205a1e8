"""What switching between the adaptive engine's two decode programs costs, and how often the policy switches (H100,
demo, chat prompts, batch 32: adaptive 0.89x plain where always-drafting ran 0.96x; its decode-only steps 3.31 ms an
iteration against always-drafting's 2.95, although they mix plain and drafting calls).

Parts (same model and engine geometry as ``python3 -m dsflash.bench engine``; ``sequential_verify`` off, as on a GPU):

1. ``catchup``: the lazy draft context's catch-up (``Runner._catch_up_context``, what the first drafting call after
   plain calls runs before its loop) compiled alone and timed, the context current (the ``lax.cond`` skips it) and
   behind by 4 / ``W`` positions, next to one plain decode call's iterations on the same engine.
2. ``programs``: the compiled drafting program on identical inputs with the draft context current vs behind, and the
   plain program, interleaved (the catch-up inside the call).
3. ``switch``: a drafting (plain) call timed right after a call of either program, its rows those that call returned
   (donated, as in the engine): ``D_after_p`` - ``D_after_D`` is what resuming drafting costs (catch-up and program
   switch); ``D_after_p_ctx_current`` (the context set current by hand: the switch alone) and
   ``D_after_D_ctx_behind`` (the catch-up alone) separate the two.
4. ``replay``: a closed batch (``--prompts chat|text``) through the adaptive engine with the policy fed *given*
   per-iteration costs (``--costs 2.468,2.967``: the H100 run's EMAs, ms for draft length 0 / ``block``) in place of
   this machine's wall times: the decisions a GPU would take on this workload (the acceptance is this model's, the
   schedule is the scheduler's). Per pass: every decode call's step kind (mixed / decode-only), draft length, why
   (prefill rule, exploration, re-measure, cost decision), iterations; the switches between programs; drafting calls
   after a plain call (each pays a catch-up).

    PYTHONPATH=$PWD python3 scripts/adaptive_switch_cost.py --batch 32 --parts catchup,switch,replay --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from adaptive_common import endless_decode_inputs


def build(model, mode, args, **kw):
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine.backend import ModelBackend
    return LLMEngine(ModelBackend(model, moe_weight_layout="auto"), background_compile=False, speculative_mode=mode, max_num_seqs=args.batch,
                     max_model_len=256, page_size=32, max_num_batched_tokens=128, decode_steps=4,
                     enable_prefix_caching=False, prefill_buckets=[(4, 32)], sequential_verify=False, **kw)


def _rows(r, pos0, stale):
    S_ = r.S
    rows = {k: jnp.array(v) for k, v in jax.device_get(r.rows).items()}
    rows.update(active=jnp.ones((S_,), bool), pos=jnp.full((S_,), pos0, jnp.int32),
                y=jnp.full((S_,), 7, jnp.int32), n_gen=jnp.zeros((S_,), jnp.int32))
    rows["ctx_pos"] = jnp.full((S_,), pos0 - stale, jnp.int32)
    return rows


def _interleaved(calls, repeats):
    for c in calls.values():
        c(), c()
    times = {n: [] for n in calls}
    for _ in range(repeats):
        for n, c in calls.items():
            times[n].append(c())
    return {n: {"ms_min": 1e3 * min(v), "ms_median": 1e3 * statistics.median(v)} for n, v in times.items()}


def catchup(eng, args, out):
    r = eng.runner
    inp = endless_decode_inputs(eng)
    pt = jnp.asarray(inp["page_table"])
    f = jax.jit(lambda p, st, rows: r._catch_up_context(p, st, rows, pt))

    def cu(stale):
        def call():
            rows = _rows(r, args.pos, stale)
            jax.block_until_ready(rows)
            t = time.perf_counter()
            jax.block_until_ready(f(r.params, r.state, rows))
            return time.perf_counter() - t
        return call

    def plain():
        rows = _rows(r, args.pos, 0)
        jax.block_until_ready((rows, r.state))
        t = time.perf_counter()
        r.state, r.rows, res = r._compiled[("decode", 0)](r.params, r.state, rows, r.place(inp))
        jax.block_until_ready(res)
        return (time.perf_counter() - t) / r.max_iters

    res = _interleaved({"catchup_current": cu(0), "catchup_behind4": cu(4), f"catchup_behind{r.tap_window}":
                        cu(r.tap_window), "plain_iteration": plain}, args.repeats)
    p = res["plain_iteration"]["ms_min"]
    for n, v in res.items():
        v["over_plain_iteration"] = v["ms_min"] / p
        print(f"catchup {n:22s} ms min {v['ms_min']:8.2f} median {v['ms_median']:8.2f}  / plain iteration "
              f"{v['over_plain_iteration']:.2f}", flush=True)
    out["catchup"] = {"window": r.tap_window, "slots": r.S, "taps_shape": list(r.rows["taps"].shape), **res}


def programs(eng, args, out):
    from dsflash.serve.engine.packed import to_host
    r = eng.runner
    inp = endless_decode_inputs(eng)

    def caller(d, stale):
        def call():
            rows = _rows(r, args.pos, stale)
            jax.block_until_ready((rows, r.state))
            t = time.perf_counter()
            r.state, r.rows, res = r._compiled[("decode", d)](r.params, r.state, rows, r.place(inp))
            res = to_host(res)
            return time.perf_counter() - t
        return call

    res = _interleaved({"plain": caller(0, 0), "draft_current": caller(r.k, 0), "draft_behind4": caller(r.k, 4),
                        f"draft_behind{r.tap_window}": caller(r.k, r.tap_window)}, args.repeats)
    for n, v in res.items():
        print(f"program {n:20s} call ms min {v['ms_min']:8.2f} median {v['ms_median']:8.2f}", flush=True)
    out["programs"] = {"iterations_per_call": r.max_iters, **res}


def switch(eng, args, out):
    """A drafting (plain) call timed right after a call of either program, the draft context behind as that call
    leaves it or set current / behind by hand: separates the program switch from the catch-up."""
    from dsflash.serve.engine.packed import to_host
    r = eng.runner
    inp = endless_decode_inputs(eng)

    def run(d, rows):
        r.state, r.rows, res = r._compiled[("decode", d)](r.params, r.state, rows, r.place(inp))
        return to_host(res)

    def caller(before, d, ctx):
        """``ctx``: None (as the call before left it), "current" or "behind" (ctx_pos = pos - 4)."""
        def call():
            run(before, _rows(r, args.pos, 0))
            rows = dict(r.rows)        # the call before's (donated) rows, as the engine passes them on
            if ctx is not None:
                rows["ctx_pos"] = rows["pos"] - (4 if ctx == "behind" else 0)
            jax.block_until_ready((rows, r.state))
            t = time.perf_counter()
            run(d, rows)
            return time.perf_counter() - t
        return call

    k = r.k
    res = _interleaved({"D_after_D": caller(k, k, None), "D_after_p": caller(0, k, None),
                        "D_after_p_ctx_current": caller(0, k, "current"),
                        "D_after_D_ctx_behind": caller(k, k, "behind"),
                        "p_after_p": caller(0, 0, None), "p_after_D": caller(k, 0, None)}, args.repeats)
    for n, v in res.items():
        print(f"switch {n:24s} call ms min {v['ms_min']:8.2f} median {v['ms_median']:8.2f}", flush=True)
    dd, dp_ = res["D_after_D"], res["D_after_p"]
    res["resume_extra_ms_min"] = dp_["ms_min"] - dd["ms_min"]
    res["resume_extra_ms_median"] = dp_["ms_median"] - dd["ms_median"]
    out["switch"] = {"iterations_per_call": r.max_iters, **res}


def replay(eng, args, out):
    """The policy fed the given costs; every decode call recorded with why it ran its draft length."""
    from dsflash.bench.engine import chat_prompts, text_prompts
    from dsflash.serve.types import SamplingParams
    pol = eng.speculation
    c0, ck = (float(x) * 1e-3 for x in args.costs.split(","))
    why = {}
    orig_pfp, orig_decide, orig_obs = pol._plain_for_prefill, pol._decide, pol.observe

    def pfp(displaced):
        why.update(reason="prefill", displaced=displaced)
        return orig_pfp(displaced)

    def decide(accepted):
        d = orig_decide(accepted)
        best = None
        if all(c.seconds is not None and c.samples >= pol.probe_calls for c in pol.costs.values()):
            from dsflash.serve.engine.adaptive import choose_draft_length
            best = choose_draft_length(pol.current_costs(accepted), accepted, pol.margin)
        reason = "startup" if best is None else "cost" if d == best else "explore_draft" if d else "remeasure_plain"
        why.update(reason=reason, mean_acc=sum(accepted) / max(1, len(accepted)), best=best)
        return d

    calls = []

    def observe(draft_len, seconds, iters, per_seq=(), verify_rows=None, planned_iters=None):
        per_seq = list(per_seq)
        fake = iters * (ck if draft_len else c0) if seconds is not None else None
        calls.append({"draft_len": int(draft_len), "iters": int(iters), "planned": planned_iters,
                      "wall_s": seconds, "verifies": sum(v for _, v, _ in per_seq),
                      "accepted": sum(a for _, _, a in per_seq), **why})
        why.clear()
        return orig_obs(draft_len, fake, iters, per_seq, verify_rows, planned_iters)

    pol._plain_for_prefill, pol._decide, pol.observe = pfp, decide, observe
    if args.prompts == "chat":
        prompts = chat_prompts(eng.tokenizer, args.batch, 256 - args.max_tokens)
    else:
        prompts = text_prompts(eng.tokenizer, args.batch, args.prompt_len)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.prompts != "chat", seed=0)
    passes = []
    for i in range(args.replay_passes):
        for j, p in enumerate(prompts):
            eng.add_request(f"p{i}_{j}", p, sp)
        k0, steps = len(calls), []
        while eng.has_unfinished_requests():
            m0 = eng.metrics_snapshot()
            n0 = len(calls)
            eng.step()
            m1 = eng.metrics_snapshot()
            if len(calls) > n0:
                calls[-1]["mixed"] = m1["num_prefill_calls"] > m0["num_prefill_calls"]
            steps.append(m1["num_prefill_calls"] > m0["num_prefill_calls"])
        pc = calls[k0:]
        seq = "".join(("D" if c["draft_len"] else "p") if not c["mixed"] else ("M" if c["draft_len"] else "m")
                      for c in pc)
        switches = sum(a["draft_len"] != b["draft_len"] for a, b in zip(pc, pc[1:]))
        resumes = sum(bool(b["draft_len"]) and not a["draft_len"] for a, b in zip(pc, pc[1:]))
        reasons = {}
        for c in pc:
            reasons[f"{c['draft_len']}:{c.get('reason')}"] = reasons.get(f"{c['draft_len']}:{c.get('reason')}", 0) + 1
        dec = [c for c in pc if not c["mixed"]]
        rec = {"pass": i, "steps": len(steps), "calls": len(pc), "sequence": seq, "switches": switches,
               "drafting_after_plain": resumes, "reasons": reasons,
               "decode_only_calls": len(dec), "decode_only_drafting": sum(bool(c["draft_len"]) for c in dec),
               "decode_only_iters_plain": sum(c["iters"] for c in dec if not c["draft_len"]),
               "decode_only_iters_drafting": sum(c["iters"] for c in dec if c["draft_len"]),
               "calls_detail": pc}
        passes.append(rec)
        print(f"replay pass {i}: {len(steps)} steps, decode calls {seq} (m/M: mixed plain/drafting, p/D: "
              f"decode-only plain/drafting), switches {switches}, drafting after plain {resumes}, {reasons}",
              flush=True)
    out["replay"] = {"costs_ms": [1e3 * c0, 1e3 * ck], "prompts": args.prompts, "passes": passes,
                     "metrics": {k: v for k, v in eng.metrics_snapshot().items() if k.startswith("spec_")
                                 and k != "spec_accepted_per_pos"}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--parts", default="catchup,programs,switch,replay")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--pos", type=int, default=80)
    p.add_argument("--prompts", default="chat")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--costs", default="2.468,2.967", help="ms per iteration, draft length 0 and block (replay)")
    p.add_argument("--replay-passes", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from dsflash.serve.engine.backend import load_model
    model = load_model(args.model, precision="reference")
    out = {"args": vars(args), "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}
    eng = build(model, "adaptive", args)
    parts = args.parts.split(",")
    for name, fn in (("catchup", catchup), ("programs", programs), ("switch", switch), ("replay", replay)):
        if name in parts:
            fn(eng, args, out)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
