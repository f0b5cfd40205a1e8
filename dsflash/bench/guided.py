"""``python -m dsflash.bench guided``: the cost of structured output (guided decoding).

1. **Mask cost** on the host: a valid JSON document is walked token by token through an llguidance matcher of
   its schema, timing each next-token bitmask (``compute_bitmask``), for the model's tokenizer and for the
   full-size (129,280-id) synthetic tokenizer.
2. **Engine tokens/s** on the same closed batch of chat prompts: ``free`` (no constraint, ``ignore_eos``),
   ``json`` (every request under a JSON schema), ``mixed`` (half of them): generated tokens / wall time after
   warm-up, steps, ms per step, the host mask time per guided token and the drafts accepted per verification,
   once per ``--speculative-modes`` engine (``off`` / ``always`` / ``adaptive``): guided rows decode one device
   iteration per call, verifying drafts against the grammar when speculating (docs/server.md "Structured
   output").
``--json PATH`` writes the numbers (with the commit, date and load average).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}}
DOC = {"name": "compile_options", "ok": True, "n": 1234, "tags": ["jax", "xla", "serve"]}


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m dsflash.bench guided", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--modes", default="free,json,mixed")
    p.add_argument("--speculative-modes", default="off,always", help="one engine each (adaptive, always, off)")
    p.add_argument("--passes", type=int, default=1, help="runs of every mode per engine (the best is kept)")
    p.add_argument("--no-full-vocab", action="store_true", help="skip the 129,280-id tokenizer's mask timing")
    p.add_argument("--json", default=None, help="write results here")
    return p.parse_args(argv)


def mask_cost(tok, vocab_size: int, repeats: int = 5) -> dict:
    """Per-token bitmask time (ms) walking ``DOC`` through a matcher of ``SCHEMA``."""
    from dsflash.serve.engine.guided import Guide
    from dsflash.serve.types import GuidedDecoding
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")))
    times, build = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        g = Guide(GuidedDecoding(json=SCHEMA), tok, vocab_size)
        build.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            g.matcher.compute_bitmask()
            times.append(time.perf_counter() - t0)
            assert g.matcher.consume_token(t), g.matcher.get_error()
    times.sort()
    return {"vocab": vocab_size, "tokens": len(ids), "mask_ms_median": 1e3 * statistics.median(times),
            "mask_ms_mean": 1e3 * statistics.fmean(times), "mask_ms_p90": 1e3 * times[int(0.9 * (len(times) - 1))],
            "mask_ms_max": 1e3 * times[-1], "matcher_build_ms_median": 1e3 * statistics.median(build)}


def run_mode(eng, mode: str, args) -> dict:
    from dsflash.serve.engine import guided as G
    from dsflash.serve.types import GuidedDecoding, SamplingParams
    prompt = "<｜begin▁of▁sentence｜><｜User｜>Describe module {i} as JSON.<｜Assistant｜></think>"
    m0 = G.STATS["masks"], G.STATS["mask_s"]
    met = eng.metrics
    steps0, d0, a0 = met.num_steps, met.spec_num_drafts, met.spec_num_accepted_tokens
    t0 = time.perf_counter()
    for i in range(args.num_prompts):
        guided = mode == "json" or (mode == "mixed" and i % 2 == 0)
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i, ignore_eos=not guided,
                            guided=GuidedDecoding(json=SCHEMA) if guided else None)
        eng.add_request(f"{mode}-{i}", prompt.format(i=i), sp)
    toks = guided_toks = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                n = len(o.outputs[0].token_ids)
                toks += n
                i = int(o.request_id.rsplit("-", 1)[1])
                guided_toks += n if mode == "json" or (mode == "mixed" and i % 2 == 0) else 0
    dt = time.perf_counter() - t0
    masks, mask_s = G.STATS["masks"] - m0[0], G.STATS["mask_s"] - m0[1]
    steps, drafts = met.num_steps - steps0, met.spec_num_drafts - d0
    return {"mode": mode, "generated_tokens": toks, "guided_tokens": guided_toks, "elapsed_s": dt,
            "tokens_per_s": toks / dt, "steps": steps, "ms_per_step": 1e3 * dt / max(steps, 1),
            "masks": masks, "mask_ms_per_guided_token": 1e3 * mask_s / max(masks, 1), "verifications": drafts,
            "accepted_per_verification": (met.spec_num_accepted_tokens - a0) / drafts if drafts else None}


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import os
    from dsflash.bench.serve import git_commit
    from dsflash.serve.engine.engine import LLMEngine
    engines = {}
    for sm in [x.strip() for x in args.speculative_modes.split(",") if x.strip()]:
        t = time.perf_counter()
        engines[sm] = eng = LLMEngine(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                      max_num_batched_tokens=args.max_num_batched_tokens, speculative_mode=sm)
        eng.wait_for_programs()     # timed passes compare programs, not background compile threads
        print(f"model {args.model}, speculative {sm}: engine ready in {time.perf_counter() - t:.1f}s; "
              f"{args.num_prompts} prompts, max_tokens {args.max_tokens}, temperature {args.temperature}, "
              f"max_num_seqs {args.max_num_seqs}")
    costs = [mask_cost(eng.tokenizer, eng.backend.vocab_size)]
    if not args.no_full_vocab:
        import tempfile
        from dsflash.config import preset
        from dsflash.tokenizer import Tokenizer, write_synthetic_tokenizer
        with tempfile.TemporaryDirectory() as d:
            cfg = preset("v41_flash")
            costs.append(mask_cost(Tokenizer.from_folder(write_synthetic_tokenizer(d, cfg)), cfg.vocab_size))
    for c in costs:
        print(f"mask cost, vocab {c['vocab']:6d}: median {c['mask_ms_median']:.3f} ms, mean {c['mask_ms_mean']:.3f}, "
              f"p90 {c['mask_ms_p90']:.3f}, max {c['mask_ms_max']:.3f} per token ({c['tokens']} tokens x 5); "
              f"matcher build {c['matcher_build_ms_median']:.2f} ms")
    results, load = [], [os.getloadavg()[0]]
    for eng in engines.values():
        run_mode(eng, "json", argparse.Namespace(**{**vars(args), "num_prompts": 2}))     # warm the host paths
    for p in range(args.passes):     # engines interleaved per mode: the shared CPU's load drifts
        for mode in [x.strip() for x in args.modes.split(",") if x.strip()]:
            for sm, eng in engines.items():
                r = {"speculative": sm, "pass": p, **run_mode(eng, mode, args)}
                results.append(r)
                load.append(os.getloadavg()[0])
                acc = r["accepted_per_verification"]
                print(f"[{sm:8s} {mode:5s}] {r['tokens_per_s']:7.1f} tok/s ({r['generated_tokens']} tokens, "
                      f"{r['guided_tokens']} guided, in {r['elapsed_s']:.2f}s, {r['steps']} steps, "
                      f"{r['ms_per_step']:.1f} ms/step; host mask {r['mask_ms_per_guided_token']:.3f} ms per guided "
                      f"token; accepted per verification {'-' if acc is None else f'{acc:.2f}'})")
                sys.stdout.flush()
    if args.json:
        import jax
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **git_commit(), "date": time.strftime("%Y%m%d"),
                       "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
                       "kernels": eng.kernels_line, "jax": jax.__version__, "load_average_1m": load,
                       "mask_cost": costs, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
