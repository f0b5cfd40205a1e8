"""Greedy speculative decoding on held-out prompts with the exported checkpoint (the serving engine).

    python -m dsflash.train.spec_eval CHECKPOINT_DIR [--prompts 8] [--max-tokens 32]

Runs ``dsflash.LLM`` twice (speculative on / off) at temperature 0 on prompts cut from the held-out
documents, reports whether the outputs are identical, the engine's mean acceptance length (1 + accepted
drafts per verification) and the per-position acceptance rates.
"""
from __future__ import annotations

import argparse
import json


def heldout_prompts(n: int, chars: int = 160) -> list[str]:
    from dsflash.train import data
    _, held = data.split_documents(data.corpus_documents())
    return [d[:chars] for d in held if len(d) > chars][:n]


def spec_eval(ckpt: str, n_prompts: int = 8, max_tokens: int = 32) -> dict:
    from dsflash.llm import LLM
    from dsflash.serve.types import SamplingParams

    prompts = heldout_prompts(n_prompts)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = {}
    outs = {}
    for spec in (True, False):
        llm = LLM(ckpt, speculative=spec, speculative_mode="always", max_num_seqs=len(prompts), max_model_len=256)
        o = llm.generate(prompts, sp)
        outs[spec] = [r.outputs[0].token_ids for r in o]
        if spec:
            m = llm.metrics_snapshot()
            res.update({k: m[k] for k in ("spec_mean_acceptance_length", "spec_acceptance_rate",
                                          "spec_acceptance_rate_per_pos", "spec_num_drafts")})
            res["sample"] = {"prompt": prompts[0], "completion": o[0].outputs[0].text}
    res["greedy_equal"] = outs[True] == outs[False]
    res["prompts"] = len(prompts)
    res["max_tokens"] = max_tokens
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsflash.train.spec_eval")
    ap.add_argument("checkpoint")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args(argv)
    print(json.dumps(spec_eval(a.checkpoint, a.prompts, a.max_tokens), indent=2))


if __name__ == "__main__":
    main()
