"""``python -m dsflash.bench engine``: end-to-end engine throughput with and without DSpark drafts.

Runs the same closed batch of synthetic prompts through the engine once per mode (``spec``: drafts every
decode call, ``adaptive_mixed``: the engine's default cost-model choice, ``adaptive``: the same with every call of
a step that prefills plain, ``plain``: no drafts; default modes spec, adaptive_mixed, plain), after a warm-up pass
(compilation excluded; the adaptive engine keeps what it measured there, as a serving engine would), then
``--passes`` timed passes per mode, interleaved across the modes (the median is reported), and prints generated tokens/s, steps, host overhead per step and
the acceptance numbers (drafts, acceptance rate, mean acceptance length = 1 + accepted/drafts, per
position) and each mode's tokens/s over plain's (the median passes'; with several passes also pass by pass, each round's
passes having run side by side: median and range over the rounds, ``ratios_by_round``). ``--batches 1,8,32`` repeats it per batch size (prompts =
``max_num_seqs`` = the batch). ``--json PATH`` writes the numbers. Random-weight presets accept few drafts: the point on
CPU is the mechanism and the host overhead, not the speed-up.

``--breakdown`` also times, at the engine's shapes and on its live state, the model work of one decode iteration
in isolation: the target forward over 1 row per sequence (a plain iteration), over ``block + 1`` rows with the
draft-context update (a speculative verification), and the draft's proposal. A speculative iteration pays off
when the mean acceptance length exceeds its cost in plain iterations.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m dsflash.bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", "--model", dest="model", default="tiny",
                   help="preset name, checkpoint folder, or 'toy' (the engine's cheap test model)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--text-prompts", action="store_true",
                   help="prompts = the first --prompt-len tokens of held-out CPython documents (dsflash.train.data; "
                        "real text for a trained model such as 'demo') instead of random token ids")
    p.add_argument("--chat-prompts", action="store_true",
                   help="prompts = the first assistant turn of held-out chat conversations (dsflash.train.chat_data, "
                        "rendered and tokenised as the server does; those that fit --max-model-len with --max-tokens), "
                        "each generating until it ends its turn or reaches --max-tokens, as served")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--prefill-buckets", default="4x32", help="comma list of ROWSxTOKENS prefill buckets")
    p.add_argument("--decode-steps", type=int, default=4, help="decode iterations per device call")
    p.add_argument("--precision", default="reference", choices=["reference", "bf16", "fp32"])
    p.add_argument("--backend", default="auto", choices=["auto", "xla", "triton"],
                   help="kernels: 'auto' = Triton on a CUDA GPU when jax-triton imports, else XLA")
    p.add_argument("--modes", default="spec,adaptive_mixed,plain",
                   help="comma list of spec (drafts every call), adaptive (drafts when its cost model says they "
                        "pay, every call of a step that prefills plain: the server's --no-speculative-in-mixed-steps), "
                        "adaptive_mixed (the engine's default: adaptive, its cost model deciding those calls too) "
                        "and plain (no drafts)")
    p.add_argument("--passes", type=int, default=1,
                   help="timed passes per mode, the modes' passes interleaved; the median pass is reported")
    p.add_argument("--batches", default=None,
                   help="comma list of batch sizes: each runs that many prompts with max_num_seqs = the batch "
                        "(overrides --num-prompts / --max-num-seqs) and reports every mode / plain")
    p.add_argument("--async-scheduling", action="store_true",
                   help="dispatch step N+1 before processing step N (on a dispatch thread)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run (GIL hand-off latency of the dispatch thread)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the forward at 1 and block+1 rows per sequence and the draft proposal in isolation")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per --breakdown part (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA compilation cache folder (default: $DSFLASH_CACHE_DIR, else ~/.cache/dsflash/jax)")
    p.add_argument("--compile-threads", type=int, default=None,
                   help="start-up compile threads (default: $DSFLASH_COMPILE_THREADS, else 1)")
    p.add_argument("--json", default=None, help="write results here")
    return p.parse_args(argv)


def text_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens (BOS first, as a served text prompt) of the first ``n`` held-out documents
    that are long enough."""
    from dsflash.train import data
    if tokenizer is None:
        raise SystemExit("--text-prompts needs a model with a tokenizer")
    _, held = data.split_documents(data.corpus_documents())
    out = []
    for d in held:
        ids = tokenizer.encode_prompt(d)
        if len(ids) >= length:
            out.append([int(t) for t in ids[:length]])
        if len(out) == n:
            return out
    raise SystemExit(f"--text-prompts: only {len(out)} held-out documents have {length} tokens")


def chat_prompts(tokenizer, n: int, max_len: int) -> list[list[int]]:
    """The first-turn prompts of the first ``n`` held-out chat conversations of at most ``max_len`` tokens."""
    from dsflash.train import chat_data
    if tokenizer is None:
        raise SystemExit("--chat-prompts needs a model with a tokenizer")
    _, held = chat_data.split(chat_data.conversations())
    out = [p for p in chat_data.first_turn_prompts(tokenizer, held) if len(p) <= max_len][:n]
    if len(out) < n:
        raise SystemExit(f"--chat-prompts: only {len(out)} held-out conversations have a first-turn prompt of <= "
                         f"{max_len} tokens")
    return out


def _median_ms(fn, args, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn(*args))                     # compile + first touch
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def iteration_breakdown(eng, repeats: int) -> dict:
    """Median ms of the parts of one decode iteration, each its own jitted program over the engine's params and
    state (not donated, so the engine's state is untouched): every sequence slot active at one position, page
    table = the slot's first pages."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsflash.model.state import Batch
    r, be = eng.runner, eng.backend
    if not r.spec:
        raise ValueError("iteration_breakdown needs a speculative engine")
    S_, K1 = r.S, r.K1
    pos = jnp.full((S_,), min(eng.max_model_len // 2, eng.max_model_len - K1 - 1), jnp.int32)
    slots = jnp.arange(S_, dtype=jnp.int32)
    zero = jnp.zeros((S_,), jnp.int32)
    pages = jnp.asarray(np.arange(S_ * r.P, dtype=np.int32).reshape(S_, r.P) % max(1, eng.geo.num_pages))

    def forward(params, state, tokens, taps):
        b = Batch(tokens, pos + 1, jnp.full((S_,), tokens.shape[1], jnp.int32), slots, pages, zero, zero, zero)
        out, state = be.forward(params, b, state, logits="all", taps=taps)
        if taps:
            state = be.update_context(params, out, b, state)
        return out["logits"], state

    plain = jax.jit(lambda p, s, t: forward(p, s, t, False))
    verify = jax.jit(lambda p, s, t: forward(p, s, t, True))
    propose = jax.jit(lambda p, s, y: be.propose(p, s, y, pos, slots, zero, jnp.zeros((S_,), jnp.float32),
                                                 jnp.zeros((S_, 2), jnp.uint32))[0])
    y = jnp.full((S_,), 5, jnp.int32)
    out = {"rows": S_, "block": r.k,
           "forward_1_ms": _median_ms(plain, (r.params, r.state, y[:, None]), repeats),
           "forward_block1_with_context_ms": _median_ms(verify, (r.params, r.state, jnp.tile(y[:, None], (1, K1))),
                                                        repeats),
           "propose_ms": _median_ms(propose, (r.params, r.state, y), repeats)}
    out["spec_model_work_in_plain_iterations"] = (
        (out["forward_block1_with_context_ms"] + out["propose_ms"]) / out["forward_1_ms"])
    return out


# bench mode -> speculative_mode; "adaptive": adaptive with the prefill-first rule (every call of a step that
# prefills runs plain); "adaptive_mixed": adaptive, its cost model also deciding those calls
# (EngineConfig.speculative_in_mixed_steps, the engine's default since session 28)
MODES = {"spec": "always", "adaptive": "adaptive", "adaptive_mixed": "adaptive", "plain": "off"}


def run_mode(model, args, mode: str) -> dict:
    import numpy as np

    from dsflash.bench import step_floor
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.types import SamplingParams
    t0 = time.perf_counter()
    speculative = mode != "plain"
    eng = LLMEngine(model, speculative_mode=MODES[mode], speculative_in_mixed_steps=mode == "adaptive_mixed",
                    max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                    page_size=args.page_size, max_num_batched_tokens=args.max_num_batched_tokens,
                    precision=args.precision, backend=args.backend, decode_steps=args.decode_steps, async_scheduling=args.async_scheduling,
                    seed=args.seed, enable_prefix_caching=False, compilation_cache_dir=args.compilation_cache_dir,
                    compile_threads=args.compile_threads,
                    prefill_buckets=[tuple(int(v) for v in b.split("x")) for b in args.prefill_buckets.split(",")])
    startup = time.perf_counter() - t0
    # the timed passes compare programs, not compile threads: wait for the background compiles (drafting, tap-free)
    eng.wait_for_programs()
    programs_s = time.perf_counter() - t0
    V = eng.backend.vocab_size
    rng = np.random.default_rng(args.seed)
    if args.chat_prompts:
        prompts = chat_prompts(eng.tokenizer, args.num_prompts, args.max_model_len - args.max_tokens)
    elif args.text_prompts:
        prompts = text_prompts(eng.tokenizer, args.num_prompts, args.prompt_len)
    else:
        prompts = [[int(t) for t in rng.integers(4, V, size=args.prompt_len)] for _ in range(args.num_prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=not args.chat_prompts,
                        seed=args.seed)

    # every step by kind: "mixed" (a prefill call in it) or "decode" (decode-only); what each kind costs and emits
    phase_keys = ("steps", "s", "generated", "prompt_tokens", "iters")
    phases = {k: dict.fromkeys(phase_keys, 0) for k in ("mixed", "decode")}

    def one_pass(tag):
        for i, p in enumerate(prompts):
            eng.add_request(f"{tag}{i}", p, sp)
        t = time.perf_counter()
        n_tok = 0
        before = eng.metrics_snapshot()
        while eng.has_unfinished_requests():
            ts = time.perf_counter()
            outs = eng.step()
            te = time.perf_counter()
            for o in outs:
                if o.finished:
                    n_tok += len(o.outputs[0].token_ids)
            after = eng.metrics_snapshot()
            mixed = after["num_prefill_calls"] > before["num_prefill_calls"]
            d_iters = after["num_decode_iters"] - before["num_decode_iters"]
            # by kind: "mixed" has a prefill call in it; a decode-only step's wall time is the decode iterations' cost
            if mixed or d_iters > 0:
                ph = phases["mixed" if mixed else "decode"]
                ph["steps"] += 1
                ph["s"] += te - ts
                ph["iters"] += d_iters
                ph["generated"] += after["generation_tokens"] - before["generation_tokens"]
                ph["prompt_tokens"] += after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
            before = after
        return n_tok, time.perf_counter() - t

    one_pass("warm")                           # first-touch effects outside the timed passes
    cmd = yield                                # built and warm: the caller interleaves the modes' passes
    passes = []
    while cmd == "pass":
        for ph in phases.values():
            ph.update(dict.fromkeys(phase_keys, 0))
        m0 = eng.metrics_snapshot()
        n_tok, dt = one_pass(f"run{len(passes)}")
        passes.append((dt, n_tok, m0, eng.metrics_snapshot(), {k: dict(v) for k, v in phases.items()}))
        cmd = yield
    dt, n_tok, m0, m, phs = sorted(passes, key=lambda r: r[0])[len(passes) // 2]     # the median pass
    decode_phase = phs["decode"]
    steps = m["num_steps"] - m0["num_steps"]
    host = m["host_time_s"][-steps:] if steps else []
    drafts = m["spec_num_drafts"] - m0["spec_num_drafts"]
    acc = m["spec_num_accepted_tokens"] - m0["spec_num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(m["spec_accepted_per_pos"], m0["spec_accepted_per_pos"])]
    iters = m["num_decode_iters"] - m0["num_decode_iters"]
    breakdown = iteration_breakdown(eng, args.repeats) if mode == "spec" and args.breakdown else None
    spec_m = {k: m[k] for k in ("spec_mode", "spec_drafted_call_fraction", "spec_requests_stopped_drafting",
                                "spec_iteration_ms_draft0", f"spec_iteration_ms_draft{eng.k}",
                                "spec_calls_before_drafting_compiled") if k in m}
    if "spec_calls_plain_for_prefill" in m:      # this pass's, not the warm-up's too
        spec_m["spec_calls_plain_for_prefill"] = m["spec_calls_plain_for_prefill"] - m0["spec_calls_plain_for_prefill"]
    yield {
        "mode": mode, "speculative": speculative, "batch": args.num_prompts, "max_num_seqs": args.max_num_seqs,
        **spec_m, "startup_s": startup, "programs_ready_s": programs_s, "warmup_s": eng.warmup_time,
        "generated_tokens": n_tok, "elapsed_s": dt, "tokens_per_s": n_tok / dt if dt else 0.0,
        "passes_tokens_per_s": [r[1] / r[0] for r in passes],
        "steps": steps, "host_overhead_per_step_ms": 1e3 * statistics.mean(host) if host else 0.0,
        "step_time_ms": 1e3 * dt / steps if steps else 0.0,
        "decode_iters": iters, "ms_per_decode_iter": 1e3 * dt / iters if iters else 0.0,
        # the same over decode-only steps (no prefill in the step): what one decode iteration costs the engine
        "decode_phase": {"steps": decode_phase["steps"], "iters": decode_phase["iters"],
                         "ms_per_iter": 1e3 * decode_phase["s"] / decode_phase["iters"] if decode_phase["iters"]
                         else None},
        # the median pass's steps by kind (mixed: with a prefill call), each with its time and the tokens it emitted
        # and prefilled: where a mode's time goes against another's
        "phases": {k: dict(v, ms_per_step=1e3 * v["s"] / v["steps"] if v["steps"] else None,
                           generated_per_s=v["generated"] / v["s"] if v["s"] else None) for k, v in phs.items()},
        "drafts": drafts, "draft_tokens": drafts * eng.k, "accepted_tokens": acc,
        "acceptance_rate": acc / (drafts * eng.k) if drafts else 0.0,
        "mean_acceptance_length": 1 + acc / drafts if drafts else 0.0,
        "acceptance_rate_per_pos": [a / drafts for a in per_pos] if drafts else [],
        "compiles_after_warmup": eng.compiles_after_warmup,
        "kv_bytes_per_token": eng.memory["global_kv_bytes_per_token"],
        "kernels": eng.kernels_line, "run_options": eng.run_options,
        # the whole-step floor of one decode iteration (target rows + draft + sampling), bench/step_floor.py
        "iteration_floor": step_floor.engine_floor(eng, sum(map(len, prompts)) / len(prompts) + args.max_tokens / 2,
                                                   speculative),
        "prompts": "chat" if args.chat_prompts else "text" if args.text_prompts else "random",
        "mean_prompt_len": sum(map(len, prompts)) / len(prompts),
        **({"iteration_breakdown": breakdown} if breakdown else {}),
    }


def run_modes(m, args, modes) -> list:
    from dsflash.serve.engine.backend import ModelBackend
    from dsflash.serve.engine.testing import ToyBackend
    runs = []
    for mode in modes:
        # the model's own precision / backend; the routed-expert layout the engine would pick (EngineConfig's "auto")
        be = ToyBackend() if m is None else ModelBackend(m, moe_weight_layout="auto")
        g = run_mode(be, args, mode)
        next(g)
        runs.append(g)
    for _ in range(args.passes):    # interleaved, so a change of machine load hits every mode alike
        for g in runs:
            g.send("pass")
    results = []
    for mode, g in zip(modes, runs):
        r = g.send("done")
        results.append(r)
        line = (f"[{mode:8s}] {r['tokens_per_s']:8.1f} tok/s  ({r['generated_tokens']} tokens in {r['elapsed_s']:.2f}s, "
                f"{r['steps']} steps, {r['step_time_ms']:.1f} ms/step, host {r['host_overhead_per_step_ms']:.2f} "
                f"ms/step, warm-up {r['warmup_s']:.0f}s, compiles after warm-up {r['compiles_after_warmup']})")
        print(line)
        dp = r["decode_phase"]
        if dp["ms_per_iter"] is not None:
            print(f"        decode phase: {dp['ms_per_iter']:.2f} ms per decode iteration over {dp['steps']} decode-only "
                  f"steps ({dp['iters']} iterations)")
        print("        by step kind: " + "; ".join(
            f"{k} {v['steps']} steps {1e3 * v['s']:.1f} ms ({v['ms_per_step'] or 0:.2f} ms each), {v['iters']} decode "
            f"iterations, {v['generated']} tokens emitted, {v['prompt_tokens']} prompt tokens"
            for k, v in r["phases"].items()))
        print(f"        {r['kernels']}")
        if r["speculative"]:
            pp = " ".join(f"{a:.2f}" for a in r["acceptance_rate_per_pos"])
            print(f"        drafts {r['drafts']}, draft tokens {r['draft_tokens']}, accepted {r['accepted_tokens']}, "
                  f"acceptance rate {r['acceptance_rate']:.3f}, mean acceptance length "
                  f"{r['mean_acceptance_length']:.3f}, per position [{pp}]")
            if mode.startswith("adaptive"):
                print(f"        adaptive: drafted in {100 * r.get('spec_drafted_call_fraction', 0):.0f}% of decode "
                      f"calls, {r.get('spec_requests_stopped_drafting', 0)} requests stopped drafting, "
                      f"{r.get('spec_calls_plain_for_prefill', 0)} calls plain for prefill")
            b = r.get("iteration_breakdown")
            if b:
                print(f"        breakdown ({b['rows']} rows, median ms): forward 1 row {b['forward_1_ms']:.2f}, "
                      f"forward {b['block'] + 1} rows + draft context {b['forward_block1_with_context_ms']:.2f}, "
                      f"propose {b['propose_ms']:.2f} -> a speculative iteration's model work = "
                      f"{b['spec_model_work_in_plain_iterations']:.2f} plain iterations' (pays off when the mean "
                      f"acceptance length is larger)")
        sys.stdout.flush()
    return results


def ratios(results) -> dict:
    """Each drafting mode's tokens/s over plain's (when plain ran)."""
    plain = next((r for r in results if r["mode"] == "plain"), None)
    if plain is None or not plain["tokens_per_s"]:
        return {}
    return {f"{r['mode']}_over_plain": r["tokens_per_s"] / plain["tokens_per_s"] for r in results if r is not plain}


def ratios_by_round(results) -> dict:
    """Each drafting mode's tokens/s over plain's pass by pass: the modes' passes run interleaved, round by round, so
    pass ``i`` of a mode and of plain ran next to each other (under the same load); the ratio's median and range over
    the rounds say how far the median passes' ratio (``ratios``) is from noise (2-core CPU, session 28: passes
    spread +-10 %, and a whole pass is one sample)."""
    import statistics
    plain = next((r for r in results if r["mode"] == "plain"), None)
    if plain is None:
        return {}
    out = {}
    for r in results:
        if r is plain:
            continue
        rat = [a / b for a, b in zip(r["passes_tokens_per_s"], plain["passes_tokens_per_s"]) if b]
        if rat:
            out[f"{r['mode']}_over_plain"] = {"median": statistics.median(rat), "min": min(rat), "max": max(rat),
                                              "rounds": rat}
    return out


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    from dsflash.serve.engine.backend import load_model
    t = time.perf_counter()
    if args.model == "toy":      # the toy backend (dsflash.serve.engine.testing): drafts that often match
        m = None
    else:
        from dsflash.serve.engine.config import resolve_backend
        m = load_model(args.model, precision=args.precision, backend=resolve_backend(args.backend))
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r}")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [None]
    what = "held-out chat first turns, each to its end of turn" if args.chat_prompts else f"{args.prompt_len} tokens"
    print(f"model {args.model}: loaded in {time.perf_counter() - t:.1f}s; {args.num_prompts} prompts x "
          f"{what}, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"max_num_seqs {args.max_num_seqs}, decode_steps {args.decode_steps}, precision {args.precision}, "
          f"backend {args.backend}" + (f", batches {batches}" if args.batches else ""))
    runs = []
    for b in batches:
        if b is not None:
            args.num_prompts = args.max_num_seqs = b
            print(f"--- batch {b}")
        results = run_modes(m, args, modes)
        rat, by_round = ratios(results), ratios_by_round(results)
        for name, v in rat.items():
            rr = by_round.get(name)
            print(f"{name.replace('_over_', ' / ')} tokens/s: {v:.2f}x" + (f" (batch {b})" if b else "")
                  + (f"; pass by pass over {len(rr['rounds'])} rounds: median {rr['median']:.2f}x, "
                     f"{rr['min']:.2f}-{rr['max']:.2f}x" if rr and len(rr["rounds"]) > 1 else ""))
        runs.append({"batch": b, "results": results, "ratios": rat, "ratios_by_round": by_round})
        if args.json:            # after every batch: a long run cut short keeps what it measured
            with open(args.json, "w") as f:
                out = {"args": vars(args)}
                out.update({"batches": runs} if args.batches else {"results": results, "ratios": rat,
                                                                   "ratios_by_round": by_round})
                json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
