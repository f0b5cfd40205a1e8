"""Greedy speculative decoding on held-out prompts with the exported checkpoint (the serving engine).

    python -m dsflash.train.spec_eval CHECKPOINT_DIR [--prompts 8] [--max-tokens 32] [--chat-prompts 16]

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


def heldout_chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The prompts of the first assistant turn of ``n`` held-out conversations (``chat_data``; tools and thinking
    as the conversation has them), as the server renders and tokenises them."""
    from dsflash.train import chat_data
    _, held = chat_data.split(chat_data.conversations())
    return chat_data.first_turn_prompts(tokenizer, held[:n])


def _run(ckpt: str, prompts, max_tokens: int, ignore_eos: bool) -> dict:
    from dsflash.llm import LLM
    from dsflash.serve.types import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    longest = max(len(p) for p in prompts) if prompts and not isinstance(prompts[0], str) else 0
    max_len = max(256, -(-(longest + max_tokens + 8) // 64) * 64)
    res = {}
    outs = {}
    for spec in (True, False):
        llm = LLM(ckpt, speculative=spec, speculative_mode="always", max_num_seqs=len(prompts), max_model_len=max_len)
        o = llm.generate(prompts, sp)
        outs[spec] = [r.outputs[0].token_ids for r in o]
        if spec:
            m = llm.metrics_snapshot()
            res.update({k: m[k] for k in ("spec_mean_acceptance_length", "spec_acceptance_rate",
                                          "spec_acceptance_rate_per_pos", "spec_num_drafts")})
            res["sample"] = {"prompt": prompts[0] if isinstance(prompts[0], str) else llm.tokenizer.decode(prompts[0]),
                             "completion": o[0].outputs[0].text}
    res["greedy_equal"] = outs[True] == outs[False]
    res["prompts"] = len(prompts)
    res["max_tokens"] = max_tokens
    return res


def spec_eval(ckpt: str, n_prompts: int = 8, max_tokens: int = 32, chat_prompts: int = 0) -> dict:
    """Documentation prompts (``n_prompts``, EOS ignored); with ``chat_prompts`` also that many held-out chat
    prompts (under ``"chat"``: generation stops at the end of the assistant's turn, as served)."""
    res = _run(ckpt, heldout_prompts(n_prompts), max_tokens, True)
    if chat_prompts:
        from dsflash.tokenizer import Tokenizer
        res["chat"] = _run(ckpt, heldout_chat_prompts(Tokenizer.from_folder(ckpt), chat_prompts), max_tokens, False)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsflash.train.spec_eval")
    ap.add_argument("checkpoint")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chat-prompts", type=int, default=0,
                    help="also measure on this many held-out chat prompts (chat_data), stopping at end of turn")
    a = ap.parse_args(argv)
    print(json.dumps(spec_eval(a.checkpoint, a.prompts, a.max_tokens, a.chat_prompts), indent=2))


if __name__ == "__main__":
    main()
