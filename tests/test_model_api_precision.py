"""``Model.logits`` / ``forward`` with a precision other than the model's default: the session's caches must be
laid out for the precision the forward runs at (the bf16 caches hold plain arrays, the reference ones FP8/FP4
codes + scales). Found on the GPU: ``tiny.logits(..., precision="bf16")`` on a reference-precision model failed
with a KeyError inside jit."""
import numpy as np
import pytest

import dsflash


@pytest.fixture(scope="module")
def tiny():
    return dsflash.load("tiny", progress=False)


def test_logits_at_another_precision_equal_a_model_made_at_it(tiny):
    tokens = np.random.default_rng(0).integers(16, tiny.cfg.vocab_size, size=(2, 40)).astype(np.int32)
    got = tiny.logits(tokens, precision="bf16")
    want = dsflash.load("tiny", precision="bf16", progress=False).logits(tokens)
    ref = tiny.logits(tokens)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, ref)       # the override really ran at bf16, not at the default precision


def test_forward_on_a_session_of_another_precision_is_refused(tiny):
    sess = tiny.init_state(1, 32)
    assert sess["precision"] == "reference"
    with pytest.raises(ValueError, match="precision"):
        tiny.forward(np.arange(16, 24)[None], sess, precision="bf16")
    out = tiny.forward(np.arange(16, 24)[None], tiny.init_state(1, 32, precision="bf16"), precision="bf16")
    assert np.isfinite(np.asarray(out["logits"])).all()
