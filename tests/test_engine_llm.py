"""The offline API: generate (batched, ordered), streaming, grain datasets (toy backend)."""
import grain
import pytest

from dsflash.llm import LLM
from dsflash.serve.engine.testing import ToyBackend
from dsflash.serve.types import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(ToyBackend(), max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=32,
               decode_steps=2, prefill_buckets=[(1, 16), (4, 8)])


def test_generate_ordered_and_stream(llm):
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9] * 20, [3, 4], [11, 12, 13, 14], [8] * 9, [2, 3]]
    outs = llm.generate(prompts, sp)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == 6 and o.outputs[0].finish_reason == "length" for o in outs)
    one = llm.generate([9] * 20, sp)
    assert one[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    seen = []
    for o in llm.generate_stream([[5, 6, 7]], sp):
        seen.append(len(o.outputs[0].token_ids))
    assert seen[-1] == 6 and seen == sorted(seen)
    assert o.metrics.first_token_time is not None and o.metrics.num_generation_tokens == 6


def test_generate_dataset_with_grain(llm):
    recs = [{"prompt": [5 + i, 6, 7]} for i in range(7)]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    got = list(llm.generate_dataset(grain.MapDataset.source(recs), sp, max_in_flight=3))
    assert [i for i, _ in got] == list(range(7))
    direct = llm.generate([r["prompt"] for r in recs], sp)
    assert [o.outputs[0].token_ids for _, o in got] == [o.outputs[0].token_ids for o in direct]
    assert llm.engine.compiles_after_warmup == 0
