"""The dense FP8 linear kernel (dsflash/kernels/fp8_linear_triton.py) against the model's XLA path at V4.1's real
shapes on the GPU. NOT YET RUN (written 2026-12-01 on a CPU host; the kernel was checked in Triton's interpreter and
compiled for sm_90 there, see dsflash/kernels/NOTES.md "FP8 dense linears").

Both sides multiply the same bf16-exact values (dequantised E4M3 x 2^k weights, FP8-round-tripped activations) and
sum in fp32, so only the fp32 accumulation order differs. Elementwise bound on the fp32 result (as
tests/gpu/test_tensor_core_linears.py): |d| <= 2^-16 * sum_k |x_k w_k| (the worst case is 2 (K - 1) 2^-24 sum|x w|;
2^-16 leaves a wide margin over the typical sqrt(K) 2^-24 and still catches a lost round trip, bf16 accumulation,
TF32 or a wrong scale, each >= 1e-3 relative); bf16 outputs changed in < 1 % of the elements. The kernel's bf16
output must be the round-to-nearest-even of its own fp32 result, bit for bit.
Poisoning: each jitted function runs first on an all-NaN x (the reference gives NaN everywhere; so must the kernel,
which also leaves NaN in the buffers XLA's allocator usually hands back), then on the real x: every element must then
be finite (no tile or split-K partial left unwritten; best effort, it relies on buffer reuse).
Fresh random inputs per case (seeded by the case), E4M3 weight bytes over the whole finite range, scales 2^-9..2^-4.
Run: JAX_PLATFORMS=cuda python -m pytest -q tests/gpu/test_fp8_linear.py"""
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
          "wo_a": (8192, 4096), "sh_w13": (2304, 5120), "sh_w2": (5120, 2304)}
ROWS = (1, 6, 32, 192, 384, 4096)


def _inputs(name, M, seed=0):
    N, K = SHAPES[name]
    key = jax.random.PRNGKey(zlib.crc32(f"{name}/{M}/{seed}".encode()))
    k1, k2, k3 = jax.random.split(key, 3)
    b = jax.random.randint(k1, (N, K), 0, 254, jnp.int32)
    b = jnp.where(b >= 127, b + 1, b).astype(jnp.uint8)             # every byte but the NaNs 0x7F / 0xFF
    w = jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)
    s = jax.random.randint(k2, (N // 32, K // 32), 118, 124, jnp.int32).astype(jnp.uint8)
    x = (jax.random.normal(k3, (M, K), jnp.float32) * 2.0).astype(jnp.bfloat16)
    return x, w, s


def _f32_reference(x, w, s, precision):
    """The XLA path's fp32 result before its bf16 output cast (layers.linear_fp8 on the GPU), and sum |x w|."""
    from dsflash.model import layers, quant
    wd = quant.dequant_fp8_weight(w, s, jnp.bfloat16)
    xa = quant.fp8_roundtrip(x, 32) if precision == "reference" else x
    y = layers._dot(xa, wd.T, precision)
    cond = jnp.einsum("mk,nk->mn", jnp.abs(xa.astype(jnp.float32)), jnp.abs(wd.astype(jnp.float32)),
                      precision=jax.lax.Precision.HIGHEST)
    return y, cond


def _poisoned(fn, x, *rest):
    """fn(NaN x) must be NaN everywhere (as the reference), then fn(x) is returned as numpy."""
    bad = np.asarray(fn(jnp.full_like(x, jnp.nan), *rest), np.float32)
    assert np.all(np.isnan(bad)), f"NaN x: {int(np.sum(~np.isnan(bad)))} non-NaN outputs"
    del bad
    return np.asarray(fn(x, *rest), np.float32)


def _check(name, M, precision="reference", config=None, tweak=None):
    from dsflash.kernels import fp8_linear as fl, fp8_linear_triton as ft
    x, w, s = _inputs(name, M)
    if tweak is not None:
        x, w, s = tweak(x, w, s)
    k32 = jax.jit(lambda a, w_, s_: ft.fp8_linear_triton(a, w_, s_, precision=precision, config=config,
                                                          out_f32=True))
    k16 = jax.jit(lambda a, w_, s_: ft.fp8_linear_triton(a, w_, s_, precision=precision, config=config))
    y32 = _poisoned(k32, x, w, s)
    y16 = _poisoned(k16, x, w, s)
    assert np.all(np.isfinite(y32)) and np.all(np.isfinite(y16)), "unwritten (NaN) outputs after the poison run"
    ref32, cond = jax.jit(lambda a: _f32_reference(a, w, s, precision))(x)
    ref32, cond = np.asarray(ref32), np.asarray(cond, np.float64)
    ref16 = np.asarray(jax.jit(lambda a: fl.fp8_linear_reference(a, w, s, precision=precision))(x), np.float32)
    worst = float(np.max(np.abs(y32 - ref32) / np.maximum(cond, 1e-30)))
    changed = float(np.mean(y16 != ref16))
    own = bool(np.array_equal(y16, np.asarray(jnp.asarray(y32).astype(jnp.bfloat16).astype(jnp.float32))))
    rel = float(np.linalg.norm(y32 - ref32) / np.linalg.norm(ref32))
    pl = ft.plan(ft.named_config(config) if isinstance(config, str) else (config or ft.pick_config(M)),
                 M, *SHAPES[name])
    print(f"{name} M={M} {precision} {config or 'picked'} {pl}: fp32 rel {rel:.2e}, max |d|/sum|xw| {worst:.2e}, "
          f"bf16 changed {changed:.3%}, bf16 == RNE(own fp32) {own}")
    assert worst <= 2.0 ** -16
    assert changed < 0.01
    assert own


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_matches_xla_path_reference_precision(name, M):
    _check(name, M)


@pytest.mark.parametrize("M", (6, 192))
@pytest.mark.parametrize("name", ["wq_a", "wo_b"])
def test_kernel_matches_xla_path_bf16_precision(name, M):
    _check(name, M, precision="bf16")


@pytest.mark.parametrize("config", ["decode_krt", "decode_xrt", "decode_bn128", "prefill"])
@pytest.mark.parametrize("M", (6, 192))
def test_named_configs(config, M):
    _check("wq_a", M, config=config)


@pytest.mark.parametrize("M", (6, 192))
@pytest.mark.parametrize("name", ["wq_a", "wkv", "wo_b", "sh_w13", "sh_w2"])
def test_last_program_reduce_is_bit_identical_to_the_reduce_launch(name, M):
    """``reduce="last"`` (session 27): the split-K partials summed by each tile's last program to arrive, on the GPU
    where the programs of a tile race. Same partials, same order as ``_fp8_linear_reduce``, so fp32 and bf16 outputs
    must be bit-identical to the two-launch path -- on three calls of one compiled program (the arrival counters
    must start from zero every call) and after a NaN call (no output left unwritten)."""
    from dsflash.kernels import fp8_linear_triton as ft
    x, w, s = _inputs(name, M, seed=3)
    launch = ft.named_config("decode_bn128")
    last = ft.named_config("dec_bn128_lastred")
    assert ft.plan(last, M, *SHAPES[name])["KS"] > 1
    for f32 in (True, False):
        ref = np.asarray(jax.jit(lambda a, f32=f32: ft.fp8_linear_triton(a, w, s, config=launch, out_f32=f32))(x),
                         np.float32)
        fn = jax.jit(lambda a, f32=f32: ft.fp8_linear_triton(a, w, s, config=last, out_f32=f32))
        _poisoned(fn, x)
        for call in range(3):
            got = np.asarray(fn(x), np.float32)
            assert np.array_equal(got, ref), (f"{name} M={M} out_f32={f32} call {call}: "
                                              f"{int(np.sum(got != ref))} elements differ")


@pytest.mark.parametrize("M", (6, 192))
@pytest.mark.parametrize("name", list(SHAPES))
def test_planes_decode_matches_the_xla_path(name, M):
    """``Fp8LinearConfig.planes`` (candidate ``dec_bn128_planes``, session 28): E4M3 bytes decoded by bit placement
    into even / odd K planes and multiplied by 2^(s - 7) in bf16 (inline PTX ``mul.rn.bf16x2``, E4M3 subnormals as
    bf16 subnormals), two dots a K step: the same products as the XLA path, summed in another fp32 order."""
    _check(name, M, config="dec_bn128_planes")


@pytest.mark.parametrize("M", (6, 192))
def test_planes_decode_falls_back_where_a_scale_is_too_large(M):
    """A scale byte above ``PLANES_MAX_SCALE`` (2^(s - 7) is no bf16 there): that K chunk takes the per-element
    decode, so the result still matches the XLA path."""
    from dsflash.kernels import fp8_linear_triton as ft
    _check("wq_a", M, config="dec_bn128_planes", tweak=lambda x, w, s: (x, w, s.at[3, 5].set(ft.PLANES_MAX_SCALE + 6)))


def test_nan_weight_propagates():
    """A NaN weight byte (E4M3 0x7F) gives NaN in its output column, as the reference (Triton's interpreter maps 0x7F
    to 480, so this is checked only here)."""
    from dsflash.kernels import fp8_linear as fl, fp8_linear_triton as ft
    x, w, s = _inputs("wq_a", 6)
    b = jax.lax.bitcast_convert_type(w, jnp.uint8).at[77, 1000].set(0x7F)
    w = jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn)
    got = np.asarray(jax.jit(lambda a: ft.fp8_linear_triton(a, w, s, out_f32=True))(x))
    ref = np.asarray(jax.jit(lambda a: fl.fp8_linear_reference(a, w, s))(x), np.float32)
    assert np.isnan(ref[:, 77]).all() and np.array_equal(np.isnan(got), np.isnan(ref))


def test_front_end_gate_on_gpu(monkeypatch):
    """On a GPU: outside the gate's rows backend="triton" still runs the reference (bit-identical to it), inside it
    and with force=True the kernel (bit-identical to calling it directly)."""
    from dsflash.kernels import dispatch, fp8_linear as fl, fp8_linear_triton as ft
    x, w, s = _inputs("wkv", 6)
    inside = np.asarray(jax.jit(lambda a: fl.fp8_linear(a, w, s, backend="auto"))(x), np.float32)
    monkeypatch.setitem(dispatch.GATES, "fp8_linear", dispatch.GATES["fp8_linear"].replace(triton=()))
    gated = np.asarray(jax.jit(lambda a: fl.fp8_linear(a, w, s, backend="triton"))(x), np.float32)
    monkeypatch.undo()
    ref = np.asarray(jax.jit(lambda a: fl.fp8_linear_reference(a, w, s))(x), np.float32)
    kern = np.asarray(jax.jit(lambda a: ft.fp8_linear_triton(a, w, s))(x), np.float32)
    forced = np.asarray(jax.jit(lambda a: fl.fp8_linear(a, w, s, backend="triton", force=True))(x), np.float32)
    assert np.array_equal(gated, ref)
    assert np.array_equal(forced, kern) and np.array_equal(inside, kern)


@pytest.mark.parametrize("precision", ["reference", "bf16"])
@pytest.mark.parametrize("name,M", [("wq_a", 6), ("wo_b", 192), ("sh_w2", 4096)])
def test_reference_is_linear_fp8_on_gpu(name, M, precision):
    """fp8_linear_reference is a written-out copy of layers.linear_fp8 (kernels/ does not import model/layers): on
    the GPU too (its tensor-core branch) the two must give the same bits."""
    from dsflash.kernels import fp8_linear as fl
    from dsflash.model import layers
    x, w, s = _inputs(name, M)
    want = np.asarray(jax.jit(lambda a: layers.linear_fp8(a, {"l.weight": w, "l.scale": s}, "l", precision))(x),
                      np.float32)
    got = np.asarray(jax.jit(lambda a: fl.fp8_linear_reference(a, w, s, precision=precision))(x), np.float32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("precision", ["reference", "bf16"])
@pytest.mark.parametrize("M", (1, 6, 192, 384))
def test_grouped_wo_a_matches_the_model(M, precision):
    """The grouped launch at V4.1's wo_a (8 groups of [1024, 4096], no activation round trip) against the model's
    grouped einsum (layers.linear_fp8_grouped on XLA): the same bounds as _check, per group."""
    from dsflash.kernels import fp8_linear_triton as ft
    from dsflash.model import layers, quant
    G = 8
    _, w, s = _inputs("wo_a", M)
    x = (jax.random.normal(jax.random.PRNGKey(M), (M, G, 4096), jnp.float32) * 2.0).astype(jnp.bfloat16)
    params = {"l.weight": w, "l.scale": s}
    k32 = jax.jit(lambda a: ft.fp8_linear_triton(a.reshape(M, -1), w, s, precision=precision, act_quant=False,
                                                 out_f32=True, groups=G))
    k16 = jax.jit(lambda a: ft.fp8_linear_triton(a.reshape(M, -1), w, s, precision=precision, act_quant=False,
                                                 groups=G))
    y32, y16 = np.asarray(k32(x)).reshape(M, G, -1), np.asarray(k16(x), np.float32).reshape(M, G, -1)
    ref16 = np.asarray(jax.jit(lambda a: layers.linear_fp8_grouped(a, params, "l", precision))(x), np.float32)
    wd = quant.dequant_fp8_weight(w, s, jnp.float32).reshape(G, 1024, 4096)
    xf = x.astype(jnp.float32)
    ref32 = np.asarray(jnp.einsum("mgk,gok->mgo", xf, wd, precision=jax.lax.Precision.HIGHEST))
    cond = np.asarray(jnp.einsum("mgk,gok->mgo", jnp.abs(xf), jnp.abs(wd), precision=jax.lax.Precision.HIGHEST),
                      np.float64)
    worst = float(np.max(np.abs(y32 - ref32) / np.maximum(cond, 1e-30)))
    changed = float(np.mean(y16 != ref16))
    own = bool(np.array_equal(y16, np.asarray(jnp.asarray(y32).astype(jnp.bfloat16).astype(jnp.float32))))
    print(f"wo_a grouped M={M} {precision}: max |d|/sum|xw| {worst:.2e}, bf16 changed vs model {changed:.3%}, "
          f"bf16 == RNE(own fp32) {own}")
    assert worst <= 2.0 ** -16 and changed < 0.01 and own
