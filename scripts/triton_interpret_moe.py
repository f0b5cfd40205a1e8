"""CPU check of the Triton MoE kernels' logic in Triton's interpreter (TRITON_INTERPRET=1), no GPU needed.

Runs the two @triton.jit kernels on numpy buffers (through a minimal tensor shim) at a tiny shape and compares
with ``routed_moe_reference``. The inline-PTX nibble decoder cannot run here, so DECODE="tl" is used.
The split-K decode kernels (kind "sk") go through the real launcher (``_launch``) via a jax_triton stand-in and
are also compared on h (values after the FP8 round trip) against the reference. Each check runs in its own process.
Usage: python scripts/triton_interpret_moe.py [--list | --check NAME | --only PREFIX]   (needs `pip install triton`; a
failed check is re-run once in a fresh process: ``interpret_isolation``; ``--only il`` runs the checks named il-*,
``--only tm`` the tile-major ones: tm-*)"""
import functools
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dsflash.kernels import moe_gemm, moe_gemm_triton as mt  # noqa: E402
from dsflash.kernels.experimental import moe_families  # noqa: E402  (kind "fp8mma" kernels)
from dsflash import quant  # noqa: E402


class _Storage:
    def __init__(self, t):
        self.t = t

    def data_ptr(self):
        return self.t.a.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):
        return self


class Fake:
    """Just enough of a torch tensor for triton's interpreter: the memory is the numpy array's own."""

    def __init__(self, a, ptr=None):
        self.a = np.ascontiguousarray(a)
        self.dtype = _Dt(self.a.dtype)
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr if self._ptr is not None else self.a.ctypes.data

    def untyped_storage(self):
        return _Storage(self)

    def storage_offset(self):
        return 0

    def size(self):
        return self.a.shape

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def new_empty(self, *_, **__):
        return Fake(np.zeros(0, self.a.dtype))

    def set_(self, storage, offset, size, stride):
        self._ptr = storage.data_ptr() + offset * storage.t.a.itemsize
        self.a = storage.t.a
        self.dtype = storage.t.dtype
        return self

    def copy_(self, other):
        return self


class _Dt:
    def __init__(self, dt):
        self.name = {"float8_e4m3fn": "float8_e4m3fn"}.get(str(dt), str(dt))
        self.itemsize = dt.itemsize

    def __str__(self):
        return self.name

    __repr__ = __str__


def main(precision="reference", T=5, k=2, E=4, d=256, I=128, BM=16, seed=0):
    x, idx, weight, w1, s1, w3, s3, w2, s2 = _problem(T, k, E, d, I, seed)
    limit = 10.0
    ref = moe_gemm.routed_moe_reference(x, idx, weight, w1, s1, w3, s3, w2, s2, limit=limit, precision=precision)
    act_fp8 = precision == "reference"
    cfg = mt.MoeConfig(BM=BM, BN_UP=64, BN_DOWN=64, KSUB=2, decode="tl")
    S = T * k
    p = {kk: np.asarray(v) for kk, v in mt.prepare(x, idx, weight, E=E, BM=BM, act_fp8=act_fp8).items()}
    TM = mt.num_tiles(S, E, BM)
    u8 = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
    hq = np.zeros((S, I), np.asarray(p["xq"]).dtype)
    hs = np.zeros((S, I // 32), np.float32)
    F = Fake
    fhq, fhs = F(hq), F(hs)
    moe_families._moe_up_kernel[(TM, I // cfg.BN_UP)](
        F(p["xq"]), F(p["xs"]), F(p["tok"]), F(p["rw"]), F(p["tile_e"]), F(p["tile_s"]), F(p["tile_end"]),
        F(u8(w1)), F(np.asarray(s1)), F(u8(w3)), F(np.asarray(s3)), fhq, fhs,
        D=d, I=I, LIMIT=limit, BM=BM, BN=cfg.BN_UP, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8), DECODE=0)
    o = np.zeros((S, d), jnp.bfloat16)
    fo = F(o)
    moe_families._moe_down_kernel[(TM, d // cfg.BN_DOWN)](
        fhq, fhs, F(p["order"]), F(p["tile_e"]), F(p["tile_s"]), F(p["tile_end"]),
        F(u8(w2)), F(np.asarray(s2)), fo,
        D=d, I=I, BM=BM, BN=cfg.BN_DOWN, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8), DECODE=0)
    out = fo.a.astype(np.float32).reshape(T, k, d).sum(1)
    ref = np.asarray(ref)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"{precision}: rel err {rel:.3e}, max abs {np.abs(out - ref).max():.3e}, ref norm {np.linalg.norm(ref):.3e}")
    return rel


class _JtShim:
    """Stand-in for jax_triton.triton_call: numpy outputs, the kernel run by the interpreter on Fake tensors, so
    the real launch code (``mt._launch`` / ``mt._launch_sk``) is what gets checked."""

    @staticmethod
    def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=1, **kw):
        multi = isinstance(out_shape, (tuple, list))
        shapes = out_shape if multi else (out_shape,)
        kw.pop("zeroed_outputs", None)          # every output starts zeroed here
        outs = [np.zeros(o.shape, o.dtype) for o in shapes]
        fakes = [Fake(o) for o in outs]
        # private host copies (np.array copies): zero-copy views of short-lived jax buffers can alias
        ins = [Fake(np.array(jax.lax.bitcast_convert_type(a, jnp.uint8)) if getattr(a, "dtype", None) == jnp.int8
                    else np.array(a)) for a in args]
        kernel[tuple(grid)](*ins, *fakes, **kw)
        res = [f.a for f in fakes]
        return tuple(res) if multi else res[0]


def _problem(T, k, E, d, I, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    x = jax.random.normal(keys[0], (T, d), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(keys[1], (T, k), 0, E, jnp.int32)
    weight = jax.random.uniform(keys[2], (T, k), jnp.float32)

    def wq(key, shape):
        return quant.quantize_mxfp4_weight(jax.random.normal(key, shape, jnp.float32) * 0.05)
    w1, s1 = wq(keys[3], (E, I, d))
    w3, s3 = wq(keys[4], (E, I, d))
    w2, s2 = wq(keys[5], (E, d, I))
    return x, idx, weight, w1, s1, w3, s3, w2, s2


def _ref_h(x, idx, weight, w1, s1, w3, s3, order, limit):
    """Reference h after its bf16 rounding and FP8 round trip, in sorted-slot order (fp32 HIGHEST)."""
    k = idx.shape[1]
    xa = quant.fp8_roundtrip(x.astype(jnp.bfloat16), 32).astype(jnp.float32)
    fe = idx.reshape(-1)[order]
    xs = xa[order // k]
    hp = jax.lax.Precision.HIGHEST
    bf = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)    # noqa: E731  (GEMM outputs are bf16, SPEC §12)
    g = jnp.minimum(bf(jnp.einsum("sd,sid->si", xs, quant.dequant_mxfp4_weight(w1, s1)[fe], precision=hp)), limit)
    u = jnp.clip(bf(jnp.einsum("sd,sid->si", xs, quant.dequant_mxfp4_weight(w3, s3)[fe], precision=hp)),
                 -limit, limit)
    h = (jax.nn.silu(g) * u * weight.reshape(-1)[order][:, None]).astype(jnp.bfloat16)
    return np.asarray(quant.fp8_roundtrip(h, 32).astype(jnp.float32))


def check_launch(cfg, precision="reference", T=5, k=2, E=4, d=256, I=128, seed=0, limit=10.0):
    """Any config through the real launcher (decode forced to "tl"): rel err of the output vs the eager
    reference, and (reference precision) the fraction of h values equal to the reference's round-tripped h."""
    import dataclasses
    sys.modules["jax_triton"] = _JtShim
    cfg = dataclasses.replace(cfg, decode="tl")
    args = _problem(T, k, E, d, I, seed)
    x, idx, weight, w1, s1, w3, s3, w2, s2 = args
    ref = np.asarray(moe_gemm.routed_moe_reference(*args, limit=limit, precision=precision))
    act_fp8 = precision == "reference"
    mt._check_shapes(x, idx, w1, s1, w3, s3, w2, s2, cfg)
    p = {kk: np.array(v) for kk, v in mt.prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=act_fp8).items()}
    u8 = mt._as_u8
    o, hq, hs = mt._launch(p, u8(w1), s1, u8(w3), s3, u8(w2), s2, T=T, k=k, d=d, I=I, E=E, limit=limit,
                           act_fp8=act_fp8, cfg=cfg)
    out = np.asarray(o).astype(np.float32).reshape(T, k, d).sum(1)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    same = float("nan")
    if act_fp8:
        rh = _ref_h(x, idx, weight, w1, s1, w3, s3, p["order"], limit)
        hv = np.asarray(hq).astype(np.float32)
        if str(np.asarray(hq).dtype).startswith("float8"):       # codes + f32 pow2 scales
            hv = (hv.reshape(hv.shape[0], -1, 32) * np.asarray(hs)[:, :, None]).reshape(hv.shape)
        same = float(np.mean(hv == rh))
    plan = mt.sk_plan(cfg, T * k, E, d, I, act_fp8) if cfg.kind == "sk" else {}
    print(f"{cfg.kind}/{cfg.mma if cfg.kind == 'sk' else cfg.decode} BK={cfg.BK} KSUB={cfg.KSUB} {plan} "
          f"T={T} k={k} E={E} d={d} I={I} {precision}: rel err {rel:.3e}, h equal {same:.5f}")
    return rel, same


def check_crafted(cfg, precision="reference", T=6, E=4, D=128, seed=1):
    """Issue 18's element-level problem (tests/test_kernels_moe_swiglu_rounding.py: exact GEMM sums that are mostly not
    bf16 values, SiLU(g) == g, W2 the identity) through the real launcher: every output element must equal numpy's
    with x W1^T and x W3^T rounded to bf16 before the SwiGLU. Returns the number of differing elements."""
    import dataclasses
    import importlib.util
    sys.modules["jax_triton"] = _JtShim
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "test_kernels_moe_swiglu_rounding.py")
    spec = importlib.util.spec_from_file_location("_moe_swiglu_crafted", path)
    cm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cm)
    cfg = dataclasses.replace(cfg, decode="tl")
    x, idx, weight, W1, W3, W2 = cm._problem(seed, T=T, E=E, D=D)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(weight), *cm._mx(W1), *cm._mx(W3),
            *cm._mx(W2))
    xj, idxj, wj, w1, s1, w3, s3, w2, s2 = args
    want = cm._expected(x, idx, weight, W1, W3, precision)
    act_fp8 = precision == "reference"
    k = idx.shape[1]
    mt._check_shapes(xj, idxj, w1, s1, w3, s3, w2, s2, cfg)
    p = {kk: np.array(v) for kk, v in mt.prepare(xj, idxj, wj, E=E, BM=cfg.BM, act_fp8=act_fp8).items()}
    u8 = mt._as_u8
    o, _, _ = mt._launch(p, u8(w1), s1, u8(w3), s3, u8(w2), s2, T=T, k=k, d=D, I=D, E=E, limit=cm.LIMIT,
                         act_fp8=act_fp8, cfg=cfg)
    out = np.asarray(o).astype(np.float32).reshape(T, k, D).sum(1)
    bad = int(np.sum(out != want))
    print(f"crafted {cfg.kind}/{cfg.mma} BM={cfg.BM} T={T} E={E} D=I={D} {precision}: {bad} of {out.size} elements "
          f"differ from numpy")
    return bad


def _crafted_cases():
    """The default families pick_config returns (fitted to D = I = 128), both precisions where they exist."""
    from dsflash.kernels.moe_plan import named_configs
    nc = named_configs()
    f = lambda name: mt.fit_config(nc[name], 128, 128)      # noqa: E731
    return [(f("sw_eo_np_bm8"), dict()), (f("sw_eo_np"), dict()), (f("sw_eo_prefill_w8"), dict(T=40)),
            (f("sw_eo_np"), dict(precision="bf16")), (f("sw_eo_prefill_w8"), dict(T=40, precision="bf16")),
            (f("sw_ps_bm8"), dict()), (f("sk_gemv"), dict(T=1))]


def _crafted(j):
    cfg, kw = _crafted_cases()[j]
    assert check_crafted(cfg, **kw) == 0


def _sk_cases():
    """The split-K decode kernels (kind "sk"), with and without splitting, both MMA flavours; then the fp8mma
    kernel through the same launcher for comparison."""
    MC = mt.MoeConfig
    return [
        (MC(kind="sk", mma="bf16", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2), {}),
        (MC(kind="sk", mma="bf16", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=1, KS_DOWN=1), {}),
        (MC(kind="sk", mma="bf16", BM=16, BN_UP=32, BN_DOWN=128, BK=128, KS_UP=2, KS_DOWN=1), dict(seed=3)),
        (MC(kind="sk", mma="bf16", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=2, KS_DOWN=2),
         dict(T=40, k=3, E=3, seed=1)),
        (MC(kind="sk", mma="fp8", BM=16, BN_UP=64, BN_DOWN=64, KSUB=2, KS_UP=4, KS_DOWN=2), {}),
        (MC(kind="sk", mma="fp8", BM=16, BN_UP=64, BN_DOWN=64, KSUB=2, KS_UP=1, KS_DOWN=1), dict(T=40, k=3, E=3)),
        (MC(kind="sk", mma="bf16", BM=16, BN_UP=64, BN_DOWN=64, BK=64), dict(T=1, k=2, E=8)),   # auto KS
        (MC(kind="sk", mma="bf16", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2), dict(precision="bf16")),
        (MC(kind="sk", mma="gemv", BM=1, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2), {}),
        (MC(kind="sk", mma="gemv", BM=1, BN_UP=32, BN_DOWN=64, BK=128, KS_UP=1, KS_DOWN=1), dict(T=40, k=3, E=3)),
        (MC(kind="sk", mma="gemv", BM=1, BN_UP=64, BN_DOWN=32, BK=64), dict(T=1, k=2, E=8)),   # auto KS
        (MC(kind="sk", mma="gemv", BM=1, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=2, KS_DOWN=2), dict(precision="bf16")),
        (MC(BM=16, BN_UP=64, BN_DOWN=64, KSUB=2), {}),
        # the default decode configs fitted to the tiny preset's d = 256, I = 64 (fit_config)
        (mt.fit_config(mt.DECODE_CONFIG, 256, 64), dict(I=64)),
        (mt.fit_config(mt.pick_config(1, 8, False), 256, 64), dict(I=64, precision="bf16", T=3, E=8)),
    ]


def _sw_cases():
    """The swapped-operand kernels (mma "swap" / "swap_eo"): split and unsplit, hand prefetch or not, decode and
    prefill-sized tiles, both precisions."""
    MC = mt.MoeConfig
    return [
        (MC(kind="sk", mma="swap", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2), {}),
        (MC(kind="sk", mma="swap_eo", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2), {}),
        (MC(kind="sk", mma="swap_eo", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=1, KS_DOWN=1),
         dict(T=40, k=3, E=3, seed=1)),
        (MC(kind="sk", mma="swap_eo", BM=16, BN_UP=64, BN_DOWN=64, BK=64, prefetch=False), dict(T=1, k=2, E=8)),
        (MC(kind="sk", mma="swap_eo", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=2, KS_DOWN=2),
         dict(precision="bf16")),
        (MC(kind="sk", mma="swap_eo", BM=64, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=1, KS_DOWN=1, prefetch=False),
         dict(T=40, k=3, E=3, seed=2)),
        (MC(kind="sk", mma="swap", BM=16, BN_UP=32, BN_DOWN=128, BK=128, KS_UP=2, KS_DOWN=1, prefetch=False),
         dict(seed=3)),
        # "swap_bd": bf16 bits built directly (DECODE="tl" twin of the inline-PTX decoder)
        (MC(kind="sk", mma="swap_bd", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2, prefetch=False), {}),
        (MC(kind="sk", mma="swap_bd", BM=64, BN_UP=64, BN_DOWN=64, BK=128, KS_UP=1, KS_DOWN=1, prefetch=False),
         dict(T=40, k=3, E=3, seed=4)),
        (MC(kind="sk", mma="swap_bd", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=2, KS_DOWN=1),
         dict(precision="bf16", seed=5)),
    ]


def _ps_cases():
    """mma "swap_ps" (2026-12-01): scales applied after per-32-group fp16 MMAs of the raw codes; split and unsplit,
    one and several K groups per iteration, decode and prefill-sized tiles, the named configs fitted to the shape."""
    MC = mt.MoeConfig
    from dsflash.kernels.moe_plan import named_configs
    nc = named_configs()
    return [
        (MC(kind="sk", mma="swap_ps", BM=16, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2, prefetch=False), {}),
        (MC(kind="sk", mma="swap_ps", BM=16, BN_UP=64, BN_DOWN=64, BK=128, KS_UP=1, KS_DOWN=1, prefetch=False),
         dict(T=40, k=3, E=3, seed=1)),
        (MC(kind="sk", mma="swap_ps", BM=16, BN_UP=64, BN_DOWN=64, BK=32, prefetch=False), dict(T=1, k=2, E=8)),
        (MC(kind="sk", mma="swap_ps", BM=64, BN_UP=64, BN_DOWN=128, BK=64, KS_UP=1, KS_DOWN=1, prefetch=False),
         dict(T=40, k=3, E=3, seed=2)),
        (mt.fit_config(nc["sw_ps"], 256, 128), dict(T=3, E=8, seed=3)),
        (mt.fit_config(nc["sw_ps_bn128"], 256, 128), dict(T=6, E=4, seed=4)),
        (mt.fit_config(nc["sw_ps_bn128_bk64"], 256, 128), dict(T=1, k=2, E=8, seed=5)),
        (mt.fit_config(nc["sw_ps_bk64"], 256, 128), dict(T=40, k=3, E=3, seed=6)),
        # BM 8 (mma.sync on sm_90, natural K order: PERM 0)
        (MC(kind="sk", mma="swap_ps", BM=8, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=4, KS_DOWN=2, prefetch=False),
         dict(T=1, k=2, E=8, seed=7)),
        (MC(kind="sk", mma="swap_ps", BM=8, BN_UP=64, BN_DOWN=64, BK=64, KS_UP=1, KS_DOWN=1, prefetch=False),
         dict(T=40, k=3, E=3, seed=8)),
        (mt.fit_config(nc["sw_ps_bm8_w2"], 256, 128), dict(T=5, seed=9)),
        (mt.fit_config(nc["sw_eo_np_bm8"], 256, 128), dict(T=40, k=3, E=3, seed=10)),
        (mt.fit_config(nc["sw_ps_bm8_ks1"], 256, 128), dict(T=1, k=6, E=8, seed=12)),
        (mt.fit_config(nc["sw_eo_np_bm32"], 256, 128), dict(T=40, k=3, E=3, seed=13)),    # BM 32: 40 slots/expert
    ]


def _ps(j):
    cfg, kw = _ps_cases()[j]
    rel, same = check_launch(cfg, **kw)
    assert rel < 1e-2, rel
    assert same >= 0.999, same


def _sw(j):
    cfg, kw = _sw_cases()[j]
    rel, same = check_launch(cfg, **kw)
    assert rel < 1e-2, rel
    assert kw.get("precision", "reference") != "reference" or same >= 0.999, same


def _legacy(j):
    r = {0: lambda: main("reference"), 1: lambda: main("bf16"),
         2: lambda: main("reference", T=40, k=3, E=3, BM=16, seed=1)}[j]()
    assert r < 1e-2, r


def _sk(j):
    cfg, kw = _sk_cases()[j]
    rel, same = check_launch(cfg, **kw)
    assert rel < 1e-2, rel
    assert kw.get("precision", "reference") != "reference" or same >= 0.999, same


def _il_cases():
    """mma "swap_il" (weights in the load-time il layout, kernels/moe_layout.py) against "swap_eo" with the same
    tiles and splits: split and unsplit, auto split at 1 token, ragged and multi-tile expert loads, BM 32, both
    precisions, x dequantised before the up kernel (act "bf16rt"); the last case plants a wrong nibble order in the repack (it must fail)."""
    MC = mt.MoeConfig
    from dsflash.kernels.moe_plan import named_configs
    base = dict(kind="sk", BM=16, BN_UP=64, BN_DOWN=64, BK=128, stages=4, prefetch=False)
    return [
        (MC(**base, KS_UP=2, KS_DOWN=1), dict(T=5, k=2, E=4)),
        (MC(**base, KS_UP=1, KS_DOWN=1), dict(T=40, k=3, E=3, seed=1)),              # 40 slots per expert
        (MC(**base), dict(T=1, k=2, E=8, seed=2)),                                       # auto split at 1 token
        (MC(**base, KS_UP=2, KS_DOWN=1), dict(T=6, k=2, E=4, seed=3, precision="bf16")),
        (MC(**{**base, "BM": 32}, KS_UP=1, KS_DOWN=1), dict(T=40, k=3, E=3, seed=4)),
        (mt.fit_config(named_configs()["sw_il"], 256, 128), dict(T=7, k=6, E=8, seed=5)),   # the named config
        # x dequantised once before the up kernel (act "bf16rt"; 40 tokens: the dequant's last row block is ragged)
        (MC(**{**base, "BM": 32}, KS_UP=1, KS_DOWN=1, act="bf16rt"), dict(T=40, k=3, E=3, seed=7)),
        (MC(**base, KS_UP=2, KS_DOWN=1, act="bf16rt"), dict(T=5, k=2, E=4, seed=8)),
        # gate and up rows in separate programs (split_gate_up): unsplit and split K, multi-tile, BM 32, named
        (MC(**base, KS_UP=1, KS_DOWN=1, split_gate_up=True), dict(T=40, k=3, E=3, seed=9)),
        (MC(**base, KS_UP=2, KS_DOWN=1, split_gate_up=True), dict(T=5, k=2, E=4, seed=10)),
        (mt.fit_config(named_configs()["sw_il_bm32_gu"], 256, 128), dict(T=40, k=3, E=3, seed=11)),
        (mt.fit_config(named_configs()["sw_il_gu_xb"], 256, 128), dict(T=40, k=3, E=3, seed=13)),
        (MC(**base, KS_UP=1, KS_DOWN=1), dict(T=5, k=2, E=4, seed=6, mutant=True)),
        # the 2026-12-06 prefill candidates (named configs): BM 128 split gate / up with x once (two tiles for some
        # experts: 128 slots per expert on average), BM 64 stages 2 joint and split (96 slots per expert: two tiles),
        # the down GEMM split 3 ways along I (I 384: three 128-wide slabs), and a planted mutant at BM 128
        (mt.fit_config(named_configs()["sw_il_bm128_gu_xb"], 256, 128), dict(T=64, k=6, E=3, seed=14)),
        (mt.fit_config(named_configs()["sw_il_bm64_xb_s2"], 256, 128), dict(T=48, k=4, E=2, seed=15)),
        (mt.fit_config(named_configs()["sw_il_bm64_gu_xb_s2"], 256, 128), dict(T=48, k=4, E=2, seed=16)),
        (mt.fit_config(named_configs()["sw_il_bm128_ksd3"], 256, 384), dict(T=64, k=6, E=3, I=384, seed=17)),
        (mt.fit_config(named_configs()["sw_il_bm128_gu_xb"], 256, 128), dict(T=16, k=6, E=3, seed=18, mutant=True)),
        # the column blocks launched fastest (n_fast; the grid's first two axes swapped): the named wide tiles (two
        # tiles for some experts), and split gate / up with both GEMMs split along K (I 384: three slabs)
        (mt.fit_config(named_configs()["sw_il_bm128_xb_nf"], 256, 128), dict(T=64, k=6, E=3, seed=19)),
        (mt.fit_config(named_configs()["sw_il_bm64_xb_nf"], 256, 128), dict(T=48, k=4, E=2, seed=20)),
        (MC(**base, KS_UP=2, KS_DOWN=3, split_gate_up=True, n_fast=True), dict(T=40, k=3, E=3, I=384, seed=21)),
        # groups of M tiles (group_m, with n_fast): the named BM 128 config (T 64 k 6 E 3: 4-6 tiles, so a short
        # last group), BM 16 in groups of 4 with split gate / up and both GEMMs split along K (9+ tiles: two full
        # groups and a short one), and the split gate / up BM 128 twin with the column blocks fastest
        (mt.fit_config(named_configs()["sw_il_bm128_nf_g4"], 256, 128), dict(T=64, k=6, E=3, seed=22)),
        (MC(**base, KS_UP=2, KS_DOWN=3, split_gate_up=True, n_fast=True, group_m=4),
         dict(T=40, k=3, E=3, I=384, seed=23)),
        (mt.fit_config(named_configs()["sw_il_bm128_gu_xb_nf"], 256, 128), dict(T=64, k=6, E=3, seed=24)),
        # h in plane order (plane_h, session 18): the named wide tile (I 128: both column blocks of one slab) and its
        # 2-stage down launch at I 384 (three slabs: the slab offset of each block's two runs)
        (mt.fit_config(named_configs()["sw_il_bm128_nf_g8_hp"], 256, 128), dict(T=64, k=6, E=3, seed=25)),
        (mt.fit_config(named_configs()["sw_il_bm128_nf_g8_hp_sd2"], 256, 384), dict(T=64, k=6, E=3, I=384, seed=26)),
        # x in plane order too (plane_x, session 19): the named wide tile at I 384 (d 256: the dequant kernel writes
        # both of x's slabs from one program), and at precision "bf16" (x reordered in JAX, no dequant) at BM 32
        (mt.fit_config(named_configs()["sw_il_bm128_nf_g8_hp_xp"], 256, 384), dict(T=64, k=6, E=3, I=384, seed=27)),
        (MC(**{**base, "BM": 32}, KS_UP=1, KS_DOWN=1, act="bf16rt", plane_x=True),
         dict(T=40, k=3, E=3, seed=28, precision="bf16")),
        # two column blocks per down program (down_pair, session 19): the named config at I 384, d 256 (two pairs)
        (mt.fit_config(named_configs()["sw_il_bm128_nf_g8_hp_xp_dp"], 256, 384), dict(T=64, k=6, E=3, I=384, seed=29)),
    ]


def _eo_outputs(cfg, precision="reference", T=5, k=2, E=4, d=256, I=128, seed=0, limit=10.0, **_):
    """(o, h) of ``cfg`` as mma "swap_eo" on the checkpoint weights of ``check_il``'s problem."""
    import dataclasses
    sys.modules["jax_triton"] = _JtShim
    eo = dataclasses.replace(cfg, mma="swap_eo", decode="tl", split_gate_up=False, n_fast=False, group_m=1,
                             plane_h=False, plane_x=False, down_pair=False, tile_major=0)
    x, idx, weight, w1, s1, w3, s3, w2, s2 = _problem(T, k, E, d, I, seed)
    act_fp8 = precision == "reference"
    p = {kk: np.array(v) for kk, v in mt.prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=act_fp8).items()}
    u8 = mt._as_u8
    o, h, _ = mt._launch(p, u8(w1), s1, u8(w3), s3, u8(w2), s2, T=T, k=k, d=d, I=I, E=E, limit=limit,
                         act_fp8=act_fp8, cfg=eo)
    return np.asarray(o), np.asarray(h)


def _outputs_in_subprocess(flag, j, what):
    """(o, h) of case j computed by this script's child mode ``flag`` in a fresh process (the interpreter flake grows
    with launches per process, and the comparisons need two launch sets): saved to .npz and read back."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.npz")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), flag, str(j), path],
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            raise RuntimeError(f"{what} of case {j} failed: {r.stderr[-500:]}")
        z = np.load(path)
        return z["o"], z["h"]


def _eo_in_subprocess(j):
    """``_eo_outputs`` of il case j in a fresh process."""
    return _outputs_in_subprocess("--il-eo", j, "swap_eo run")


def check_il(cfg, precision="reference", T=5, k=2, E=4, d=256, I=128, seed=0, limit=10.0, mutant=False, eo=None):
    """The same problem through the real launcher twice: ``cfg`` as mma "swap_eo" on the checkpoint weights (``eo``:
    its (o, h) if already computed, e.g. in another process) and as mma "swap_il" on the same weights repacked by
    ``moe_layout.repack`` (``mutant``: with the bit tables of the even and odd planes swapped, a wrong nibble
    order). Returns (o bit-identical, h bit-identical, rel err of il vs the eager reference, fraction of il h values
    equal to the reference's round-tripped h)."""
    import dataclasses
    from dsflash.kernels import moe_layout
    sys.modules["jax_triton"] = _JtShim
    il = dataclasses.replace(cfg, mma="swap_il", decode="tl")
    args = _problem(T, k, E, d, I, seed)
    x, idx, weight, w1, s1, w3, s3, w2, s2 = args
    ref = np.asarray(moe_gemm.routed_moe_reference(*args, limit=limit, precision=precision))
    act_fp8 = precision == "reference"
    p = {kk: np.array(v) for kk, v in mt.prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=act_fp8).items()}
    o_eo, h_eo = eo if eo is not None else _eo_outputs(cfg, precision, T, k, E, d, I, seed, limit)
    src = moe_layout.SRC
    if mutant:                      # planes swapped: each byte's two nibbles land in each other's place
        src = (src[2], src[3], src[0], src[1])
    iw = tuple(a for w, sc in ((w1, s1), (w3, s3), (w2, s2)) for a in moe_layout.repack(w, sc, src=src))
    mt._check_shapes(x, idx, *iw, il)
    o_il, h_il, _ = mt._launch(p, *iw, T=T, k=k, d=d, I=I, E=E, limit=limit, act_fp8=act_fp8, cfg=il)
    o_eo, o_il, h_eo, h_il = (np.asarray(a) for a in (o_eo, o_il, h_eo, h_il))
    if il.plane_h:                  # the launcher's h is in plane order (routed_moe_triton un-permutes it too)
        from dsflash.kernels.experimental.moe_layout_kernels import h_from_planes
        h_il = h_from_planes(h_il)
    o_same = bool(np.array_equal(o_eo.view(np.uint16), o_il.view(np.uint16)))     # bf16 (or its uint16 bits)
    h_same = bool(np.array_equal(h_eo.view(np.uint16), h_il.view(np.uint16)))
    out = o_il.astype(np.float32).reshape(T, k, d).sum(1)
    rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    same = float("nan")
    if act_fp8:
        rh = _ref_h(x, idx, weight, w1, s1, w3, s3, p["order"], limit)
        same = float(np.mean(h_il.astype(np.float32) == rh))
    plan = mt.sk_plan(il, T * k, E, d, I, act_fp8)
    print(f"il{' MUTANT' if mutant else ''} BM={cfg.BM} {plan} T={T} k={k} E={E} d={d} I={I} {precision}: "
          f"o bit-identical to swap_eo {o_same}, h bit-identical {h_same}, rel err vs reference {rel:.3e}, "
          f"h equal to reference {same:.5f}")
    return o_same, h_same, rel, same


def _tm_cases():
    """Tile-major il weights (config ``tile_major``, ``moe_layout.to_tiles``; session 28, level 2 session 30) against
    the same config on plain il weights: the named decode twins (I 384: 6 row blocks of W1 and 3 slabs of W2, so a
    block / slab mix-up moves data), split K in both GEMMs, x dequantised once at BM 64, level 2 with split_gate_up
    (the program's block index re-derived) and with plane_h + down_pair (two blocks a down program); the planted
    mistakes must fail: tiles ordered slab-major instead of block-major ("slab"), and level-1 tiles (scale words in
    row order) under a level-2 config ("level")."""
    import dataclasses
    from dsflash.kernels.moe_plan import named_configs
    nc = named_configs()
    fit = lambda name, I=128: mt.fit_config(nc[name], 256, I)       # noqa: E731
    return [
        (fit("sw_il_tm"), dict(T=7, k=6, E=8, seed=5)),
        (fit("sw_il_bm32_tm", 384), dict(T=40, k=3, E=3, I=384, seed=4)),
        (dataclasses.replace(fit("sw_il_tm", 384), KS_UP=2, KS_DOWN=3), dict(T=5, k=2, E=4, I=384, seed=30)),
        (fit("sw_il_bm64_xb_tm"), dict(T=48, k=4, E=2, seed=31)),
        (fit("sw_il_bm32_tm", 384), dict(T=40, k=3, E=3, I=384, seed=4, mutant="slab")),
        (fit("sw_il_tm2"), dict(T=7, k=6, E=8, seed=5)),
        (fit("sw_il_bm32_tm2", 384), dict(T=40, k=3, E=3, I=384, seed=4)),
        (dataclasses.replace(fit("sw_il_tm2", 384), KS_UP=2, KS_DOWN=3), dict(T=5, k=2, E=4, I=384, seed=30)),
        # (session 30, unexplained: on a loaded 2-core host the split-K cases here ran nondeterministically at every
        # level, plain il included -- o differing with h equal, heap-corruption aborts, nonsense interpreter type
        # errors; tm-7's problem 6 runs each beside two others: level 0 1 differing, level 1 1, level 2 2; run
        # alone, 3 of 3 bit-equal at each level. A failed check is re-run once; a double failure there is this.)
        (dataclasses.replace(fit("sw_il_tm2", 384), split_gate_up=True, KS_UP=2, KS_DOWN=3),
         dict(T=9, k=3, E=4, I=384, seed=32)),
        (dataclasses.replace(fit("sw_il_bm32_tm2", 384), plane_h=True, down_pair=True, KS_UP=1),
         dict(T=12, k=2, E=3, I=384, seed=33)),
        (fit("sw_il_bm32_tm2", 384), dict(T=40, k=3, E=3, I=384, seed=4, mutant="level")),
    ]


def _il_outputs(cfg, precision="reference", T=5, k=2, E=4, d=256, I=128, seed=0, limit=10.0, tiles=None, **_):
    """(o, h) of il config ``cfg`` (decode "tl") on ``_problem``'s weights repacked, then permuted by ``tiles``
    (a function of the six il arrays) when given."""
    import dataclasses
    from dsflash.kernels import moe_layout
    sys.modules["jax_triton"] = _JtShim
    cfg = dataclasses.replace(cfg, decode="tl")
    x, idx, weight, w1, s1, w3, s3, w2, s2 = _problem(T, k, E, d, I, seed)
    iw = moe_layout.repack_experts(w1, s1, w3, s3, w2, s2)
    if tiles is not None:
        iw = tiles(*iw)
    mt._check_shapes(x, idx, *iw, cfg)
    act_fp8 = precision == "reference"
    p = {kk: np.array(v) for kk, v in mt.prepare(x, idx, weight, E=E, BM=cfg.BM, act_fp8=act_fp8).items()}
    o, h, _ = mt._launch(p, *iw, T=T, k=k, d=d, I=I, E=E, limit=limit, act_fp8=act_fp8, cfg=cfg)
    return np.asarray(o), np.asarray(h)


def _slab_major_tiles(*il_arrays):
    """A planted mistake for ``_tm_cases``: tiles ordered slab-major ((j * N/64 + nb) * 64 + r) instead of
    ``to_tiles``' block-major order."""
    out = []
    for a in il_arrays:
        E, n, cols = a.shape
        per_slab = 32 if a.dtype == np.uint16 else 1
        t = np.asarray(a).reshape(E, n // 64, 64, cols // per_slab, per_slab).transpose(0, 3, 1, 2, 4)
        out.append(np.ascontiguousarray(t).reshape(E, n, cols))
    return tuple(out)


def _tm_base_in_subprocess(j):
    """The plain-il twin's (o, h) of tm case j in a fresh process."""
    return _outputs_in_subprocess("--tm-base", j, "plain il run")


def _tm(j):
    """tm case j: o and h bit-identical to the config without tile_major (a mutant: neither is)."""
    from dsflash.kernels import moe_layout
    cfg, kw = _tm_cases()[j]
    o_il, h_il = _tm_base_in_subprocess(j)
    mutant = kw.get("mutant")
    if mutant == "slab":
        tiles = _slab_major_tiles
    else:               # "level": level-1 tiles under a level-2 config
        tiles = functools.partial(moe_layout.tile_experts, level=1 if mutant == "level" else cfg.tile_major)
    o_tm, h_tm = (a.view(np.uint16) for a in _il_outputs(cfg, **kw, tiles=tiles))
    o_same, h_same = bool(np.array_equal(o_il, o_tm)), bool(np.array_equal(h_il, h_tm))
    print(f"tm{cfg.tile_major}{' MUTANT ' + mutant if mutant else ''} BM={cfg.BM} KS={cfg.KS_UP}/{cfg.KS_DOWN} "
          f"act={cfg.act} gu={cfg.split_gate_up} hp/dp={cfg.plane_h}/{cfg.down_pair} {kw}: o bit-identical to plain "
          f"il {o_same}, h bit-identical {h_same}")
    if mutant:
        assert not o_same and not h_same, (o_same, h_same)
    else:
        assert o_same and h_same, (o_same, h_same)


def _il(j):
    cfg, kw = _il_cases()[j]
    o_same, h_same, rel, same = check_il(cfg, **kw, eo=_eo_in_subprocess(j))
    if kw.get("mutant"):
        assert not o_same and not h_same and rel > 0.1, (o_same, h_same, rel)
        return
    assert o_same and h_same, (o_same, h_same)
    assert rel < 1e-2, rel
    assert kw.get("precision", "reference") != "reference" or same >= 0.999, same


if __name__ == "__main__":
    # each check in a fresh process, a failed one re-run once (scripts/interpret_isolation.py, NOTES "Known flake")
    from interpret_isolation import main as run_isolated
    checks = {f"legacy-{j}": functools.partial(_legacy, j) for j in range(3)}
    checks.update({f"sk-{j}": functools.partial(_sk, j) for j in range(len(_sk_cases()))})
    checks.update({f"sw-{j}": functools.partial(_sw, j) for j in range(len(_sw_cases()))})
    checks.update({f"ps-{j}": functools.partial(_ps, j) for j in range(len(_ps_cases()))})
    checks.update({f"crafted-{j}": functools.partial(_crafted, j) for j in range(len(_crafted_cases()))})
    checks.update({f"il-{j}": functools.partial(_il, j) for j in range(len(_il_cases()))})
    checks.update({f"tm-{j}": functools.partial(_tm, j) for j in range(len(_tm_cases()))})
    if sys.argv[1:2] == ["--il-eo"]:                              # child of _eo_in_subprocess
        cfg, kw = _il_cases()[int(sys.argv[2])]
        o, h = _eo_outputs(cfg, **kw)
        np.savez(sys.argv[3], o=o.view(np.uint16), h=h.view(np.uint16))
        sys.exit(0)
    if sys.argv[1:2] == ["--tm-base"]:                            # child of _tm_base_in_subprocess
        import dataclasses
        cfg, kw = _tm_cases()[int(sys.argv[2])]
        o, h = _il_outputs(dataclasses.replace(cfg, tile_major=0), **kw)
        np.savez(sys.argv[3], o=o.view(np.uint16), h=h.view(np.uint16))
        sys.exit(0)
    if sys.argv[1:2] == ["--only"] and len(sys.argv) == 3:       # the checks whose names start with PREFIX
        checks = {n: c for n, c in checks.items() if n.startswith(sys.argv[2] + "-")}
        del sys.argv[1:]
    run_isolated(__file__, checks)
