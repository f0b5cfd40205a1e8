"""Where a not-drafting step of an adaptive engine spends its time next to a plain engine's step (issue 23, session
29: on the 2-core CPU the bench had adaptive drafting in 5-11 % of its calls at batch 8 yet run 0.87-0.98x plain).

Closed batches of ``--batch`` documentation (or ``--prompts chat``) prompts through engines built as ``python3 -m
dsflash.bench engine`` builds them (max_model_len 256, page 32, budget 128, prefill bucket 4x32, 4 decode iterations
a call), their passes interleaved round by round (``--passes``; the engines' order rotates every round, so no engine
always runs right after another). Modes: ``plain`` (speculative off), ``nodraft`` (speculative_mode adaptive with
drafting forced off through the policy: every call still runs ``choose`` / ``observe``), ``adaptive_mixed`` (the
default), ``adaptive`` (prefill first), ``plain2`` (a second plain engine: the instrument's own spread) and
``nodraft_rec`` (``nodraft`` with ``tap_free_plain=False``: every plain call records the lazy context's taps, as
before session 29's tap-free program; ``nodraft`` runs the tap-free program once it has been plain a while);
``nodraft/notaps``, ``nodraft/smallbuf``, ``nodraft/both``: ``nodraft`` with its draft-length-0 program replaced by
``scripts/adaptive_nodraft_cost.py``'s variants (no taps recorded / one-row output buffers / neither; only for
timing: such an engine must not draft). Also per step: each decode call's wall time over the plain engine's call of
the same step (the engines run the same schedule), median and quartiles over every step of every pass. Per engine and pass, split by step kind (mixed: a prefill call in it;
decode-only): the drafting calls, the step's wall time, the prefill call (``run_step`` less the decode call), the decode call (its
``elapsed_s``), the host time (the step outside ``handle.result()``), and counts: device calls (prefill / decode
programs, snapshot copies), drafting calls, compiles inside steps. Prints per engine the medians over passes and each
mode's tokens/s over plain's *paired by round* (median and range of the per-round ratios), also in process CPU time.

    PYTHONPATH=$PWD:$PWD/scripts python3 scripts/adaptive_plain_step_cost.py --batch 8 --passes 9 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from adaptive_common import force_plain


def build(model, mode, args):
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine.backend import ModelBackend
    variant, mode = "/" in mode, mode.split("/")[0]
    spec = {"plain": "off", "plain2": "off", "nodraft": "adaptive", "nodraft_rec": "adaptive", "adaptive": "adaptive",
            "adaptive_mixed": "adaptive"}[mode]
    return LLMEngine(ModelBackend(model, moe_weight_layout="auto"), background_compile=False, speculative_mode=spec,
                     tap_free_plain=mode != "nodraft_rec" and not variant,    # a variant replaces the draft-0 program
                     speculative_in_mixed_steps=mode != "adaptive", max_num_seqs=args.batch,
                     max_model_len=args.max_model_len, page_size=32, max_num_batched_tokens=128,
                     decode_steps=args.decode_steps, enable_prefix_caching=False, prefill_buckets=[(4, 32)], seed=0)


class Probe:
    """Wraps an engine's runner: per step, the run_step wall time, the decode call's, and the device calls made."""

    def __init__(self, eng):
        self.eng, r = eng, eng.runner
        self.step = {}
        self.counts = {"prefill": 0, "decode": 0, "decode_drafting": 0, "decode_tap_free": 0, "snapshot": 0}
        run_step, prefill, decode = r.run_step, r.prefill, r.decode

        def w_run_step(*a, **kw):
            t = time.perf_counter()
            pf, dc = run_step(*a, **kw)
            self.step["run_step"] = time.perf_counter() - t
            self.step["decode"] = dc["elapsed_s"] if dc is not None else 0.0
            return pf, dc

        def w_prefill(inp):
            self.counts["prefill"] += 1
            return prefill(inp)

        def w_decode(inp, draft_len=None):
            self.counts["decode"] += 1
            d = r.k if draft_len is None else draft_len
            self.counts["decode_drafting"] += d > 0
            self.counts["decode_tap_free"] += d < 0          # runner.TAP_FREE
            return decode(inp, draft_len)
        r.run_step, r.prefill, r.decode = w_run_step, w_prefill, w_decode
        if r.snap is not None:
            for name in ("save", "restore"):
                f = getattr(r.snap, name)

                def w(*a, f=f, **kw):
                    self.counts["snapshot"] += 1
                    return f(*a, **kw)
                setattr(r.snap, name, w)


def one_pass(eng, probe, prompts, sp, tag):
    """A generator: one closed-batch pass of ``eng``, yielding after every step (``--lockstep`` steps the engines in
    turn); returns the pass's numbers (``StopIteration.value``). Times are sums over the engine's own steps."""
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, sp)
    kinds = {k: {"steps": 0, "ms": 0.0, "cpu_ms": 0.0, "prefill_ms": 0.0, "decode_ms": 0.0, "host_ms": 0.0,
                 "iters": 0, "drafting": 0} for k in ("mixed", "decode")}
    c0 = dict(probe.counts)
    m = eng.metrics
    wall = cpu = 0.0
    dcalls = []         # (step index, decode call seconds, iterations) of every step with a decode call
    n_tok, compiles0 = 0, eng.compiles_after_warmup
    while eng.has_unfinished_requests():
        n_pf, n_it = m.num_prefill_calls, m.num_decode_iters
        probe.step = {}
        n_dr = probe.counts["decode_drafting"]
        ts, cs = time.perf_counter(), time.process_time()
        outs = eng.step()
        dt, dc = time.perf_counter() - ts, time.process_time() - cs
        wall, cpu = wall + dt, cpu + dc
        n_tok += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        mixed = m.num_prefill_calls > n_pf
        if mixed or m.num_decode_iters > n_it:
            k = kinds["mixed" if mixed else "decode"]
            k["steps"] += 1
            k["ms"] += 1e3 * dt
            k["cpu_ms"] += 1e3 * dc
            k["decode_ms"] += 1e3 * probe.step.get("decode", 0.0)
            k["prefill_ms"] += 1e3 * (probe.step.get("run_step", 0.0) - probe.step.get("decode", 0.0))
            k["host_ms"] += 1e3 * m.host_time[-1]
            k["iters"] += m.num_decode_iters - n_it
            k["drafting"] += probe.counts["decode_drafting"] - n_dr
            if probe.step.get("decode"):
                dcalls.append((m.num_steps, probe.step["decode"], m.num_decode_iters - n_it))
        yield
    return {"s": wall, "cpu_s": cpu, "tokens": n_tok, "tokens_per_s": n_tok / wall, "cpu_ms_per_token": 1e3 * cpu / n_tok,
            "kinds": kinds, "decode_calls": dcalls, "calls": {k: probe.counts[k] - c0[k] for k in c0},
            "compiles_in_steps": eng.compiles_after_warmup - compiles0}


def run_passes(gens: dict, lockstep: bool) -> dict:
    """Run the generators (mode -> one_pass) one after another, or step by step in turn (``lockstep``)."""
    out = {}
    live = dict(gens)
    while live:
        for n in list(live):
            try:
                while True:
                    next(live[n])
                    if lockstep:
                        break
            except StopIteration as e:
                out[n] = e.value
                del live[n]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--precision", default="reference")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--modes", default="plain,nodraft,adaptive_mixed,adaptive")
    p.add_argument("--passes", type=int, default=9)
    p.add_argument("--prompts", default="text", choices=["text", "chat"])
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                   help="step the engines' passes in turn, one step each (default), so load changes hit every engine's "
                        "steps alike; --no-lockstep runs whole passes in turn (as the bench)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import jax

    from dsflash.bench.engine import chat_prompts, text_prompts
    from dsflash.serve.engine.backend import load_model
    from dsflash.serve.engine.config import resolve_backend
    from dsflash.serve.types import SamplingParams
    model = load_model(args.model, precision=args.precision, backend=resolve_backend("auto"))
    modes = args.modes.split(",")
    engs = {}
    for mode in modes:
        engs[mode] = build(model, mode, args)
        if mode.startswith("nodraft"):
            force_plain(engs[mode].speculation)
        if "/" in mode:
            from adaptive_nodraft_cost import variant
            engs[mode].runner._compiled[("decode", 0)] = variant(engs[mode], mode.split("/")[1])
    tok = next(iter(engs.values())).tokenizer
    prompts = (chat_prompts(tok, args.batch, args.max_model_len - args.max_tokens) if args.prompts == "chat"
               else text_prompts(tok, args.batch, args.prompt_len))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.prompts != "chat", seed=0)
    probes = {n: Probe(e) for n, e in engs.items()}
    run_passes({n: one_pass(e, probes[n], prompts, sp, "warm") for n, e in engs.items()}, False)
    per = {n: [] for n in engs}
    for i in range(args.passes):
        order = modes[i % len(modes):] + modes[:i % len(modes)]      # rotate: no fixed neighbour
        got = run_passes({n: one_pass(engs[n], probes[n], prompts, sp, f"p{i}") for n in order}, args.lockstep)
        for n in modes:
            per[n].append(got[n])
    res = {"args": vars(args), "platform": jax.default_backend(), "modes": {}}
    for n, ps in per.items():
        med = lambda f: statistics.median(f(q) for q in ps)          # noqa: E731
        r = {"tokens_per_s": [q["tokens_per_s"] for q in ps], "tokens_per_s_median": med(lambda q: q["tokens_per_s"]),
             "cpu_ms_per_token_median": med(lambda q: q["cpu_ms_per_token"])}
        for kind in ("mixed", "decode"):
            r[kind] = {f: med(lambda q: q["kinds"][kind][f]) for f in ps[0]["kinds"][kind]}
            r[kind]["ms_per_step"] = med(lambda q: q["kinds"][kind]["ms"] / max(1, q["kinds"][kind]["steps"]))
            r[kind]["host_ms_per_step"] = med(lambda q: q["kinds"][kind]["host_ms"] / max(1, q["kinds"][kind]["steps"]))
        r["calls_per_pass"] = {f: med(lambda q: q["calls"][f]) for f in ps[0]["calls"]}
        r["drafting_calls_by_pass"] = [q["calls"]["decode_drafting"] for q in ps]
        r["compiles_in_steps"] = sum(q["compiles_in_steps"] for q in ps)
        if n != "plain" and "plain" in per:
            rat = [q["tokens_per_s"] / b["tokens_per_s"] for q, b in zip(ps, per["plain"])]
            r["over_plain_paired"] = {"median": statistics.median(rat), "min": min(rat), "max": max(rat), "all": rat}
            cr = [b["cpu_ms_per_token"] / q["cpu_ms_per_token"] for q, b in zip(ps, per["plain"])]
            r["over_plain_cpu_time_paired"] = {"median": statistics.median(cr), "min": min(cr), "max": max(cr),
                                               "all": cr}
        if n != "plain" and "plain" in per:       # the same step of the same round, call against call
            cr = []
            for q, b in zip(ps, per["plain"]):
                s0, s1 = q["decode_calls"][0][0] if q["decode_calls"] else 0, b["decode_calls"][0][0] if b["decode_calls"] else 0
                bq = {i - s1: (t, it) for i, t, it in b["decode_calls"]}
                cr += [t / bq[i - s0][0] for i, t, it in q["decode_calls"] if i - s0 in bq and bq[i - s0][1] == it]
            if cr:
                qs = statistics.quantiles(cr, n=4)
                r["decode_call_over_plain_per_step"] = {"median": statistics.median(cr), "q1": qs[0], "q3": qs[2],
                                                       "n": len(cr)}
        res["modes"][n] = r
        print(f"[{n:14s}] tok/s median {r['tokens_per_s_median']:7.1f} (passes {min(r['tokens_per_s']):.0f}-"
              f"{max(r['tokens_per_s']):.0f})" + (f"  over plain paired: median {r['over_plain_paired']['median']:.3f} "
                                                  f"[{r['over_plain_paired']['min']:.3f}, "
                                                  f"{r['over_plain_paired']['max']:.3f}]" if "over_plain_paired" in r
                                                  else "")
              + (f"; CPU time plain / this paired: median {r['over_plain_cpu_time_paired']['median']:.3f} "
                 f"[{r['over_plain_cpu_time_paired']['min']:.3f}, {r['over_plain_cpu_time_paired']['max']:.3f}]"
                 if "over_plain_cpu_time_paired" in r else ""))
        for kind in ("mixed", "decode"):
            k = r[kind]
            print(f"    {kind:6s}: {k['steps']:.0f} steps {k['ms']:7.1f} ms (prefill {k['prefill_ms']:6.1f}, decode "
                  f"{k['decode_ms']:6.1f}, host {k['host_ms']:5.1f}; {k['ms_per_step']:.2f} ms/step, host "
                  f"{k['host_ms_per_step']:.3f}), {k['iters']:.0f} iterations, {k['drafting']:.0f} drafting calls")
        if "decode_call_over_plain_per_step" in r:
            c = r["decode_call_over_plain_per_step"]
            print(f"    decode call / plain's, same step: median {c['median']:.3f} (quartiles {c['q1']:.3f}-{c['q3']:.3f}, "
                  f"{c['n']} calls)")
        print(f"    device calls per pass (median) {r['calls_per_pass']}, drafting calls by pass "
              f"{r['drafting_calls_by_pass']}, compiles in steps {r['compiles_in_steps']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
