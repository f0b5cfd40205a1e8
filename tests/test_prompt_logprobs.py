"""``echo`` + ``logprobs``'s prompt scoring (dsflash/serve/http/prompt_logprobs.py) against the model's own
full-prefill logits: entry i is log p(ids[i] | ids[:i]), entry 0 is None, top-k sorted; the padding of the
bucket does not change a value."""
from __future__ import annotations

import numpy as np


def test_prompt_logprobs_equal_the_models_logits():
    import dsflash
    from dsflash.serve.engine.backend import ModelBackend
    from dsflash.serve.http.prompt_logprobs import prompt_logprobs

    model = dsflash.load("tiny", progress=False)

    class Engine:                       # what prompt_logprobs reads of an LLMEngine
        backend = ModelBackend(model, bounded_replay=None)

    ids = [1, 5, 9, 33, 2, 7, 100, 41, 8, 3, 11]          # 11 tokens, padded to a 16-token bucket
    got = prompt_logprobs(Engine(), ids, 3)
    logits = model.logits([ids])[0].astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        e = got[i]
        assert e["token_id"] == ids[i]
        np.testing.assert_allclose(e["logprob"], lp[i - 1, ids[i]], atol=1e-4)
        top = sorted(e["top"].items(), key=lambda kv: -kv[1])
        assert [t for t, _ in top] == list(np.argsort(-lp[i - 1], kind="stable")[:3])
