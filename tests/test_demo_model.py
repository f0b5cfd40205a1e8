"""The shipped demo model (``dsflash/assets/demo``, issue 8) through the official-format loader.

Recorded values come from its training run (``benchmarks/results/train_demo_20261130_h200_metrics.json``,
one H200): held-out perplexity 24.27 of the exported FP8/MXFP4 checkpoint at reference precision, over the
480 held-out rows shipped beside it (``heldout_rows.npy``). CPU numerics differ slightly from the GPU's
(24.89 measured here), so the test is a bound, not an equality.
Issue 18 (2026-12-01) changed the reference numerics: the routed experts' x W1^T / x W3^T are rounded to bf16 before
the SwiGLU and the NVFP4 main-KV quotients are exact. CPU perplexity before / after: 24.8960 / 24.8950 (2 cores,
this test's computation); the recorded 24.273 is the training run's GPU value under the earlier numerics, kept
until a GPU run re-measures it; the bound (<= 25.49) holds on CPU before and after."""
import json
import os

import numpy as np
import pytest

import dsflash
from dsflash.api import SHIPPED
from dsflash.serve.types import SamplingParams
from dsflash.train import loop

RECORDED_PPL = 24.273          # metrics.json "loaded_heldout_ppl" of the training run
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
    # the shipped draft (2026-11-30, fourth run) measured 1.62 on these 6 prompts x 24 tokens at fp32, the one
    # before it ~1.5; a random draft is accepted at ~1/4096 per position (mean length ~1.0)
    assert acc > 1.4, acc


def test_generates_readable_text():
    llm = dsflash.LLM(max_num_seqs=2, max_model_len=256)
    text = llm.generate(["The try statement"], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0].text
    words = text.split()
    assert len(words) >= 5
    # mostly English words / identifiers, not byte soup
    assert sum(w.strip('.,:;()"\'').isalpha() for w in words) >= len(words) // 2, text
