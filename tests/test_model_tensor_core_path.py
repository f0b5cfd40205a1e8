"""``layers.tensor_cores()`` chooses, per platform, whether bf16-exact operands of the reference linears stay bf16
(GPU tensor cores) or are widened to fp32 (CPU). The two forms must compute the same function; the GPU checks the
real widths (tests/gpu/test_tensor_core_linears.py). Here, on CPU, the GPU form is forced and the tiny model's
reference logits must stay within fp32 accumulation noise of the CPU form (a path that rounded to bf16 somewhere
new, or dropped a round trip, moves them by >= 1e-3); fp32-precision linears stay bit-identical, and the head /
gate / compressor take bf16 operands only when both inputs are bf16."""
import jax
import numpy as np
import pytest

import dsflash
from dsflash.model import layers


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return rng.integers(5, 500, (2, 24)).tolist()


def _logits(model, ids, **kw):
    return np.asarray(model.logits(ids, **kw), np.float32)


def test_forced_tensor_core_form_matches_widened_reference(monkeypatch, prompts):
    m = dsflash.load("tiny", precision="reference")
    wide = _logits(m, prompts)
    monkeypatch.setattr(layers, "tensor_cores", lambda: True)
    jax.clear_caches()                       # retrace: a cached program would compare the CPU form with itself
    tc = _logits(m, prompts)
    rel = np.linalg.norm(tc - wide) / np.linalg.norm(wide)
    assert 0 < rel < 1e-3, rel               # > 0: the bf16-operand form really ran (its sums differ in order)
    assert np.mean(tc.argmax(-1) == wide.argmax(-1)) >= 0.95


def test_fp32_precision_linears_are_untouched_by_the_tensor_core_form(monkeypatch):
    import jax.numpy as jnp
    rng = np.random.default_rng(1)
    p = {"w.weight": jnp.asarray(rng.standard_normal((64, 96)) * 2, jnp.float32).astype(jnp.float8_e4m3fn),
         "w.scale": jnp.asarray(rng.integers(118, 124, (2, 3)), jnp.uint8)}
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    wide = np.asarray(layers.linear_fp8(x, p, "w", "fp32"))
    monkeypatch.setattr(layers, "tensor_cores", lambda: True)
    assert np.array_equal(np.asarray(layers.linear_fp8(x, p, "w", "fp32")), wide)
    # reference precision: the weights / activations the GPU form keeps in bf16 are the same values
    ref_tc = np.asarray(layers.linear_fp8(x, p, "w", "reference"), np.float32)
    monkeypatch.setattr(layers, "tensor_cores", lambda: False)
    ref_wide = np.asarray(layers.linear_fp8(x, p, "w", "reference"), np.float32)
    assert np.max(np.abs(ref_tc - ref_wide) / np.maximum(np.abs(ref_wide), 1e-6)) <= 2.0 ** -7


def test_linear_f32_keeps_fp32_operands(monkeypatch):
    import jax.numpy as jnp
    monkeypatch.setattr(layers, "tensor_cores", lambda: True)
    rng = np.random.default_rng(0)
    x32 = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)      # not bf16-exact
    w = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    want = np.asarray(x32) @ np.asarray(w.astype(jnp.float32)).T
    got = np.asarray(layers.linear_f32(x32, w))
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    # bf16 activations: the bf16 form, same products
    xb = x32.astype(jnp.bfloat16)
    want_b = np.asarray(xb.astype(jnp.float32)) @ np.asarray(w.astype(jnp.float32)).T
    assert np.allclose(np.asarray(layers.linear_f32(xb, w)), want_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["reference", "bf16"])
def test_tensor_core_linears_round_in_the_dot(monkeypatch, precision):
    """On the tensor cores the bf16 output is the dot's own result type (the GEMM rounds its fp32 accumulators in
    its epilogue), not an fp32 result converted by a separate op: at prefill widths that fp32 tensor and its convert
    were pure memory traffic (H100: 0.26 ms a layer for wq_b at 4096 tokens). The CPU form keeps the fp32 dot."""
    import re

    import jax.numpy as jnp
    rng = np.random.default_rng(2)
    p = {"w.weight": jnp.asarray(rng.standard_normal((64, 96)) * 2, jnp.float32).astype(jnp.float8_e4m3fn),
         "w.scale": jnp.asarray(rng.integers(118, 124, (2, 3)), jnp.uint8)}
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.bfloat16)

    def dot_results(fn):
        text = jax.jit(fn).lower(p, x).as_text()
        return [re.findall(r"->\s*tensor<(?:\d+x)*(\w+)>", ln)[-1] for ln in text.splitlines() if "dot_general" in ln]

    fns = (lambda p, x: layers.linear_fp8(x, p, "w", precision),
           lambda p, x: layers.linear_bf16(x, p["w.weight"].astype(jnp.bfloat16), precision))
    assert [dot_results(f) for f in fns] == [["f32"], ["f32"]]
    monkeypatch.setattr(layers, "tensor_cores", lambda: True)
    jax.clear_caches()                       # retrace: the choice is made at trace time
    assert [dot_results(f) for f in fns] == [["bf16"], ["bf16"]]
