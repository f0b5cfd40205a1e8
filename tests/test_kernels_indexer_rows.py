"""The indexer scorer's row form (prefill; ``indexer_topk_triton._indexer_score_rows_kernel``) on a CPU host: which
form a call runs, the row form's bits against the tile form's in Triton's interpreter (and a mutant that skips one
tile too many, which must be caught), and its sm_90 compile at bench-4l-96e's real shapes (Hi 32, Di 128). Also the
opt-in hardware bf16 rounding (``hw_round``): its plumbing, its NaN select in the interpreter, and its sm_90 compile.
Skipped where triton is not installed (CI). ~20 s on 2 cores; the full set of interpreter cases is
``scripts/triton_interpret_indexer.py`` (checks ``rows_*`` and ``mutant_*``)."""
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from dsflash.kernels import indexer_topk_triton as it  # noqa: E402


class _FakeJt:
    def __init__(self):
        self.calls = []

    def triton_call(self, *args, kernel, out_shape, grid, num_warps, num_stages, **kw):
        self.calls.append(dict(kernel=kernel, grid=grid, num_warps=num_warps, **kw))
        return jnp.zeros(out_shape.shape, out_shape.dtype)


def _launch(monkeypatch, B, S, T, Hi=32, Di=128, dtype=jnp.bfloat16, **kw):
    from dsflash.kernels import triton_call
    jt = _FakeJt()
    monkeypatch.setattr(triton_call, "jax_triton", lambda: jt)
    sds = jax.ShapeDtypeStruct
    jax.eval_shape(lambda q, w, k, v, m: it.indexer_scores_triton(q, w, k, v, m, **kw),
                   sds((B, S, Hi, Di), dtype), sds((B, S, Hi), dtype), sds((B, T, Di), dtype),
                   sds((B, S), jnp.int32), sds((B, S), bool))
    (call,) = jt.calls
    return call


def test_prefill_calls_run_the_row_form(monkeypatch):
    dec = _launch(monkeypatch, 32, 6, 16384)                      # decode + 5 drafts: the tile form, as measured
    assert dec["kernel"] is it._indexer_score_kernel and dec["grid"] == (32 * 2, 128)
    big = _launch(monkeypatch, 1, 16384, 16384)                   # bench-4l-96e's 16K prefill, ratio-1 layer
    assert big["kernel"] is it._indexer_score_rows_kernel
    assert big["grid"] == (4096, 1) and big["TPS"] == 128 and (big["BS"], big["BT"], big["num_warps"]) == (4, 128, 8)
    few = _launch(monkeypatch, 1, 16, 16384)                      # few rows: entries split so programs stay many
    assert few["kernel"] is it._indexer_score_rows_kernel and few["grid"] == (4, 128) and few["TPS"] == 1
    mid = _launch(monkeypatch, 1, 1024, 4096)                     # 256 row blocks x 4 splits of 8 tiles
    assert mid["grid"] == (256, 4) and mid["TPS"] == 8
    forced = _launch(monkeypatch, 1, 4096, 4096, form="tiles")
    assert forced["kernel"] is it._indexer_score_kernel and forced["grid"] == (1024, 32)
    with pytest.raises(ValueError, match="form"):
        _launch(monkeypatch, 1, 64, 256, form="row")


def test_hw_round_is_the_default_off_the_interpreter_and_reaches_both_forms(monkeypatch):
    """``hw_round`` (hardware bf16 rounding; GPU bit-identity test passed 2026-12-06) is on by default where it can
    run, reaches the kernel as HW_ROUND 1 in both forms, can be turned off, is ignored for fp32 inputs (no rounding
    there), and in Triton's interpreter is off by default and refused when asked (its casts truncate: it would
    neither run nor check the hardware path)."""
    for S, kernel in ((6, it._indexer_score_kernel), (4096, it._indexer_score_rows_kernel)):
        off = _launch(monkeypatch, 1, S, 4096, hw_round=False)
        on = _launch(monkeypatch, 1, S, 4096, hw_round=True)
        default = _launch(monkeypatch, 1, S, 4096)
        assert off["kernel"] is on["kernel"] is default["kernel"] is kernel and off["grid"] == on["grid"]
        assert off["HW_ROUND"] == 0 and on["HW_ROUND"] == 1 and on["ROUND"] == 1
        assert default["HW_ROUND"] == it.HW_ROUND_DEFAULT == 2      # the convert alone (GPU test passed, session 22)
        assert _launch(monkeypatch, 1, S, 4096, hw_round=2)["HW_ROUND"] == 2
    monkeypatch.setattr(it, "HW_ROUND_DEFAULT", 1)
    assert _launch(monkeypatch, 1, 64, 256)["HW_ROUND"] == 1
    with pytest.raises(ValueError, match="hw_round"):
        _launch(monkeypatch, 1, 64, 256, hw_round=3)
    f32 = _launch(monkeypatch, 1, 64, 256, dtype=jnp.float32, hw_round=2)
    assert f32["HW_ROUND"] == 0 and f32["ROUND"] == 0
    assert it.hw_round_supported()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not it.hw_round_supported()
    for hw in (True, 2):
        with pytest.raises(ValueError, match="interpreter"):
            _launch(monkeypatch, 1, 64, 256, hw_round=hw)
    assert _launch(monkeypatch, 1, 64, 256)["HW_ROUND"] == 0          # the default runs there, integer rounding


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cc"))


@pytest.mark.parametrize("check", ["rows_prefill", "mutant_skip_one_more", "hw_nan_bits"])
def test_rows_form_in_the_interpreter(check, jax_cache):
    """rows_prefill: 37 rows (not a multiple of 4) of two sequences (starts 0 and 100), T 300 (not a multiple of
    128), 3 padding rows: the row form's scores are the tile form's bits and the reference's, with tiles skipped and
    partly masked ones computed. The mutant computes one tile fewer per block: the same check must fail on it (the
    script asserts that). hw_nan_bits: hw_round's NaN select gives ``_bf16_rne``'s bits (the rest of that path is
    GPU-only). One fresh process per check, re-run once on failure (the interpreter flake, NOTES.md)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1", JAX_COMPILATION_CACHE_DIR=jax_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "triton_interpret_indexer.py"), "--check", check]
    for attempt in range(2):
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        print(r.stdout)
        if r.returncode == 0:
            break
    if attempt:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        warnings.warn(f"interpreter check {check} passed on a re-run (flake?)")
    out = r.stdout
    want = "caught" if check.startswith("mutant") else "NaN patterns give _bf16_rne's bits" if check == "hw_nan_bits" \
        else "bit-identical to the tile form True"
    assert want in out, out


SIG = dict(q_ptr="*bf16", w_ptr="*bf16", k_ptr="*bf16", lim_ptr="*i32", cand_ptr="*i8", o_ptr="*fp32")
BASE = dict(S=16384, T=16384, Hi=32, Di=128, BS=4, BT=128, HAS_CAND=0, ROUND=1, IEEE=0)


def _ttgir_layouts(fn, consts):
    """(MMA accumulator layout, head-sum reshape's input and output layouts) of ``fn``'s TTGIR for sm_90: what fixes
    the MMA and the head sum's reduction tree, so two kernels with the same three give the same sums."""
    import re

    import triton

    import sm90_compile as sc
    full, attrs = {}, {}
    for i, p in enumerate(fn.params):
        full[p.name] = SIG.get(p.name, "constexpr")
        if p.name in SIG:
            attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {p.name: consts.get(p.name, p.default) for p in fn.params if p.name not in SIG}
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                       target=sc.TARGET, options=dict(num_warps=8, num_stages=2))
    g = k.asm["ttgir"]
    lay = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]*)$", g, re.M))
    dot = re.search(r"ttng\.warp_group_dot .*-> tensor<128x128xf32, (#\w+)>", g)
    resh = re.search(r"tt\.reshape .*: tensor<128x128xf32, (#\w+)> -> tensor<4x32x128xf32, (#\w+)>", g)
    head_sum = re.search(r"\"tt\.reduce\"\(%\w+\) <\{axis = 1 : i32\}>", g)
    assert dot and resh and head_sum, fn
    return lay[dot.group(1)], lay[resh.group(1)], lay[resh.group(2)]


def test_rows_form_compiles_for_sm90_like_the_tile_form():
    """bench-4l-96e's 16K prefill (Hi 32, Di 128, BS 4, BT 128, 8 warps): the row form's loop runs the tile form's
    MMA (wgmma, same accumulator layout) and head sum (same reshape layout, reduced over the same axis), so its
    scores are the same bits on the GPU too; no spills and <= 128 registers (2 blocks of 8 warps per SM)."""
    import sm90_compile as sc
    tiles = _ttgir_layouts(it._indexer_score_kernel, BASE)
    rows = _ttgir_layouts(it._indexer_score_rows_kernel, dict(BASE, TPS=128))
    assert tiles == rows and "versionMajor = 3" in rows[0], (tiles, rows)
    for cand in (0, 1):
        r = sc.compile_kernel(it._indexer_score_rows_kernel, SIG, dict(BASE, TPS=128, HAS_CAND=cand), num_warps=8,
                              num_stages=2)
        assert r.spill_stores == 0 and r.spill_loads == 0, r.ptxas_log[-300:]
        assert r.regs <= 128, r.regs                   # 128 / 103 with triton 3.6.0
        lp = r.main_loop
        assert lp.ops["HGMMA"] == 8 and lp.ops["LDGSTS"] > 0, dict(lp.ops)   # one 128x128x128 MMA, keys prefetched
        assert lp.n < 2464, lp.n                       # the tile form's whole program: 2464 (loop: 2245 / 2071)


# The row form's loop with hw_round (HW_ROUND 1), SASS per warp per tile: 1,472 with triton 3.6.0 (integer path
# 2,245; the convert alone, HW_ROUND 2, 1,025; the NaN select done in fp32 after widening, 1,699). The bound is
# the measured count + ~9 % for compiler drift, and below 1,699 so a regression to the costlier select shows; the
# GPU prediction (NOTES.md, "Hardware bf16 rounding") assumes a loop of at most this.
HW_LOOP_MAX = 1600


def test_hw_round_compiles_for_sm90():
    """The hardware-rounding path (``hw_round=True``) at the 16K prefill's shapes. Bits: the narrowing is PTX
    ``cvt.rn.bf16.f32`` / ``cvt.rn.bf16x2.f32`` only (round to nearest even; no .ftz, .relu or .satfinite: subnormals
    kept, overflow to inf, as ``_bf16_rne``), no .ftz anywhere in the kernel, every bf16 -> fp32 widening a bit move
    (no F2F.F32.BF16 in the SASS: the NaN bits selected in bf16 reach fp32 unchanged), and the MMA and head-sum
    layouts are the integer path's (same sums). Cost: no spills, <= 128 registers, loop < HW_LOOP_MAX, and the
    convert alone (HW_ROUND 2, opt-in ``hw_round=2``) is shorter still (what the NaN exactness costs)."""
    import re

    import sm90_compile as sc
    rows = dict(BASE, TPS=128)
    int_lay = _ttgir_layouts(it._indexer_score_rows_kernel, rows)
    assert _ttgir_layouts(it._indexer_score_rows_kernel, dict(rows, HW_ROUND=1)) == int_lay
    assert _ttgir_layouts(it._indexer_score_kernel, dict(BASE, HW_ROUND=1)) == int_lay
    n = {}
    for hw in (0, 1, 2):
        r = sc.compile_kernel(it._indexer_score_rows_kernel, SIG, dict(rows, HW_ROUND=hw), num_warps=8, num_stages=2)
        assert r.spill_stores == 0 and r.spill_loads == 0, (hw, r.ptxas_log[-300:])
        assert r.regs <= 128, (hw, r.regs)             # 128 / 100 / 100 with triton 3.6.0
        assert ".ftz" not in r.ptx, hw
        assert "F2F.F32.BF16" not in r.sass, hw
        narrow = re.findall(r"\bcvt(?:\.\w+)*\.bf16(?:x2)?\.f32\b", r.ptx)
        if hw:
            assert narrow and set(narrow) <= {"cvt.rn.bf16.f32", "cvt.rn.bf16x2.f32"}, (hw, set(narrow))
            assert r.main_loop.ops["F2F"] + r.main_loop.ops["F2FP"] > 0, dict(r.main_loop.ops)
        else:
            assert not narrow, set(narrow)              # the integer path stays integer
        assert r.main_loop.ops["HGMMA"] == 8, (hw, dict(r.main_loop.ops))
        n[hw] = r.main_loop.n
    print(f"row form loop SASS per warp per tile: integer {n[0]}, hw_round {n[1]}, convert alone {n[2]}")
    assert n[2] < n[1] <= HW_LOOP_MAX < n[0], n
    t = {hw: sc.compile_kernel(it._indexer_score_kernel, SIG, dict(BASE, HW_ROUND=hw), num_warps=8, num_stages=2)
         for hw in (0, 1)}                              # the tile form (decode) too: whole program 2,464 -> 1,920
    assert t[1].spill_stores == 0 and t[1].regs <= 128 and sum(t[1].ops.values()) < sum(t[0].ops.values())
