"""Time the engine's compiled decode programs directly, interleaved in one process: the plain engine's
(``speculative_mode="off"``), the adaptive engine's draft-length-0 and draft-length-``block`` programs, and the
always-drafting engine's batched verify. Every call gets the same inputs: all slots running from the same position
(``--pos``), distinct pages, ``decode_steps`` iterations, draft context current (no catch-up). Prints ms per
iteration (min and median over ``--repeats`` calls per program) and each over the plain engine's program.

    PYTHONPATH=$PWD python3 scripts/adaptive_decode_programs.py --model tiny --batches 1,8,32

Used for issue 23 (docs/engine.md "Adaptive speculation"): the adaptive engine's plain program costs what the
plain engine's does; the drafting program's cost at no acceptance (random-weight tiny model) is the early exit's.
"""
from __future__ import annotations

import argparse
import statistics

import jax

from adaptive_common import iteration_timer


def programs(model, batch, args):
    from dsflash.serve.engine import LLMEngine
    from dsflash.serve.engine.backend import ModelBackend
    common = dict(max_num_seqs=batch, max_model_len=args.max_model_len, page_size=args.page_size,
                  max_num_batched_tokens=128, decode_steps=args.decode_steps, enable_prefix_caching=False,
                  prefill_buckets=[(min(4, batch), 32)])
    engs = {m: LLMEngine(ModelBackend(model), speculative_mode=m, background_compile=False, **common) for m in args.modes.split(",")}
    out = []
    for mode, eng in engs.items():
        for d in eng.runner.draft_lengths:
            out.append((f"{mode}/draft{d}", eng, d))
    return out


def caller(eng, d, pos0):
    return iteration_timer(eng, eng.runner._compiled[("decode", d)], pos0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--precision", default="reference")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--modes", default="off,adaptive,always")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--pos", type=int, default=24)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=4)
    args = p.parse_args(argv)
    from dsflash.serve.engine.backend import load_model
    model = load_model(args.model, precision=args.precision)
    for b in (int(x) for x in args.batches.split(",")):
        progs = programs(model, b, args)
        calls = {name: caller(eng, d, args.pos) for name, eng, d in progs}
        for c in calls.values():          # the cold first call of each program
            c()
        times = {name: [] for name in calls}
        for _ in range(args.repeats):      # interleaved: a change of machine load hits every program alike
            for name, c in calls.items():
                times[name].append(c())
        base = min(times[progs[0][0]])
        for name, ts in times.items():
            print(f"batch {b:3d}  {name:16s} ms/iter min {1e3 * min(ts):7.2f}  median {1e3 * statistics.median(ts):7.2f}"
                  f"  min / {progs[0][0]} {min(ts) / base:.2f}x", flush=True)


if __name__ == "__main__":
    main()
