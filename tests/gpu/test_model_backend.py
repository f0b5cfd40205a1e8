"""The whole model with ``RunOptions.backend="triton"`` against ``"xla"`` on the GPU (issue 6, "Done when"): the tiny
config's random weights in the checkpoint's stored formats (FP8 dense, MXFP4 experts), prefill logits of fresh
random prompts at the two served precisions.

Two kernel sets: "shipped" is what ``backend="triton"`` runs as released -- the routed-expert MoE GEMM at every
layer, the indexer scoring (only one-row scoring over <= 8K entries stays on XLA), sparse attention at >= 128 query
rows (the prompts here are 3 x 160 rows) and mHC at every size -- the crossover tables of kernels/dispatch.py
(``dispatch.GATES``); "moe_indexer" switches the last two back to XLA (the set measured before 2026-12-01).
The test checks that the kernels were really reached (trace-time call counts), so a dispatch that silently fell
back to XLA fails.

Tolerance: the kernels compute the same function with the same roundings but a different fp32 accumulation order,
so a rare FP8 / bf16 rounding of an intermediate lands on the other side and the difference propagates through the
layers: relative Frobenius error of the logits < 2e-2 and the same argmax at >= 97 % of positions (both measured
values are printed). At "bf16" (no FP8 round trips, every activation bf16) the two backends' difference is bf16
rounding noise amplified by the random tiny model: 1.65e-2 with the earlier kernels, 1.98e-2 with the swapped-
operand ones (H200, 2026-11-30), so a fixed bound there says little. Instead both backends are compared with the
fp32 model (XLA): the Triton logits must be as close to it as XLA's own bf16 logits are (within 25 %; on CPU the
XLA bf16 logits are 13.6 % from the fp32 ones), the two backends within 5e-2 of each other, and agreeing on the
argmax as above.

With the "shipped" set the fixed bounds cannot hold: sparse attention v3 rounds P to bf16 against a running max
(a different, equally valid rounding; ``sparse_attention_triton.flash_bound``) and mHC's coefficients differ from
XLA's by ~1e-6, and this random model amplifies even 1e-7 of coefficient noise to 1.7e-1 in the logits (CPU;
H200 2026-12-01: shipped vs xla 1.44e-1 / argmax 0.825 at "reference"). So there both backends are judged against
the fp32 model only: Triton within 25 % of XLA's error and within 5 points of its argmax agreement. The demo model
(tests/gpu/test_model_mhc_kernel.py) is the better-conditioned check of the same set.
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny():
    import dsflash
    return dsflash.load("tiny")


@pytest.mark.parametrize("kernels", ["shipped", "moe_indexer"])
@pytest.mark.parametrize("precision", ["reference", "bf16"])
def test_tiny_model_logits_match_the_xla_backend(tiny, kernel_calls, precision, kernels, monkeypatch):
    from dsflash.kernels import dispatch
    if kernels == "moe_indexer":
        for k in ("sparse_attention", "mhc"):
            monkeypatch.setitem(dispatch.GATES, k, dispatch.GATES[k].replace(triton=()))
    rng = np.random.default_rng(7)
    tokens = rng.integers(16, tiny.cfg.vocab_size, size=(3, 160)).astype(np.int32)
    got = tiny.logits(tokens, backend="triton", precision=precision)
    # 480 rows: above the FP8 dense linear's 384-row band (test_fp8_linears_in_the_model covers it)
    reached = {k: v for k, v in kernel_calls.items()
               if (kernels == "shipped" and k != "fp8_linear") or k in ("moe", "indexer")}
    assert kernel_calls["fp8_linear"] == 0
    assert min(reached.values()) >= 1, kernel_calls
    want = tiny.logits(tokens, backend="xla", precision=precision)
    assert got.shape == want.shape and np.isfinite(got).all()
    rel, agree = _rel(got, want), _agree(got, want)
    print(f"tiny, {precision}, {kernels}: logits rel err {rel:.2e}, argmax agreement {agree:.4f}, kernel traces {kernel_calls}")
    ideal = tiny.logits(tokens, backend="xla", precision="fp32")
    err_triton, err_xla = _rel(got, ideal), _rel(want, ideal)
    top_triton, top_xla = _agree(got, ideal), _agree(want, ideal)
    print(f"tiny, {precision}, {kernels}, vs the fp32 model: rel triton {err_triton:.2e}, xla {err_xla:.2e}; argmax "
          f"agreement triton {top_triton:.4f}, xla {top_xla:.4f}")
    if kernels == "shipped":
        # the random tiny model turns ulp-sized differences into flipped FP8 / bf16 roundings and top-k choices
        # (module docstring), so with attention and mHC on Triton it is judged against the fp32 model only
        assert err_triton < 1.25 * err_xla, (err_triton, err_xla)
        assert top_triton >= top_xla - 0.05, (top_triton, top_xla)
        return
    assert agree >= 0.97
    if precision == "reference":
        assert rel < 2e-2
        return
    assert err_triton < 1.25 * err_xla, (err_triton, err_xla)
    assert rel < 5e-2       # a plain sanity bound as well (2.5x the largest difference measured)


@pytest.mark.parametrize("precision", ["reference", "bf16"])
def test_fp8_linears_in_the_model(tiny, kernel_calls, precision, monkeypatch):
    """2 x 96 rows (inside the FP8 dense linear's band): the model with the FP8 linear kernel (and MoE, indexer; attention
    and mHC held on XLA, as "moe_indexer") against the same without it and against the fp32 model. Judged as the
    module docstring says for "bf16": as close to the fp32 model as XLA's own logits (within 25 %), argmax within 5
    points; the difference the FP8 kernel alone makes is printed (not bounded: unmeasured before this test)."""
    from dsflash.kernels import dispatch
    for k in ("sparse_attention", "mhc"):
        monkeypatch.setitem(dispatch.GATES, k, dispatch.GATES[k].replace(triton=()))
    tokens = np.random.default_rng(11).integers(16, tiny.cfg.vocab_size, size=(2, 96)).astype(np.int32)
    got = tiny.logits(tokens, backend="triton", precision=precision)
    assert kernel_calls["fp8_linear"] >= 1 and kernel_calls["moe"] >= 1, kernel_calls
    monkeypatch.setitem(dispatch.GATES, "fp8_linear", dispatch.GATES["fp8_linear"].replace(triton=()))
    jax.clear_caches()
    without = tiny.logits(tokens, backend="triton", precision=precision)
    want = tiny.logits(tokens, backend="xla", precision=precision)
    ideal = tiny.logits(tokens, backend="xla", precision="fp32")
    assert np.isfinite(got).all()
    err_k, err_xla = _rel(got, ideal), _rel(want, ideal)
    print(f"tiny, {precision}, fp8 linears: vs without them rel {_rel(got, without):.2e} argmax "
          f"{_agree(got, without):.4f}; vs xla {_rel(got, want):.2e}; vs fp32 kernel {err_k:.2e} xla {err_xla:.2e}; "
          f"traces {kernel_calls}")
    assert err_k < 1.25 * err_xla, (err_k, err_xla)
    assert _agree(got, ideal) >= _agree(want, ideal) - 0.05


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _agree(a, b):
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))
