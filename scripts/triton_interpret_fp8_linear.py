"""CPU check of the dense FP8 linear kernel (dsflash/kernels/fp8_linear_triton.py) in Triton's interpreter.

Every check goes through the real launcher (``fp8_linear_triton``, a jax_triton stand-in running the kernels on
numpy buffers, DECODE 0) at small shapes and compares with the model's numerics (``fp8_linear_reference`` ==
``layers.linear_fp8``) and with the exact product (float64 of the exact round-tripped x and dequantised W).

Bound (random inputs): the products x_k w_k are exact in fp32 (bf16 x bf16), so any fp32 summation order of the K
terms -- the kernel's MMA chunks + split-K partials, or XLA's -- is within gamma_{K-1} sum_k |x_k w_k|,
gamma_n = n u / (1 - n u), u = 2^-24, of the exact sum (Higham, Accuracy and Stability, 4.2). The check: the
kernel's fp32 result |y - y_exact| <= K 2^-24 sum|x w| elementwise; its bf16 output is the RNE rounding of that fp32
result (bit for bit) and within one bf16 ulp of the reference's bf16 output, with >= 99 % of elements equal.
"exact.*" checks use small-integer data whose every partial sum is exact in fp32: there the outputs must be
bit-identical to the reference. ``mutant.*`` checks must FAIL the same comparison (expect_ok False): the scales
rolled by one K block (a wrong scale index), the kernel without the activation round trip (precision "bf16")
against the "reference" reference, and the planes decode without its scale guard on a scale it cannot represent.
Usage: python scripts/triton_interpret_fp8_linear.py [--list | --check NAME]   (needs triton; each check in a fresh
process, a failed check re-run once: ``interpret_isolation``)"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton_interpret_moe import _JtShim  # noqa: E402
from dsflash.kernels import fp8_linear, fp8_linear_triton as ft  # noqa: E402
from dsflash import quant  # noqa: E402
import triton.language as tl  # noqa: E402


def problem(M, K, N, seed, exact=False):
    """x [M, K] bf16, w [N, K] E4M3, scale [N/32, K/32] UE8M0 with block scales spread over 2^-3..2^3 (so a wrong
    scale index shows). ``exact``: small integers (x in -7..7, codes in -7..7, scales 2^0) -- every partial sum exact."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    if exact:
        x = jax.random.randint(ks[0], (M, K), -7, 8).astype(jnp.bfloat16)
        w = jax.random.randint(ks[1], (N, K), -7, 8).astype(jnp.float8_e4m3fn)
        return x, w, jnp.full((N // 32, K // 32), 127, jnp.uint8)
    x = (jax.random.normal(ks[0], (M, K)) * jnp.exp2(jax.random.randint(ks[2], (M, 1), -2, 3))).astype(jnp.bfloat16)
    blk = jnp.exp2(jax.random.randint(ks[3], (N // 32, K // 32), -3, 4).astype(jnp.float32))
    wf = jax.random.normal(ks[1], (N, K)) * 0.05 * jnp.repeat(jnp.repeat(blk, 32, 0), 32, 1)
    w, s = quant.quantize_fp8_weight(wf)
    return x, w, s


def all_codes(x, w, s):
    """Every E4M3 code but the NaNs (0x7F, 0xFF), zeros, subnormals and both signs included, tiled over w."""
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    rng = np.random.default_rng(26)
    b = rng.permutation(np.resize(codes, w.size)).reshape(w.shape)
    return x, jax.lax.bitcast_convert_type(jnp.asarray(b), jnp.float8_e4m3fn), s


def big_scale(x, w, s):
    """One scale block above ``PLANES_MAX_SCALE`` (its 32 x 32 weights ~2^13 x larger): the planes decode cannot
    write 2^(s - 7) as a bf16 there, so that K chunk must take the per-element decode."""
    return x, w, s.at[0, 1].set(ft.PLANES_MAX_SCALE + 6)


def check(M, K=256, N=96, *, precision="reference", config="decode", seed=0, exact=False, mutate=None,
          expect_ok=True, act_quant=True, tweak=None):
    sys.modules["jax_triton"] = _JtShim
    x, w, s = problem(M, K, N, seed, exact)
    if tweak is not None:
        x, w, s = tweak(x, w, s)
    ref = np.asarray(fp8_linear.fp8_linear_reference(x, w, s, precision=precision, act_quant=act_quant)
                     ).astype(np.float32)
    ks, kprec = s, precision
    if mutate == "scale":
        ks = jnp.roll(s, 1, axis=1)                    # each block gets its K-neighbour's scale
    elif mutate == "no_rt":
        kprec = "bf16"
    cfg = ft.named_config(config)
    y32 = np.asarray(ft.fp8_linear_triton(x, w, ks, precision=kprec, act_quant=act_quant, config=cfg,
                                          out_f32=True, decode=0)).astype(np.float32)
    y16 = np.asarray(ft.fp8_linear_triton(x, w, ks, precision=kprec, act_quant=act_quant, config=cfg,
                                          decode=0)).astype(np.float32)
    # exact product of the exact operands (float64: products and a 256-term sum of 8-bit values are exact or nearly)
    xa = quant.fp8_roundtrip(x, 32) if (precision == "reference" and act_quant) else x
    xa = np.asarray(xa.astype(jnp.float32), np.float64)
    wd = np.asarray(quant.dequant_fp8_weight(w, s, jnp.float32), np.float64)
    exact64 = xa @ wd.T
    absum = np.abs(xa) @ np.abs(wd).T
    bound = K * 2.0 ** -24 * absum
    err32 = np.abs(y32 - exact64)
    ok32 = bool(np.all(err32 <= bound))
    rne = np.asarray(jnp.asarray(y32).astype(jnp.bfloat16).astype(jnp.float32))
    own = bool(np.array_equal(y16, rne))
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 2.0 ** -126))) - 7)
    within = bool(np.all(np.abs(y16 - ref) <= ulp))
    same = float(np.mean(y16 == ref))
    pl = ft.plan(cfg, M, N, K)
    if exact:
        ok = bool(np.array_equal(y16, ref)) and bool(np.array_equal(y32, exact64))
    else:
        ok = ok32 and own and within and same >= 0.99
    print(f"M={M} K={K} N={N} {precision} cfg={config} plan=BM{pl['BM']} BN{pl['BN']} BK{pl['BK']} KS{pl['KS']} "
          f"{'exact ' if exact else ''}{'mutant ' + mutate if mutate else ''}: fp32 max err / bound "
          f"{np.max(err32 / np.maximum(bound, 1e-30)):.3g}, bf16 == own RNE {own}, within 1 ulp of ref {within}, "
          f"bf16 equal to ref {same:.4f} -> {'ok' if ok else 'MISMATCH'}"
          + ("" if ok == expect_ok else "   <-- UNEXPECTED"))
    return ok == expect_ok


def check_nan(M=6, K=256, N=96, seed=12, config="decode"):
    """A NaN in x (row 2): the fp32 result's NaN pattern must be the reference's (the clamp of the in-kernel round
    trip propagates NaN, as jnp.clip does). NaN weights (E4M3 byte 0x7F) cannot be checked here: Triton 3.6's
    interpreter converts 0x7F to 480 (checked 2026-12-01), the GPU's cvt gives NaN; tests/gpu/test_fp8_linear.py
    checks them."""
    sys.modules["jax_triton"] = _JtShim
    x, w, s = problem(M, K, N, seed)
    x = x.at[2, 7].set(jnp.nan)
    ref = np.asarray(fp8_linear.fp8_linear_reference(x, w, s, precision="reference")).astype(np.float32)
    y = np.asarray(ft.fp8_linear_triton(x, w, s, precision="reference", config=config, out_f32=True, decode=0))
    ok = bool(np.array_equal(np.isnan(y), np.isnan(ref))) and int(np.isnan(ref).sum()) == N
    print(f"NaN propagation ({config}): {int(np.isnan(y).sum())} NaN outputs, reference {int(np.isnan(ref).sum())}"
          f" -> {'ok' if ok else 'MISMATCH'}")
    return ok


def check_grouped(M=6, K=256, G=2, Ng=64, *, config="decode", seed=14, exact=False, mutate=None, expect_ok=True):
    """Block-diagonal launch (``groups`` G, V4.1's wo_a: 8 groups of [1024, 4096], bf16 activations without the
    round trip): x [M, G K], w [G Ng, K]; group g's outputs against the reference on x's g-th K slice and the
    weight's g-th row block (the model's grouped einsum), the same bounds as ``check``. Mutant "swap": x's two group
    slices exchanged before the kernel (a wrong group offset) must fail."""
    sys.modules["jax_triton"] = _JtShim
    x, w, s = problem(M, G * K, G * Ng, seed, exact)
    w, s = w[:, :K], s[:, :K // 32]                      # [G Ng, K] and its scales
    xk = x if mutate != "swap" else jnp.concatenate([x[:, K:2 * K], x[:, :K], x[:, 2 * K:]], axis=1)
    cfg = ft.NAMED_CONFIGS[config]
    y32 = np.asarray(ft.fp8_linear_triton(xk, w, s, act_quant=False, config=cfg, out_f32=True, decode=0,
                                          groups=G)).astype(np.float32)
    y16 = np.asarray(ft.fp8_linear_triton(xk, w, s, act_quant=False, config=cfg, decode=0, groups=G)
                     ).astype(np.float32)
    wd = np.asarray(quant.dequant_fp8_weight(w, s, jnp.float32), np.float64)
    xa = np.asarray(x.astype(jnp.float32), np.float64)
    refs, ex, ab = [], [], []
    for g in range(G):
        xg, rows = x[:, g * K:(g + 1) * K], slice(g * Ng, (g + 1) * Ng)
        refs.append(np.asarray(fp8_linear.fp8_linear_reference(xg, w[rows], s[g * Ng // 32:(g + 1) * Ng // 32],
                                                               act_quant=False)).astype(np.float32))
        ex.append(xa[:, g * K:(g + 1) * K] @ wd[rows].T)
        ab.append(np.abs(xa[:, g * K:(g + 1) * K]) @ np.abs(wd[rows]).T)
    ref, exact64, bound = np.concatenate(refs, 1), np.concatenate(ex, 1), K * 2.0 ** -24 * np.concatenate(ab, 1)
    err32 = np.abs(y32 - exact64)
    rne = np.asarray(jnp.asarray(y32).astype(jnp.bfloat16).astype(jnp.float32))
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 2.0 ** -126))) - 7)
    same = float(np.mean(y16 == ref))
    if exact:
        ok = bool(np.array_equal(y16, ref)) and bool(np.array_equal(y32, exact64))
    else:
        ok = bool(np.all(err32 <= bound)) and bool(np.array_equal(y16, rne)) and \
            bool(np.all(np.abs(y16 - ref) <= ulp)) and same >= 0.99
    pl = ft.plan(cfg, M, G * Ng, K, G)
    print(f"grouped G={G} M={M} K={K} Ng={Ng} cfg={config} plan=BM{pl['BM']} BN{pl['BN']} KS{pl['KS']} "
          f"{'exact ' if exact else ''}{'mutant ' + mutate if mutate else ''}: fp32 max err / bound "
          f"{np.max(err32 / np.maximum(bound, 1e-30)):.3g}, bf16 equal to ref {same:.4f} -> "
          f"{'ok' if ok else 'MISMATCH'}" + ("" if ok == expect_ok else "   <-- UNEXPECTED"))
    return ok == expect_ok


def check_lastred(M, K=512, N=128, *, seed=19, groups=1):
    """Split K summed by each tile's last program (``reduce="last"``, ``_fp8_linear_lastred_kernel``) against the
    two-launch path (``_fp8_linear_reduce``) of the same tiles: fp32 and bf16 outputs bit-identical (same partials,
    same order), and KS > 1 really taken. The interpreter runs programs one after another, so the last to arrive
    is always ks = KS - 1; the GPU test (tests/gpu/test_fp8_linear.py) checks the concurrent case."""
    sys.modules["jax_triton"] = _JtShim
    x, w, s = problem(M, groups * K, N, seed)
    if groups > 1:
        w, s = w[:, :K], s[:, :K // 32]
    base = ft.Fp8LinearConfig(BN=64)
    last = ft.Fp8LinearConfig(BN=64, reduce="last")
    pl = ft.plan(last, M, N, K, groups)
    outs = {}
    for name, cfg in (("launch", base), ("last", last)):
        for f32 in (True, False):
            outs[name, f32] = np.asarray(ft.fp8_linear_triton(x, w, s, act_quant=groups == 1, config=cfg, decode=0,
                                                              out_f32=f32, groups=groups)).astype(np.float32)
    ok = pl["KS"] > 1 and all(np.array_equal(outs["launch", f], outs["last", f]) for f in (True, False))
    print(f"last-program reduce M={M} K={K} N={N} G={groups} plan=BM{pl['BM']} BN{pl['BN']} KS{pl['KS']} grid "
          f"{pl['grid']}: fp32 / bf16 bit-identical to the reduce launch -> {'ok' if ok else 'MISMATCH'}")
    return ok


CHECKS = {
    "ref.m1": lambda: check(1),
    "ref.m6": lambda: check(6),
    "ref.m40": lambda: check(40),
    "ref.m40.krt": lambda: check(40, config="decode_krt", seed=13),
    "ref.m6.bn128": lambda: check(6, N=256, config="decode_bn128", seed=3),
    "ref.m6.xrt": lambda: check(6, config="decode_xrt", seed=4),
    "ref.m40.prefill": lambda: check(40, config="prefill", seed=5),
    "ref.m6.noactq": lambda: check(6, act_quant=False, seed=6),
    "bf16.m6": lambda: check(6, precision="bf16", seed=1),
    "bf16.m40.prefill": lambda: check(40, precision="bf16", config="prefill", seed=2),
    "ref.m20.k512.ks4": lambda: check(20, K=512, N=64, seed=7),
    "exact.m6": lambda: check(6, exact=True, seed=8),
    "exact.m40.prefill": lambda: check(40, exact=True, config="prefill", seed=9),
    "nan.decode": lambda: check_nan(),
    "nan.prefill": lambda: check_nan(M=40, config="prefill"),
    "mutant.scale": lambda: check(6, seed=10, mutate="scale", expect_ok=False),
    "mutant.no_rt": lambda: check(6, seed=11, mutate="no_rt", expect_ok=False),
    "grouped.m6": lambda: check_grouped(),
    "grouped.m40.g4": lambda: check_grouped(40, K=128, G=4, Ng=32, seed=15),
    "grouped.m40.prefill": lambda: check_grouped(40, config="prefill", seed=16),
    "grouped.exact.m6": lambda: check_grouped(exact=True, seed=17),
    "mutant.grouped.swap": lambda: check_grouped(seed=18, mutate="swap", expect_ok=False),
    "lastred.m6": lambda: check_lastred(6),
    "lastred.m40": lambda: check_lastred(40, seed=20),
    "lastred.grouped.m6": lambda: check_lastred(6, K=256, groups=2, seed=21),
    "ref.m6.lastred": lambda: check(6, N=256, K=512, config="dec_bn128_lastred", seed=22),
    # the E4M3 bit-placement decode into even / odd K planes (Fp8LinearConfig.planes, session 28)
    "planes.m6": lambda: check(6, N=256, config="dec_bn128_planes", seed=23),
    "planes.m40.ks": lambda: check(40, N=256, K=512, config="dec_bn128_planes", seed=24),
    "planes.exact.m6": lambda: check(6, N=256, exact=True, config="dec_bn128_planes", seed=25),
    "planes.allcodes": lambda: check(6, N=256, config="dec_bn128_planes", seed=26, tweak=all_codes),
    "planes.bigscale": lambda: check(6, N=256, K=512, config="dec_bn128_planes", seed=27, tweak=big_scale),
    "mutant.planes.scale": lambda: check(6, N=256, config="dec_bn128_planes", seed=28, mutate="scale",
                                         expect_ok=False),
    "mutant.planes.noguard": lambda: _without_guard(lambda: check(6, N=256, K=512, config="dec_bn128_planes",
                                                                  seed=27, tweak=big_scale, expect_ok=False)),
}


def _without_guard(run):
    """The planes decode with its scale guard off (every chunk decoded by bit placement): the big-scale block then
    decodes wrongly, which the comparison must catch."""
    keep = ft._PLANES_MAX
    ft._PLANES_MAX = tl.constexpr(255)
    try:
        return run()
    finally:
        ft._PLANES_MAX = keep


if __name__ == "__main__":
    if "--list" in sys.argv:
        print("\n".join(CHECKS))
    elif "--check" in sys.argv:
        name = sys.argv[sys.argv.index("--check") + 1]
        sys.exit(0 if CHECKS[name]() else 1)
    else:
        import interpret_isolation
        interpret_isolation.run_checks(os.path.abspath(__file__), list(CHECKS))
