"""``python -m dsflash.bench engine``: end-to-end engine throughput with and without DSpark drafts.

Runs the same closed batch of synthetic prompts through the engine twice (``speculative`` on / off),
after warm-up (compilation excluded), and prints generated tokens/s, steps, host overhead per step and
the acceptance numbers (drafts, acceptance rate, mean acceptance length = 1 + accepted/drafts, per
position). ``--json PATH`` writes the numbers. Random-weight presets accept few drafts: the point on
CPU is the mechanism and the host overhead, not the speed-up.
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
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--prefill-buckets", default="4x32", help="comma list of ROWSxTOKENS prefill buckets")
    p.add_argument("--decode-steps", type=int, default=4, help="decode iterations per device call")
    p.add_argument("--precision", default="reference", choices=["reference", "bf16", "fp32"])
    p.add_argument("--modes", default="spec,plain", help="comma list of spec, plain")
    p.add_argument("--async-scheduling", action="store_true",
                   help="dispatch step N+1 before processing step N (on a dispatch thread)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run (GIL hand-off latency of the dispatch thread)")
    p.add_argument("--seed", type=int, default=0)
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


def run_mode(model, args, speculative: bool) -> dict:
    import numpy as np

    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.types import SamplingParams
    t0 = time.perf_counter()
    eng = LLMEngine(model, speculative=speculative, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                    page_size=args.page_size, max_num_batched_tokens=args.max_num_batched_tokens,
                    precision=args.precision, decode_steps=args.decode_steps, async_scheduling=args.async_scheduling,
                    seed=args.seed, enable_prefix_caching=False,
                    prefill_buckets=[tuple(int(v) for v in b.split("x")) for b in args.prefill_buckets.split(",")])
    startup = time.perf_counter() - t0
    V = eng.backend.vocab_size
    rng = np.random.default_rng(args.seed)
    if args.text_prompts:
        prompts = text_prompts(eng.tokenizer, args.num_prompts, args.prompt_len)
    else:
        prompts = [[int(t) for t in rng.integers(4, V, size=args.prompt_len)] for _ in range(args.num_prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True, seed=args.seed)

    def one_pass(tag):
        for i, p in enumerate(prompts):
            eng.add_request(f"{tag}{i}", p, sp)
        t = time.perf_counter()
        n_tok = 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    n_tok += len(o.outputs[0].token_ids)
        return n_tok, time.perf_counter() - t

    one_pass("warm")                           # first-touch effects outside the timed pass
    m0 = eng.metrics_snapshot()
    n_tok, dt = one_pass("run")
    m = eng.metrics_snapshot()
    steps = m["num_steps"] - m0["num_steps"]
    host = m["host_time_s"][-steps:] if steps else []
    drafts = m["spec_num_drafts"] - m0["spec_num_drafts"]
    acc = m["spec_num_accepted_tokens"] - m0["spec_num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(m["spec_accepted_per_pos"], m0["spec_accepted_per_pos"])]
    return {
        "speculative": speculative, "startup_s": startup, "warmup_s": eng.warmup_time,
        "generated_tokens": n_tok, "elapsed_s": dt, "tokens_per_s": n_tok / dt if dt else 0.0,
        "steps": steps, "host_overhead_per_step_ms": 1e3 * statistics.mean(host) if host else 0.0,
        "step_time_ms": 1e3 * dt / steps if steps else 0.0,
        "decode_iters": m["num_decode_iters"] - m0["num_decode_iters"],
        "drafts": drafts, "draft_tokens": drafts * eng.k, "accepted_tokens": acc,
        "acceptance_rate": acc / (drafts * eng.k) if drafts else 0.0,
        "mean_acceptance_length": 1 + acc / drafts if drafts else 0.0,
        "acceptance_rate_per_pos": [a / drafts for a in per_pos] if drafts else [],
        "compiles_after_warmup": eng.compiles_after_warmup,
        "kv_bytes_per_token": eng.memory["global_kv_bytes_per_token"],
    }


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    from dsflash.serve.engine.backend import ModelBackend, load_model
    t = time.perf_counter()
    if args.model == "toy":      # the toy backend (dsflash.serve.engine.testing): drafts that often match
        from dsflash.serve.engine.testing import ToyBackend
        m = None
    else:
        m = load_model(args.model)
    print(f"model {args.model}: loaded in {time.perf_counter() - t:.1f}s; {args.num_prompts} prompts x "
          f"{args.prompt_len} tokens, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"max_num_seqs {args.max_num_seqs}, decode_steps {args.decode_steps}, precision {args.precision}")
    results = []
    for mode in [x.strip() for x in args.modes.split(",") if x.strip()]:
        if mode not in ("spec", "plain"):
            raise SystemExit(f"--modes: unknown mode {mode!r}")
        be = ToyBackend() if m is None else ModelBackend(m, precision=args.precision)
        r = run_mode(be, args, mode == "spec")
        results.append(r)
        line = (f"[{mode:5s}] {r['tokens_per_s']:8.1f} tok/s  ({r['generated_tokens']} tokens in {r['elapsed_s']:.2f}s, "
                f"{r['steps']} steps, {r['step_time_ms']:.1f} ms/step, host {r['host_overhead_per_step_ms']:.2f} "
                f"ms/step, warm-up {r['warmup_s']:.0f}s, compiles after warm-up {r['compiles_after_warmup']})")
        print(line)
        if r["speculative"]:
            pp = " ".join(f"{a:.2f}" for a in r["acceptance_rate_per_pos"])
            print(f"        drafts {r['drafts']}, draft tokens {r['draft_tokens']}, accepted {r['accepted_tokens']}, "
                  f"acceptance rate {r['acceptance_rate']:.3f}, mean acceptance length "
                  f"{r['mean_acceptance_length']:.3f}, per position [{pp}]")
        sys.stdout.flush()
    if len(results) == 2 and results[1]["tokens_per_s"]:
        print(f"speculative / plain tokens/s: {results[0]['tokens_per_s'] / results[1]['tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
