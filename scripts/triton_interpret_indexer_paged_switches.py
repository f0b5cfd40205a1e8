"""CPU check of the paged indexer scorer's opt-in switches (``indexer_paged_triton.KEY_DECODE`` "table",
``RELU_ONE_COMPARE``, ``PAIRED_ROUND``; session 30) in Triton's interpreter: each must give the default's bits.

* ``decode-all``: the key decode helper ``_mxfp4_tile`` with KTAB 1 (the interpreter's twin of the byte-table asm,
  ``_e2m1_table_tl``) against KTAB 0 (the default) and against a numpy model of the default's GPU arithmetic (the
  fp32 product E2M1 x 2^(s - 127), then bf16 round to nearest even) for every one of the 256 packed bytes (both
  nibbles: all 16 codes) with every one of the 256 scale bytes (0 = the subnormal 2^-127, 254 overflows for codes
  >= 2, 255 = inf: 0 x inf = NaN). NaN compared as NaN (the GPU's NaN bits are the hardware's canonical ones either
  way; the asm's own bits are checked by tests/test_kernels_indexer_paged.py with scripts/ptx_emu.py). The model
  comparison leaves out the 256 subnormal results: the interpreter's fp32 -> bf16 cast mis-encodes subnormals (both
  forms alike; the GPU forms are checked on them by the emulator test and tests/gpu/test_indexer_paged_switches.py).
* ``kernel-<switches>-<case>``: whole-kernel scores with the switch(es) against the default, bit for bit (NaN bits
  included), on random inputs with NaN / inf queries and weights and extreme scale bytes planted in the pool.
  PAIRED_ROUND has no interpreter form (the interpreter keeps ``_bf16_rne``); it rides along in ``kernel-all`` only
  to show that passing it changes nothing here.
Usage: python scripts/triton_interpret_indexer_paged_switches.py [--list | --check NAME]   (each check in a fresh
process: interpret_isolation)"""
import functools
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from triton_interpret_moe import Fake  # noqa: E402
import interpret_isolation  # noqa: E402
import ptx_emu  # noqa: E402
from dsflash import quant  # noqa: E402
from dsflash.kernels import indexer_paged_triton as ipt  # noqa: E402
from triton_interpret_indexer_paged import problem  # noqa: E402


def all_bytes_and_scales(Di=128):
    """Rows of packed bytes [R, Di/2] and scale bytes [R, Di/32] in which every (byte, scale byte) pair occurs:
    scale group G (row-major) has scale G % 256 and bytes 16 (G // 256) + 0..15."""
    groups = 256 * 16
    G = np.arange(groups)
    scales = (G % 256).astype(np.uint8)
    packed = ((G // 256)[:, None] * 16 + np.arange(16)[None, :]).astype(np.uint8)
    R = groups // (Di // 32)
    return packed.reshape(R, Di // 2), scales.reshape(R, Di // 32)


def default_model_bits(packed, scales):
    """bf16 bits of the default decode's GPU arithmetic: fp32 E2M1 value x fp32 2^(s - 127) (quant.e8m0_to_f32: 0
    is 2^-127, 255 is inf), rounded to nearest even (NaN -> 0x7FFF)."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    vals = quant.E2M1_VALUES[codes]
    s = np.asarray(scales, np.uint32)
    sc = np.where(s == 0, np.float32(2.0 ** -127), (s << 23).view(np.float32)).astype(np.float32)
    prod = vals.reshape(vals.shape[0], -1, 32) * sc[:, :, None]
    return ptx_emu.bf16_rne_bits(prod.reshape(vals.shape).astype(np.float64))


def same_bits_nan_as_nan(a, b):
    a, b = np.asarray(a, np.uint16), np.asarray(b, np.uint16)
    nan_a = ((a & 0x7F80) == 0x7F80) & ((a & 0x7F) != 0)
    nan_b = ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)
    return bool(np.array_equal(nan_a, nan_b) and np.array_equal(a[~nan_a], b[~nan_b])), int(nan_a.sum())


def check_decode_all():
    Di, BT = 128, 128
    packed, scales = all_bytes_and_scales(Di)
    R = packed.shape[0]
    outs = {}
    for ktab in (0, 1):
        o = np.zeros((R, Di), np.uint16)
        ipt._key_tile_kernel[(R // BT,)](Fake(packed), Fake(scales), Fake(o), KTAB=ktab, BT=BT, Di=Di, DECODE=0)
        outs[ktab] = o
    model = default_model_bits(packed, scales)
    # the interpreter's fp32 -> bf16 cast (triton.runtime.interpreter._convert_float) mis-encodes subnormals (fp32
    # 2^-127 -> bf16 0x0000, not 0x0040), in both forms alike: the model is compared on the normal / zero / inf / NaN
    # results only; the GPU asm's subnormals are checked against the model in ptx_emu (tests).
    sub = (model & 0x7F80) == 0
    sub &= (model & 0x7F) != 0
    ok01, n_nan = same_bits_nan_as_nan(outs[0], outs[1])
    okm, _ = same_bits_nan_as_nan(outs[1][~sub], model[~sub])
    okd, _ = same_bits_nan_as_nan(outs[0][~sub], model[~sub])
    pairs = set(zip(np.repeat(scales.reshape(-1), 16).tolist(), packed.reshape(-1).tolist()))
    print(f"{'ok  ' if ok01 and okm and okd else 'FAIL'} decode-all: {R} x {Di} elements, every (byte, scale byte) "
          f"pair; table == where: {ok01}; both == the GPU model: {okm and okd} ({int(sub.sum())} subnormal results "
          f"left out: the interpreter's cast); NaN elements {n_nan} (scale 255 x code +-0)", flush=True)
    assert len(pairs) == 256 * 256, len(pairs)
    assert ok01 and okm and okd


SWITCHES = {"table": dict(KTAB=1), "relu1": dict(RELU1=1), "all": dict(KTAB=1, PAIR=1, RELU1=1)}
CASES = [  # B, S, Hi, Di, P, per_page, grid, cand
    (2, 6, 32, 128, 3, 64, False, True),     # the real head shape, continuous values, candidates
    (1, 9, 16, 64, 4, 32, True, False),      # dyadic grid, two row blocks
]


def kernel_bits(args, **switches):
    q, w, pool, pt, per_page, visible, valid, cand = args
    arrays, const, grid, _ = ipt.kernel_args(q, w, pool, pt, per_page, visible, valid, cand)
    const.update(switches)
    B, S = q.shape[:2]
    out = np.zeros((B, S, const["T"]), np.float32)
    # private writable copies: the interpreter writes every buffer back after a launch, and zero-copy views of JAX
    # buffers gave sporadic garbage scores here (a whole case wrong, different on a re-run)
    ipt._indexer_paged_kernel[grid](*[Fake(np.array(a, copy=True)) for a in arrays], Fake(out), DECODE=0, **const)
    return out


def hostile(args, seed):
    """Plant NaN / inf in queries and weights and extreme scale bytes (0, 1, 253, 254, 255) in the pool."""
    q, w, pool, pt, per_page, visible, valid, cand = args
    rng = np.random.default_rng(seed)
    qn = np.asarray(q, np.float32).copy()
    wn = np.asarray(w, np.float32).copy()
    for arr, n in ((qn, 6), (wn, 4)):
        flat = arr.reshape(-1)
        idx = rng.choice(flat.size, n, replace=False)
        flat[idx] = np.array([np.nan, np.inf, -np.inf, -0.0, np.nan, 0.0][:n], np.float32)
    s = np.asarray(pool["s"]).copy()
    flat = s.reshape(-1)
    idx = rng.choice(flat.size, 10, replace=False)
    flat[idx] = np.array([0, 1, 253, 254, 255, 0, 1, 253, 254, 255], np.uint8)
    pool = {"q": pool["q"], "s": jnp.asarray(s)}
    return (jnp.asarray(qn, jnp.bfloat16), jnp.asarray(wn, jnp.bfloat16), pool, pt, per_page, visible, valid, cand)


def check_kernel(tag, i):
    """Case ``i`` with NaN / inf / extreme scales planted: the default and the switched kernel, two launches (the
    interpreter flake of NOTES "Known flake" hits from about the third launch of a process: one pair a check)."""
    B, S, Hi, Di, P, pp, grid, cand = CASES[i]
    args = hostile(problem(B, S, Hi, Di, P, pp, 100 + i, grid, True, cand), i)
    want = kernel_bits(args)
    got = kernel_bits(args, **SWITCHES[tag])
    ok = np.array_equal(want.view(np.uint32), got.view(np.uint32))
    print(f"{'ok  ' if ok else 'FAIL'} kernel-{tag}-{i} B{B} S{S} Hi{Hi} Di{Di} T{P * pp} grid={grid} cand={cand}: "
          f"bits equal {ok} (NaN scores {int(np.isnan(want).sum())}, -inf {int(np.isneginf(want).sum())}, +inf "
          f"{int(np.isposinf(want).sum())}, finite {int(np.isfinite(want).sum())})", flush=True)
    assert ok


CHECKS = {"decode-all": check_decode_all,
          **{f"kernel-{t}-{i}": functools.partial(check_kernel, t, i) for t in SWITCHES for i in range(len(CASES))}}


if __name__ == "__main__":
    interpret_isolation.main(__file__, CHECKS)
    if not sys.argv[1:]:
        print("all ok")
