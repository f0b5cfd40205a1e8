"""The paged indexer scorer's contract on CPU: its reference input (``indexer_topk.paged_keys``) is exactly the
model's own gather + decode of the index-key pool, and the Triton kernel matches the reference in Triton's
interpreter (``scripts/triton_interpret_indexer_paged.py``: bit-identical on dyadic inputs, 1 bf16 ulp on
continuous ones; MXFP4 and plain pools, shuffled page tables, unused pages, padding rows, padded heads)."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.kernels import indexer_topk as ik
from dsflash.kernels.indexer_topk_shapes import paged_supports
from dsflash.model import state as st
from dsflash.model.attention import gather_pool, pool_addresses

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("precision", ["reference", "bf16"])
def test_paged_keys_is_the_models_gather(precision):
    B, P, per_page, Di = 3, 5, 8, 64
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    pool = st.encode_index_k(jax.random.normal(ks[0], (B * P * per_page + 8, Di), jnp.float32), precision)
    pt = jax.random.permutation(ks[1], B * P + 1)[: B * P].reshape(B, P).astype(jnp.int32)
    entries = jnp.broadcast_to(jnp.arange(P * per_page, dtype=jnp.int32)[None], (B, P * per_page))
    want = gather_pool(pool, pool_addresses(pt, entries, per_page), st.decode_index_k, jnp.bfloat16)
    got = ik.paged_keys(pool, pt, per_page, jnp.bfloat16)
    assert got.shape == (B, P * per_page, Di) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert set(pool) == ({"q", "s"} if precision == "reference" else {"x"})


def test_paged_supports():
    q = jnp.zeros((1, 6, 32, 128), jnp.bfloat16)
    mx = {"q": jnp.zeros((9, 64), jnp.uint8), "s": jnp.zeros((9, 4), jnp.uint8)}
    assert paged_supports(q, mx) and paged_supports(q, {"x": jnp.zeros((9, 128), jnp.bfloat16)})
    assert not paged_supports(q.astype(jnp.float32), mx)                       # fp32 runs: the gather path
    assert not paged_supports(jnp.zeros((1, 6, 24, 128), jnp.bfloat16), mx)   # heads not a power of two
    assert not paged_supports(q, {"q": mx["q"][:, :32], "s": mx["s"]})        # layout does not match Di


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_interpreter_script(interpreter_script):
    interpreter_script("triton_interpret_indexer_paged.py")


def test_paged_stages_reach_the_launch(monkeypatch):
    """``indexer_paged_triton.NUM_STAGES`` is the launch's num_stages (2 by default; 3 is the opt-in row prefetch
    one row further ahead), recorded through a stand-in for jax-triton at V4.1's decode shape."""
    pytest.importorskip("triton")
    import sys
    from dsflash.kernels import indexer_paged_triton as ipt
    calls = []

    class Rec:
        def triton_call(self, *args, kernel, out_shape, grid, num_warps, num_stages, **kw):
            calls.append(dict(grid=grid, num_warps=num_warps, num_stages=num_stages, **kw))
            return jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype)

    monkeypatch.setitem(sys.modules, "jax_triton", Rec())
    B, S, P, per_page = 2, 6, 4, 64
    sd = jax.ShapeDtypeStruct
    pool = {"q": sd((B * P * per_page, 64), jnp.uint8), "s": sd((B * P * per_page, 4), jnp.uint8)}
    args = (sd((B, S, 32, 128), jnp.bfloat16), sd((B, S, 32), jnp.bfloat16), sd((B, P), jnp.int32),
            sd((B, S), jnp.int32), sd((B, S), bool))

    def run():
        jax.eval_shape(lambda q, w, pt, vis, val, pl: ipt.indexer_scores_paged_triton(q, w, pl, pt, per_page, vis,
                                                                                      val), *args, pool)
    run()
    monkeypatch.setattr(ipt, "NUM_STAGES", 3)
    run()
    assert [c["num_stages"] for c in calls] == [2, 3]
    assert all(c["SB"] == 6 and c["BT"] == 128 and c["num_warps"] == 4 and c["grid"] == (B, 2) for c in calls)


# ---- session 30's opt-in switches (KEY_DECODE "table", PAIRED_ROUND, RELU_ONE_COMPARE): each gives the default's bits

def _ptx_emu():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import ptx_emu
    return ptx_emu


def _default_decode_bits(codes, scale_bytes):
    """bf16 bits of the default decode's GPU arithmetic for E2M1 codes with their UE8M0 scale bytes: the fp32
    product E2M1 x 2^(s - 127) (``_e2m1_f32`` x ``_e8m0_f32``: s = 0 is 2^-127, 255 is inf), then cvt.rn to bf16."""
    from dsflash import quant
    pe = _ptx_emu()
    s = np.asarray(scale_bytes, np.uint32)
    sc = np.where(s == 0, np.float32(2.0 ** -127), (s << 23).view(np.float32)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        prod = quant.E2M1_VALUES[np.asarray(codes)] * sc
    return pe.bf16_rne_bits(prod.astype(np.float64))


def test_ptx_emulator_against_the_il_moe_decode():
    """The emulator (scripts/ptx_emu.py) on the il MoE decode's asm (moe_layout.IL_ASM: and / shl / shr / or /
    mul.rn.bf16x2) against a numpy evaluation of the same bit formulas (moe_layout.decode's), random words, every
    scale the layout allows: a check of the emulator itself."""
    from dsflash.kernels import moe_layout
    pe = _ptx_emu()
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    s = rng.integers(0, moe_layout.MAX_SCALE + 1, 4096).astype(np.uint32)
    scale = np.where(s == 0, 0, (s + 126) << 7).astype(np.uint32) * np.uint32(0x10001)
    got = pe.run(moe_layout.IL_ASM, {"$4": words, "$5": scale}, 4)
    v = words
    pieces = [v & 0x81C081C0, (v << 3) & 0x81C081C0, (v << 6) & 0x81C081C0,
              ((v >> 4) & 0x00C000C0) | ((v >> 5) & 0x01000100) | ((v << 1) & 0x80008000)]
    f = np.where(s == 0, 0.0, 2.0 ** (s.astype(np.float64) - 1))
    for k in range(4):
        for half in (0, 16):
            want = pe.bf16_rne_bits(pe.bf16_value((pieces[k] >> half) & 0xFFFF) * f)
            assert np.array_equal((got[k] >> half) & 0xFFFF, want), (k, half)


def test_table_decode_asm_matches_the_default_on_every_code_and_scale():
    """``indexer_paged_triton.KTAB_ASM`` (the GPU form of KEY_DECODE "table"), run in the PTX emulator, gives the
    default decode's bf16 bits for every packed byte (all 16 codes in both nibbles) with every scale byte 0-255 --
    the subnormal 2^-127 (s 0) and 2^-126 x 0.5 (s 1), the overflow to inf (s 254, codes >= 2), inf (s 255) and
    0 x inf = NaN (canonical 0x7FFF both: the fp32 product's cvt and the bf16x2 multiply) -- with each byte of a
    word under its own scale byte (the kernel's words share one)."""
    from dsflash.kernels import indexer_paged_triton as ipt
    pe = _ptx_emu()
    b, s = np.meshgrid(np.arange(256, dtype=np.uint32), np.arange(256, dtype=np.uint32), indexing="ij")
    b, s = b.reshape(-1), s.reshape(-1)
    # 4 (byte, scale) pairs a word; rotate the pairs so that every pair also sits in every byte position
    for rot in range(4):
        bb, ss = np.roll(b, rot).reshape(-1, 4), np.roll(s, rot).reshape(-1, 4)
        word = (bb << np.array([0, 8, 16, 24], np.uint32)).sum(axis=1, dtype=np.uint64).astype(np.uint32)
        sw = (ss << np.array([0, 8, 16, 24], np.uint32)).sum(axis=1, dtype=np.uint64).astype(np.uint32)
        out = pe.run(ipt.KTAB_ASM, {"$4": word, "$5": sw}, 4)
        # $0 / $1: low nibbles of bytes 0-1 / 2-3, $2 / $3: high nibbles; element 0 of a pair in the low half
        got = np.stack([out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16,
                        out[2] & 0xFFFF, out[2] >> 16, out[3] & 0xFFFF, out[3] >> 16], axis=1)
        want = np.concatenate([_default_decode_bits(bb & 0xF, ss), _default_decode_bits(bb >> 4, ss)], axis=1)
        assert np.array_equal(got, want), np.argwhere(got != want)[:5]
    assert _default_decode_bits(np.array([1]), np.array([0]))[0] == 0x0020      # the model keeps subnormals
    assert _default_decode_bits(np.array([0]), np.array([255]))[0] == 0x7FFF    # 0 x inf


def test_paired_round_asm_is_the_per_element_rounding():
    """``indexer_paged_triton.PAIR_ASM`` (PAIRED_ROUND on the GPU: cvt.rn.bf16x2.f32 + shift / mask), emulated,
    rounds each of its two fp32 inputs as the per-element cvt.rn.bf16.f32 (RNE, subnormals kept, overflow to inf,
    NaN -> 0x7FFF) and returns element 0 in $0: random bit patterns plus ties, the overflow edge, subnormals, +-0,
    +-inf, NaNs."""
    from dsflash.kernels import indexer_paged_triton as ipt
    pe = _ptx_emu()
    rng = np.random.default_rng(1)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x7F7FFFFF,
                        0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x00000001, 0x807FFFFF, 0x3F808000,
                        0x3F818000, 0xBF808000, 0x3F80FFFF], np.uint32)
    x = np.concatenate([rng.integers(0, 2 ** 32, 100000, dtype=np.uint64).astype(np.uint32), special])
    a, b = x, np.roll(x, 1)
    out = pe.run(ipt.PAIR_ASM, {"$2": a, "$3": b}, 2)
    for got, inp in ((out[0], a), (out[1], b)):
        with np.errstate(invalid="ignore"):
            want = pe.bf16_rne_bits(inp.view(np.float32).astype(np.float64)).astype(np.uint32) << 16
        assert np.array_equal(got, want)


def test_switches_reach_the_launch(monkeypatch):
    """The module switches become the launch's constexprs (KTAB, PAIR, RELU1; all 1 by default since session 30's
    H100 run, 0 = the fp32 forms the kernel had before them) and an unknown KEY_DECODE is refused."""
    pytest.importorskip("triton")
    from dsflash.kernels import indexer_paged_triton as ipt
    assert ipt.switch_constexprs() == dict(KTAB=1, PAIR=1, RELU1=1)
    monkeypatch.setattr(ipt, "KEY_DECODE", "where")
    monkeypatch.setattr(ipt, "PAIRED_ROUND", False)
    monkeypatch.setattr(ipt, "RELU_ONE_COMPARE", False)
    assert ipt.switch_constexprs() == dict(KTAB=0, PAIR=0, RELU1=0)
    q = jnp.zeros((1, 2, 16, 64), jnp.bfloat16)
    pool = {"q": jnp.zeros((64, 32), jnp.uint8), "s": jnp.zeros((64, 2), jnp.uint8)}
    _, const, _, _ = ipt.kernel_args(q, jnp.zeros((1, 2, 16)), pool, jnp.zeros((1, 1), jnp.int32), 64,
                                     jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), bool), None)
    assert (const["KTAB"], const["PAIR"], const["RELU1"]) == (0, 0, 0)
    monkeypatch.setattr(ipt, "KEY_DECODE", "lut")
    with pytest.raises(ValueError):
        ipt.switch_constexprs()


SWITCH_CHECKS = ["decode-all", "kernel-table-0", "kernel-table-1", "kernel-relu1-0", "kernel-relu1-1", "kernel-all-0",
                 "kernel-all-1"]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("name", SWITCH_CHECKS)
def test_switches_in_the_interpreter(name):
    """scripts/triton_interpret_indexer_paged_switches.py, one check in a fresh process (re-run once on failure:
    the interpreter flake of NOTES "Known flake", as interpret_isolation does): the key decode of every byte x scale
    byte with KTAB 1 == KTAB 0, and whole-kernel scores with each switch bit-identical to the default on inputs
    with NaN / inf and extreme scale bytes."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "triton_interpret_indexer_paged_switches.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    outs = []
    for attempt in range(2):
        r = subprocess.run([sys.executable, script, "--check", name], env=env, cwd=root, capture_output=True,
                           text=True, timeout=300)
        outs.append(r.stdout + r.stderr[-1500:])
        if r.returncode == 0:
            if attempt:
                print(f"RETRIED {name}: failed once, passed in a fresh process (interpreter flake)")
            print(r.stdout)
            return
    raise AssertionError(f"{name} failed twice:\n" + "\n----\n".join(outs))
