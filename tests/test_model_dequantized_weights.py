"""``dequantized_weights``: the FP8 / MXFP4 weights dequantised once (what the engine's backend does on one CPU
device, instead of dequantising in every call) give bit-identical outputs at every precision, keep Engram tables
and unquantised tensors as stored, and decline when too large."""
import copy

import jax.numpy as jnp
import numpy as np
import pytest

import dsflash
from dsflash.model.params import dequantized_weights, spec_map
from dsflash.serve.engine.backend import ModelBackend


@pytest.mark.parametrize("precision", ["reference", "bf16", "fp32"])
def test_demo_logits_are_bit_identical(precision):
    m = dsflash.load("demo", precision=precision, progress=False)
    dq = dequantized_weights(m.cfg, m.params)
    m2 = copy.copy(m)
    m2.params = dq
    toks = np.asarray([m.tokenizer.encode_prompt("def foo(x):\n    return x + 1\n\nclass Bar(object):\n    pass")])
    a, b = m.logits(toks), m2.logits(toks)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def test_what_changes_and_what_stays():
    m = dsflash.load("demo", progress=False)
    specs = spec_map(m.cfg)
    dq = dequantized_weights(m.cfg, m.params)
    changed = {n for n, s in specs.items() if s.fmt in ("fp8", "mxfp4") and n in m.params}
    assert changed and any(specs[n].fmt == "mxfp4" for n in changed)
    for n in changed:
        shape = specs[n].shape if specs[n].fmt == "fp8" else (*specs[n].shape[:-1], 2 * specs[n].shape[-1])  # nibbles
        assert dq[n].dtype in (jnp.bfloat16, jnp.float32) and dq[n].shape == shape, n
        assert n[: -len(".weight")] + ".scale" not in dq
    for n, a in m.params.items():                         # everything else as stored (Engram tables included)
        if n not in changed and not (n.endswith(".scale") and n[: -len(".scale")] + ".weight" in changed):
            assert dq[n] is a, n
    assert any(specs.get(n) is not None and specs[n].fmt == "fp8rows" and dq[n] is a for n, a in m.params.items())
    assert dequantized_weights(m.cfg, m.params, max_bytes=1000) is None


def test_engine_backend_dequantizes_on_cpu_only_when_it_may():
    m = dsflash.load("tiny", progress=False)
    assert ModelBackend(m).dequantized                                  # XLA, one CPU device
    assert not ModelBackend(m, dequantize=False).dequantized
    assert not ModelBackend(m, backend="triton").dequantized            # the kernels read the packed bytes
    assert ModelBackend(m).params is not m.params and ModelBackend(m, dequantize=False).params is m.params
