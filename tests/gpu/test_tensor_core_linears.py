"""The dense linears on the GPU's bf16 tensor cores (``layers.tensor_cores``) against the widened fp32 path they
replaced, at the real widths (issue 19): the operands are bf16-exact (dequantised E4M3 weights, FP8-round-tripped
activations, bf16 weights and activations for the head), so both forms multiply the same values exactly and sum in
fp32; only the accumulation order differs. A path that accumulated in bf16, used TF32 or FP8 inputs, or dropped the
activation round trip would be off by >= 1e-3 relative; fp32 accumulation-order noise over K <= 8192 terms stays
below 1e-5 (checked here as a relative Frobenius error < 2e-5 on the fp32 result) and, after the bf16 output
rounding, changes < 1 % of the elements. Elementwise the fp32 difference is bounded by fp32 accumulation error,
``|d| <= 2^-16 * sum_k |x_k w_k|`` (K * eps32 would be the worst case; 2^-16 ~ 1.5e-5 leaves a wide margin over the
typical sqrt(K) * eps32): a relative bound per element would fail on outputs near zero, where the sum cancels.
Each variant is traced afresh (``jax.clear_caches``): a cached program would compare a path with itself."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytestmark = pytest.mark.gpu


def _dot_operand_types(fn, *args):
    """Element types of every dot_general's operands in the lowered program (e.g. {"bf16"} or {"f32"})."""
    import re
    text = jax.jit(fn).lower(*args).as_text()
    return {t for line in text.splitlines() if "dot_general" in line
            for t in re.findall(r"tensor<(?:\d+x)*(\w+)>", line.split(":")[-1].split("->")[0])}


def _fp8_params(key, n_out, n_in):
    k1, k2 = jax.random.split(key)
    w = (jax.random.normal(k1, (n_out, n_in), jnp.float32) * 2.0).astype(jnp.float8_e4m3fn)
    scale = jax.random.randint(k2, (n_out // 32, n_in // 32), 118, 124, jnp.int32).astype(jnp.uint8)
    return {"w.weight": w, "w.scale": scale}


@pytest.mark.parametrize("rows,n_in,n_out", [(192, 5120, 1280), (192, 1280, 32768), (6, 8192, 5120),
                                             (4096, 5120, 2304)])
def test_linear_fp8_tensor_cores_match_widened(monkeypatch, rows, n_in, n_out):
    from dsflash.model import layers
    key = jax.random.PRNGKey(rows + n_in + n_out)
    params = _fp8_params(key, n_out, n_in)
    x = jax.random.normal(jax.random.fold_in(key, 1), (rows, n_in), jnp.float32).astype(jnp.bfloat16)

    def f32_out(p, x):         # the fp32 result before the bf16 output cast
        scale = p["w.scale"]
        wdt = jnp.bfloat16 if layers.tensor_cores() else jnp.float32
        w = layers.quant.dequant_fp8_weight(p["w.weight"], scale, wdt)
        xa = layers.quant.fp8_roundtrip(x, 32).astype(wdt)
        return layers._dot(xa, w.T, "reference")

    def both():
        jax.clear_caches()
        return (np.asarray(jax.jit(f32_out)(params, x)), _dot_operand_types(f32_out, params, x),
                np.asarray(jax.jit(lambda p, x: layers.linear_fp8(x, p, "w", "reference"))(params, x), np.float32))

    assert layers.tensor_cores()
    tc, tc_types, tc16 = both()
    monkeypatch.setattr(layers, "tensor_cores", lambda: False)
    wide, wide_types, wide16 = both()
    assert tc_types == {"bf16"} and wide_types == {"f32"}, (tc_types, wide_types)   # two different programs
    # the condition scale sum_k |x_k w_k| of every output element, from the exact operand values
    w = np.asarray(layers.quant.dequant_fp8_weight(params["w.weight"], params["w.scale"], jnp.float32))
    xa = np.asarray(layers.quant.fp8_roundtrip(x, 32).astype(jnp.float32))
    cond = np.abs(xa).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    rel = np.linalg.norm(tc - wide) / np.linalg.norm(wide)
    worst = float(np.max(np.abs(tc - wide) / cond))
    changed = float(np.mean(tc16 != wide16))
    print(f"rows {rows} {n_in}->{n_out}: fp32 rel err {rel:.2e}, max |d| / sum|xw| {worst:.2e}, "
          f"bf16 outputs changed {changed:.2%}")
    assert rel < 2e-5
    assert worst < 2.0 ** -16
    assert changed < 0.01


def test_head_tensor_cores_match_widened(monkeypatch):
    from dsflash.model import layers
    key = jax.random.PRNGKey(7)
    w = (jax.random.normal(key, (16384, 5120), jnp.float32) * 0.02).astype(jnp.bfloat16)
    h = jax.random.normal(jax.random.fold_in(key, 1), (32, 5120), jnp.float32).astype(jnp.bfloat16)
    jax.clear_caches()
    tc = np.asarray(jax.jit(layers.linear_f32)(h, w))
    assert _dot_operand_types(layers.linear_f32, h, w) == {"bf16"}
    monkeypatch.setattr(layers, "tensor_cores", lambda: False)
    jax.clear_caches()
    wide = np.asarray(jax.jit(layers.linear_f32)(h, w))
    assert _dot_operand_types(layers.linear_f32, h, w) == {"f32"}
    rel = np.linalg.norm(tc - wide) / np.linalg.norm(wide)
    print(f"head 32x5120->16384: rel err {rel:.2e}, argmax equal {np.mean(tc.argmax(-1) == wide.argmax(-1)):.3f}")
    assert rel < 2e-5
