"""The shipped demo model (``dsflash/assets/demo``, issue 8; chat stage issue 22) through the official-format loader.

Recorded values come from its training runs. The target was trained on one H200 (2026-11-30,
``benchmarks/results/train_demo_20261130_h200_metrics.json``), the draft retrained on it later; the target then got
two quantisation-aware chat stages on this 2-core CPU, the draft shipped unchanged: 160 steps on 2026-12-04
(``train_chat_20261204_cpu_metrics.json``) and 300 more at lr 6e-4 on 2026-12-05
(``train_chat2_20261205_cpu_metrics.json``); then the draft alone was retrained on the chat-tuned target, in two
CPU rounds with chat prompts in its chains (2026-12-05, ``train_draft_chat_20261205_cpu_r2_metrics.json``; the
target tensors unchanged, 22.17 again). The chat stage measured the exported checkpoint's held-out perplexity at
reference precision over the 480 held-out rows shipped beside it (``heldout_rows.npy``): 22.17 (23.13 after the
first stage; 24.90 on this CPU before either). The test is a bound (x 1.05), not an equality: other machines'
numerics differ slightly. The chat tests check what the stages taught on first turns, unaided (no grammar), with
the ``trials`` of scripts/chat_samples.py: the second chat stage measured, over 20 held-out conversations of each kind,
20 / 20 tool turns with a parseable, schema-valid DSML call and 20 / 20 other turns ended by the model (19 with
content), no leaked markup; over 20 training conversations of each kind, 7 / 20 answers name the entity asked
about. The first 8 held-out ones of each kind are checked here, at 96 tokens (measured there: 8 calls, 6 all
schema-valid; the model before this run 7 and 4), with bounds below those rates. Not checked, because the model does not
do it: naming a held-out entity (0 / 20: the name would have to be copied from the question, and the model answers
about a name it knows) or naming the entity in a tool call's arguments (0 / 20 even for trained ones: the argument
sits ~67 tokens after the name, past the 32-token window; docs/training.md).
"""
import json
import os

import numpy as np
import pytest

import dsflash
from dsflash.api import SHIPPED
from dsflash.serve.types import SamplingParams
from dsflash.train import loop

RECORDED_PPL = 22.170          # metrics.json "loaded_heldout_ppl" of the second chat-stage run (CPU, 2026-12-05)
FOLDER = SHIPPED["demo"]


def test_shipped_checkpoint_is_small_and_described():
    size = sum(os.path.getsize(os.path.join(FOLDER, f)) for f in os.listdir(FOLDER))
    assert size <= 20 * 2**20, size                                    # the issue's ~20 MB budget
    meta = json.load(open(os.path.join(FOLDER, "training.json")))
    assert meta["config"] == "demo" and meta["draft_steps_run"] > 0


def test_heldout_perplexity_within_bound_of_recorded():
    m = dsflash.load()                           # the default: the shipped demo model via load_checkpoint
    assert m.name == "demo" and m.cfg.vocab_size == 4096 and m.tokenizer is not None
    rows = np.load(os.path.join(FOLDER, "heldout_rows.npy")).astype(np.int32)
    ppl = loop.perplexity(m.params, m.cfg, rows, 32, "reference")
    assert ppl <= RECORDED_PPL * 1.05, ppl
    assert ppl < m.cfg.vocab_size / 50            # far from the uniform 4,096: the weights are trained


@pytest.fixture(scope="module")
def prompts():
    from dsflash.train.spec_eval import heldout_prompts
    return heldout_prompts(6, chars=120)


def test_greedy_speculative_equals_plain_fp32(prompts):
    """Exact at fp32. At reference precision verification batches 1 + 5 rows per sequence, and a bf16-ulp
    difference can flip an FP8 rounding or a top-k pick at near-ties (SPEC §16b.10): there the two agree on
    most rows (measured 10 of 16 at 48 tokens), which is not an exactness check."""
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for spec in (True, False):
        llm = dsflash.LLM(speculative=spec, speculative_mode="always", precision="fp32", max_num_seqs=8, max_model_len=256)
        outs[spec] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        if spec:
            acc = llm.engine.metrics_snapshot()["spec_mean_acceptance_length"]
    assert outs[True] == outs[False]
    assert all(len(t) == 24 for t in outs[True])
    # the shipped draft (retrained 2026-12-05 on the chat-tuned target) measured 1.59 on these 6 prompts x 24 tokens
    # at fp32, the fourth run's 1.62 on the target before the chat stages; a random draft is accepted at ~1/4096 per
    # position (mean length ~1.0)
    assert acc > 1.4, acc


def test_generates_readable_text():
    llm = dsflash.LLM(max_num_seqs=2, max_model_len=256)
    text = llm.generate(["The try statement"], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0].text
    words = text.split()
    assert len(words) >= 5
    # mostly English words / identifiers, not byte soup
    assert sum(w.strip('.,:;()"\'').isalpha() for w in words) >= len(words) // 2, text


@pytest.fixture(scope="module")
def chat_trials():
    """scripts/chat_samples.py's ``trials`` on the first 8 held-out conversations of each kind (greedy, no grammar)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("chat_samples", os.path.join(os.path.dirname(__file__), "..",
                                                                                 "scripts", "chat_samples.py"))
    cs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cs)
    llm = dsflash.LLM(max_num_seqs=8, max_model_len=2048)
    return cs.trials(llm, SamplingParams(max_tokens=96, temperature=0.0), 8)


def test_chat_tool_turns_call_a_tool_unaided(chat_trials):
    t = chat_trials["tool"]
    assert t["n"] == 8 and t["calls"] >= 7 and t["all_valid"] >= 5, {k: v for k, v in t.items() if k != "rows"}


def test_chat_answers_end_with_content_and_no_markup(chat_trials):
    a = chat_trials["answer"]
    assert a["n"] == 8 and a["ended"] >= 5 and a["has_content"] >= 5, {k: v for k, v in a.items() if k != "rows"}
    assert a["leaked_markup"] == 0, [r["raw"] for r in a["rows"] if r["leaked_markup"]]
