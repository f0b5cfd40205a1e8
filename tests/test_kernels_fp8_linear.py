"""CPU tests of the dense FP8 linear (dsflash/kernels/fp8_linear.py, fp8_linear_triton.py).

* the reference is the model's numerics: bit-identical to ``layers.linear_fp8`` for every precision;
* the front-end runs the reference off a GPU whatever was asked, and its opt-in gate (empty ``TRITON_ROWS``) decides
  as documented when pretending to be on a GPU;
* the launch plan (block sizes, K split, grid) at V4.1's shapes;
* sm_90 compile facts (skipped without triton): no spills, wgmma in the decode and prefill kernels;
* Triton-interpreter checks (scripts/triton_interpret_fp8_linear.py), opt-in with DSFLASH_INTERPRET_TESTS=1 as in
  tests/test_kernels_interpret.py.
The GPU checks: tests/gpu/test_fp8_linear.py."""
import importlib.util
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.kernels import dispatch, fp8_linear
from dsflash.model import layers, quant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _problem(shape_x, N, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    K = shape_x[-1]
    x = (jax.random.normal(k[0], shape_x) * 3.0).astype(jnp.bfloat16)
    blk = jnp.exp2(jax.random.randint(k[2], (N // 32, K // 32), -3, 4).astype(jnp.float32))
    w, s = quant.quantize_fp8_weight(jax.random.normal(k[1], (N, K)) * 0.05 * jnp.repeat(jnp.repeat(blk, 32, 0), 32, 1))
    return x, w, s


@pytest.mark.parametrize("precision", ["reference", "bf16", "fp32"])
@pytest.mark.parametrize("act_quant", [True, False])
@pytest.mark.parametrize("shape_x,N", [((6, 256), 96), ((2, 3, 512), 64), ((40, 128), 160)])
def test_reference_is_linear_fp8_bit_for_bit(precision, act_quant, shape_x, N):
    x, w, s = _problem(shape_x, N)
    want = layers.linear_fp8(x, {"l.weight": w, "l.scale": s}, "l", precision, act_quant=act_quant)
    got = fp8_linear.fp8_linear_reference(x, w, s, precision=precision, act_quant=act_quant)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # and the same when the weight arrives as its bytes (the kernel's form)
    got8 = fp8_linear.fp8_linear_reference(x, jax.lax.bitcast_convert_type(w, jnp.uint8), s, precision=precision,
                                           act_quant=act_quant)
    np.testing.assert_array_equal(np.asarray(got8.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_reference_round_trip_matters():
    """Sanity that the bit-equality above can fail: "reference" and "bf16" differ on these inputs."""
    x, w, s = _problem((6, 256), 96)
    a = fp8_linear.fp8_linear_reference(x, w, s, precision="reference")
    b = fp8_linear.fp8_linear_reference(x, w, s, precision="bf16")
    assert np.mean(np.asarray(a) != np.asarray(b)) > 0.5


@pytest.mark.parametrize("backend", ["auto", "xla", "triton"])
@pytest.mark.parametrize("precision", ["reference", "bf16", "fp32"])
def test_front_end_on_cpu_runs_the_reference(monkeypatch, backend, precision):
    monkeypatch.setitem(sys.modules, "dsflash.kernels.fp8_linear_triton", None)    # importing it would raise
    x, w, s = _problem((6, 256), 96)
    want = jax.jit(lambda x_: fp8_linear.fp8_linear_reference(x_, w, s, precision=precision))(x)
    for force in (False, True):
        got = jax.jit(lambda x_: fp8_linear.fp8_linear(x_, w, s, precision=precision, backend=backend,
                                                       force=force))(x)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_gate_when_pretending_to_be_on_a_gpu(monkeypatch):
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "resolve_backend", lambda b, what="backend": "xla" if b == "xla" else "triton")
    ut = fp8_linear.use_triton
    assert ut("triton", 6, "reference") and ut("auto", 256, "bf16") and not ut("auto", 257, "reference")
    assert ut("triton", 6, "reference", force=True) and ut("triton", 6, "bf16", force=True)
    assert not ut("xla", 6, "reference", force=True)
    assert not ut("triton", 6, "reference", force=True, scale=None)     # float master weights
    assert ut("triton", 6, "fp32") and not ut("auto", 6, "fp32")        # explicit: the kernel raises its own error
    monkeypatch.setitem(dispatch.GATES, "fp8_linear", dispatch.GATES["fp8_linear"].replace(triton=()))
    assert not ut("triton", 6, "reference") and ut("triton", 6, "reference", force=True)
    monkeypatch.setattr(fp8_linear, "MIN_WEIGHT_ELEMENTS", 16 << 20)
    monkeypatch.setitem(dispatch.GATES, "fp8_linear", dispatch.GATES["fp8_linear"].replace(triton=((1, 384),)))
    assert ut("auto", 6, "reference", weight_shape=(32768, 1280))
    assert not ut("auto", 6, "reference", weight_shape=(512, 5120))
    assert ut("auto", 6, "reference", weight_shape=(512, 5120), force=True)


def test_linear_fp8_routes_through_the_gate(monkeypatch):
    """layers.linear_fp8 calls the kernel exactly where the gate says (pretending to be on a GPU, the kernel replaced
    by a recorder), and never with backend "xla" or float master weights."""
    import types
    from dsflash.model import layers
    calls = []
    fake = types.SimpleNamespace(fp8_linear_triton=lambda x, w, s, **kw: calls.append((x.shape, kw)) or
                                 jnp.zeros((*x.shape[:-1], w.shape[0]), jnp.bfloat16))
    monkeypatch.setitem(sys.modules, "dsflash.kernels.fp8_linear_triton", fake)
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "resolve_backend", lambda b, what="backend": "xla" if b == "xla" else "triton")
    x, w, s = _problem((2, 3, 256), 96)
    params = {"l.weight": w, "l.scale": s}
    layers.linear_fp8(x, params, "l", "reference", backend="auto")
    assert calls == [((2, 3, 256), {"precision": "reference", "act_quant": True})]
    layers.linear_fp8(x, params, "l", "bf16", act_quant=False, backend="triton")
    assert calls[-1] == ((2, 3, 256), {"precision": "bf16", "act_quant": False})
    n = len(calls)
    layers.linear_fp8(x, params, "l", "reference")                                    # default backend "xla"
    layers.linear_fp8(x, {"l.weight": w.astype(jnp.float32)}, "l", "reference", backend="auto")   # no scale
    layers.linear_fp8(jnp.zeros((400, 256), jnp.bfloat16), params, "l", "reference", backend="auto")  # > 384 rows
    layers.linear_fp8(x, params, "l", "fp32", backend="auto")                         # auto: no fp32 kernel
    assert len(calls) == n


def test_grouped_linear_routes_through_the_gate(monkeypatch):
    """layers.linear_fp8_grouped (wo_a): the kernel's grouped launch inside the gate (x flattened to [..., G K],
    act_quant False, groups G), the grouped einsum elsewhere; that einsum is the pre-existing model code."""
    import types
    from dsflash.model import layers
    calls = []
    fake = types.SimpleNamespace(fp8_linear_triton=lambda x, w, s, **kw: calls.append((x.shape, kw)) or
                                 jnp.zeros((*x.shape[:-1], w.shape[0]), jnp.bfloat16))
    x, w, s = _problem((2, 3, 4 * 64), 4 * 32)                  # K 64 per group, 4 groups of 32 outputs
    w, s = w[:, :64], s[:, :2]
    params = {"l.weight": w, "l.scale": s}
    xg = x.reshape(2, 3, 4, 64)
    want = jnp.einsum("bsgk,gok->bsgo", xg.astype(jnp.bfloat16),
                      quant.dequant_fp8_weight(w, s, jnp.bfloat16).reshape(4, 32, 64),
                      preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(layers.linear_fp8_grouped(xg, params, "l", "reference"), np.float32),
                                  np.asarray(want, np.float32))
    monkeypatch.setitem(sys.modules, "dsflash.kernels.fp8_linear_triton", fake)
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "resolve_backend", lambda b, what="backend": "xla" if b == "xla" else "triton")
    assert fp8_linear.GROUPED is True                       # on since H200 run 24
    monkeypatch.setattr(fp8_linear, "GROUPED", False)
    layers.linear_fp8_grouped(xg, params, "l", "reference", backend="auto")
    assert calls == []
    monkeypatch.setattr(fp8_linear, "GROUPED", True)
    y = layers.linear_fp8_grouped(xg, params, "l", "reference", backend="auto")
    assert y.shape == (2, 3, 4, 32)
    assert calls == [((2, 3, 256), {"precision": "reference", "act_quant": False, "groups": 4})]
    layers.linear_fp8_grouped(xg, params, "l", "reference")                                      # backend "xla"
    layers.linear_fp8_grouped(jnp.zeros((400, 4, 64), jnp.bfloat16), params, "l", "reference", backend="auto")
    assert len(calls) == 1


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_grouped_plan():
    from dsflash.kernels import fp8_linear_triton as ft
    p = ft.plan(ft.NAMED_CONFIGS["decode"], 6, 8192, 4096, groups=8)       # V4.1's wo_a
    assert (1024 // p["BN"]) * p["BN"] == 1024 and p["grid"][1] == 8192 // p["BN"]
    with pytest.raises(ValueError, match="groups"):
        ft.plan(ft.NAMED_CONFIGS["decode"], 6, 8192 + 32, 4096, groups=8)


SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
          "wo_a": (8192, 4096), "sh_w13": (2304, 5120), "sh_w2": (5120, 2304)}


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("M", [1, 6, 32, 192, 384, 4096])
@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_at_v41_shapes(name, M):
    from dsflash.kernels import fp8_linear_triton as ft
    N, K = SHAPES[name]
    cfg = ft.pick_config(M)
    p = ft.plan(cfg, M, N, K)
    BM, BN, BK, KS = p["BM"], p["BN"], p["BK"], p["KS"]
    for b in (BM, BN, BK):
        assert b & (b - 1) == 0
    assert N % BN == 0 and K % (BK * KS) == 0 and BK % 32 == 0 and BN % 32 == 0
    assert p["grid"] == (-(-M // BM), N // BN, KS)
    if M <= ft.DECODE_MAX_ROWS:
        assert cfg.swap and 16 <= BM <= 64 and (BM >= M or BM == 64)      # wgmma needs N >= 16
        steps = K // BK
        assert p["programs"] >= cfg.target_programs or KS == max(d for d in range(1, cfg.max_ks + 1) if steps % d == 0)
    else:
        assert not cfg.swap and BM == 128 and KS == 1


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_sm90_compile_decode_and_prefill():
    """sm_90 compile on this CPU host (triton's ptxas): no spills, the bf16 MMA is wgmma (not mma.sync), and the
    decode loop stays under 12 thread instructions per weight element (9.2 with triton 3.6.0, NOTES.md)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import sm90_compile_fp8_linear as sc
    for cfg, M in (("decode", 6), ("prefill", 4096)):
        _, reps = sc.reports(cfg, M, 1280, 5120)
        main = [r for r in reps if r.name.startswith("_fp8_linear_kernel")]
        assert len(main) == 1
        r = main[0]
        assert r.spill_stores == 0 and r.spill_loads == 0, (cfg, r.ptxas_log[-300:])
        assert r.features["HGMMA(sass)"] > 0 and r.features["HMMA(sass)"] == 0, (cfg, r.features)
        if cfg == "decode":
            assert r.per_elem() < 12, r.per_elem()


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.skipif(os.environ.get("DSFLASH_INTERPRET_TESTS") != "1",
                    reason="interpreter checks are opt-in: set DSFLASH_INTERPRET_TESTS=1 (slow)")
def test_interpreter_script():
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "triton_interpret_fp8_linear.py")], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(r.stdout)
    # interpret_isolation fails the run if a re-run fails or more than one check needed one; a single retry (the
    # interpreter flake, NOTES.md "Known flake": seen once here, 2026-12-01, under load) is surfaced as a warning
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    retries = [ln for ln in r.stdout.splitlines() if ln.startswith(("RETRY", "WARNING: RETRIED"))]
    if retries:
        warnings.warn("triton_interpret_fp8_linear.py: a check needed a re-run:\n" + "\n".join(retries))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("M,N,K,groups", [(6, 1280, 5120, 1), (6, 8192, 4096, 8), (384, 5120, 8192, 1)])
def test_launch_gives_every_constexpr(M, N, K, groups):
    """jax-triton does not apply a kernel's default arguments: a constexpr left out reaches Triton as None. The
    G = 1 launch relied on ``G: tl.constexpr = 1`` and failed to compile on the H200 (run 23, 2026-12-02) while the
    interpreter, which does apply defaults, passed. A fake ``jt`` records what each launch hands over."""
    from dsflash.kernels import fp8_linear_triton as ft

    class FakeJt:
        calls = []

        def triton_call(self, *args, kernel, out_shape, grid, num_warps, num_stages, **kw):
            self.calls.append((kernel, kw))
            return jnp.zeros(out_shape.shape, out_shape.dtype)

    jt = FakeJt()
    x = jnp.zeros((M, groups * K), jnp.bfloat16)
    w8, s8 = jnp.zeros((N, K), jnp.uint8), jnp.zeros((N // 32, K // 32), jnp.uint8)
    ft._launch(jt, x, w8, s8, cfg=ft.pick_config(M), act_rt_kernel=False, out_f32=False, groups=groups)
    assert jt.calls
    for kernel, kw in jt.calls:
        wanted = {p.name for p in kernel.params if p.is_constexpr}
        assert wanted <= set(kw), f"{kernel.__name__} launched without {sorted(wanted - set(kw))}"


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_named_config_finds_experimental_candidates_and_names_unknown_ones():
    from dsflash.kernels import fp8_linear_triton as ft
    from dsflash.kernels.experimental.fp8_configs import CANDIDATES
    for name, fields in CANDIDATES.items():
        cfg = ft.named_config(name)
        assert cfg == ft.Fp8LinearConfig(**fields)
        assert name not in ft.NAMED_CONFIGS            # a candidate never shadows a default
        p = ft.plan(cfg, 192, 5120, 8192)                # wo_b at 32 x 6 rows
        assert p["programs"] == p["grid"][0] * p["grid"][1] * p["grid"][2]
    assert ft.named_config("decode_bn128") is ft.NAMED_CONFIGS["decode_bn128"]
    with pytest.raises(ValueError, match="unknown FP8 linear config 'nope'"):
        ft.named_config("nope")


def _recording_jt(calls):
    """A jax-triton stand-in for the launcher: records each launch (kernel name, out_shape, grid, keywords) in
    ``calls`` and returns zeros of the declared outputs."""
    import types

    def triton_call(*args, kernel, out_shape, grid, **kw):
        calls.append(dict(kernel=kernel.fn.__name__, out_shape=out_shape, grid=grid, kw=kw))
        shapes = out_shape if isinstance(out_shape, tuple) else (out_shape,)
        outs = tuple(jnp.zeros(o.shape, o.dtype) for o in shapes)
        return outs if isinstance(out_shape, tuple) else outs[0]
    return types.SimpleNamespace(triton_call=triton_call)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_last_program_reduce_is_one_launch_with_zeroed_counters():
    """``reduce="last"``: split K in one launch (partials + per-tile arrival counters, the counters zeroed by
    jax-triton before it), against two launches for "launch"; KS 1 is the plain kernel either way."""
    from dsflash.kernels import fp8_linear_triton as ft
    calls = []
    jt = _recording_jt(calls)
    x = jnp.zeros((192, 5120), jnp.bfloat16)
    w, s = jnp.zeros((2304, 5120), jnp.uint8), jnp.zeros((72, 160), jnp.uint8)
    last = ft.Fp8LinearConfig(BN=128, reduce="last")
    pl = ft.plan(last, 192, 2304, 5120)
    assert pl["KS"] > 1
    y = ft._launch(jt, x, w, s, cfg=last, act_rt_kernel=False, out_f32=False)
    assert y.shape == (192, 2304) and y.dtype == jnp.bfloat16
    (c,) = calls
    assert c["kernel"] == "_fp8_linear_lastred_kernel" and c["kw"]["zeroed_outputs"] == (2,)
    assert c["out_shape"][1].shape == (pl["KS"], 192, 2304) and c["out_shape"][1].dtype == jnp.float32
    assert c["out_shape"][2].shape == (pl["grid"][0] * pl["grid"][1],) and c["out_shape"][2].dtype == jnp.int32
    calls.clear()
    ft._launch(jt, x, w, s, cfg=ft.Fp8LinearConfig(BN=128), act_rt_kernel=False, out_f32=False)
    assert [c["kernel"] for c in calls] == ["_fp8_linear_kernel", "_fp8_linear_reduce"]
    calls.clear()
    ft._launch(jt, x, w, s, cfg=ft.Fp8LinearConfig(BN=128, KS=1, reduce="last"), act_rt_kernel=False, out_f32=False)
    assert [c["kernel"] for c in calls] == ["_fp8_linear_kernel"]
    with pytest.raises(ValueError, match="reduce"):
        ft.Fp8LinearConfig(reduce="atomic")


# ------------------------------------------------------------------ the planes decode (session 28)
def _planes_ptx_ok(asm):
    """The planes decode's PTX emulated instruction by instruction (test_kernels_moe_layout's emulator) on every E4M3
    byte at every byte position of a word and at scales across the range it serves: lanes E = (b0, b2), O = (b1, b3)
    must be the bf16 bits of E4M3 value x 2^(s - 127), NaN codes excepted."""
    import ml_dtypes
    from test_kernels_moe_layout import _run_ptx
    rng = np.random.default_rng(5)
    byte = np.arange(256, dtype=np.uint32)
    nan = (byte & 0x7F) == 0x7F
    for pos in range(4):
        others = rng.integers(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32) & ~np.uint32(0xFF << (8 * pos))
        words = others | (byte << (8 * pos))
        for s in (0, 1, 60, 100, 118, 121, 124, 127, 130, 134):
            f = np.uint32(((s + 120) << 7) | ((s + 120) << 23))
            reg = _run_ptx(asm, {"$2": words, "$3": np.full(256, f, np.uint32)})
            out = reg["$0"] if pos in (0, 2) else reg["$1"]
            got = (out >> (16 * (pos >= 2))) & 0xFFFF
            val = byte.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** (s - 127)
            want = val.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
            if not np.array_equal(got[~nan], want[~nan]):
                return False
    return True


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_planes_ptx_decodes_every_e4m3_byte_exactly():
    from dsflash.kernels import fp8_linear_triton as ft
    assert _planes_ptx_ok(ft._PLANES_ASM.value)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_a_wrong_shift_or_mask_in_the_planes_ptx_is_caught():
    from dsflash.kernels import fp8_linear_triton as ft
    asm = ft._PLANES_ASM.value
    for old, new in (("shl.b32 u, $2, 4;", "shl.b32 u, $2, 3;"), ("shr.b32 u, $2, 4;", "shr.b32 u, $2, 5;"),
                     ("and.b32 t, $2, 0x80008000;", "and.b32 t, $2, 0x00800080;")):
        assert old in asm
        assert not _planes_ptx_ok(asm.replace(old, new)), new


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_planes_config_needs_swap_and_reaches_the_kernel():
    """``planes`` is the register operand's decode, so only swapped tiles take it (ValueError otherwise), and the
    launcher passes it as the kernel's EO constexpr (0 for every other config, whose code it leaves as it was)."""
    from dsflash.kernels import fp8_linear_triton as ft
    with pytest.raises(ValueError, match="planes needs swap=True"):
        ft.Fp8LinearConfig(planes=True, swap=False)
    calls = []
    jt = _recording_jt(calls)
    x = jnp.zeros((192, 5120), jnp.bfloat16)
    w, s = jnp.zeros((1280, 5120), jnp.uint8), jnp.zeros((40, 160), jnp.uint8)
    for name, eo in (("dec_bn128_planes", 1), ("decode_bn128", 0)):
        calls.clear()
        ft._launch(jt, x, w, s, cfg=ft.named_config(name), act_rt_kernel=False, out_f32=False)
        assert (calls[0]["kernel"], calls[0]["kw"].get("EO")) == ("_fp8_linear_kernel", eo), (name, calls)
