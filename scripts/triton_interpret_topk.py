"""CPU check of the Triton exact top-k (``topk_triton._topk_kernel``) in Triton's interpreter.

Runs the kernel on numpy buffers with the launch's own arguments (``kernel_args``) and compares, bit for bit, with
the lax.top_k references (``indexer_topk.select_topk_sorted``, and ``topk_select.topk_mask`` for the mask mode) on
the fuzz rows of tests/test_topk_select.py (ties, bf16 values, -inf masks, +-NaN, +-0.0, +-inf, all-masked rows,
visible limits, T < topk, T not a multiple of the 4K tile), 32- and 16-bit keys (16: bf16-valued rows only).
Usage: python scripts/triton_interpret_topk.py   (needs `pip install triton`; exits 1 on a mismatch)"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from triton_interpret_moe import Fake  # noqa: E402
from test_topk_select import _batch  # noqa: E402
from dsflash.kernels import indexer_topk as ik, topk_select as ts, topk_triton as tt  # noqa: E402


def run(score, visible, k, key_bits, mode):
    rows, const, grid, _ = tt.kernel_args(score, k, key_bits=key_bits, mode=mode)
    R, T = rows.shape
    vis = np.broadcast_to(np.asarray(visible), score.shape[:-1]).reshape(-1).astype(np.int32)
    out = np.zeros((R, k) if mode == 0 else (R, T), np.int32 if mode == 0 else np.int8)
    tt._topk_kernel[grid](Fake(np.asarray(rows)), Fake(vis), Fake(out), **const)
    return out.reshape(*score.shape[:-1], -1)


CASES = [  # T, topk, key_bits, kinds, B
    (1, 1, 32, ("ties", "bf16", "normal"), 6),
    (5, 8, 32, ("ties", "bf16", "normal"), 6),
    (37, 8, 32, ("ties", "bf16", "normal"), 9),
    (100, 7, 32, ("ties", "bf16", "normal"), 9),
    (300, 40, 32, ("ties", "bf16", "normal"), 6),
    (3000, 512, 32, ("ties",), 2),                     # heavy ties across the threshold
    (5000, 512, 32, ("ties", "bf16", "normal"), 3),    # two 4K tiles, the second partial
    (300, 40, 16, ("bf16",), 6),                       # 16-bit keys on bf16-valued scores
    (5000, 512, 16, ("bf16",), 2),
]


def main():
    bad = 0
    for i, (T, topk, kb, kinds, B) in enumerate(CASES):
        score, visible = _batch(1000 + i, T, B=B, S=2, kinds=kinds)
        k = min(topk, T)
        want = np.asarray(ik.select_topk_sorted(score, visible, topk))
        got = run(score, visible, k, kb, 0)
        ok_sel = np.array_equal(got, want)
        want_m = np.asarray(ts.topk_mask(score, k))
        got_m = run(score, visible, k, kb, 1) != 0
        ok_mask = np.array_equal(got_m, want_m)
        print(f"{'ok  ' if ok_sel and ok_mask else 'FAIL'} case {i} T{T} k{k} key_bits {kb} {kinds} B{B}: "
              f"select {'equal' if ok_sel else f'{int((got != want).sum())} slots differ'}, "
              f"mask {'equal' if ok_mask else f'{int((got_m != want_m).sum())} entries differ'}", flush=True)
        bad += not (ok_sel and ok_mask)
    print("FAILED" if bad else "all ok")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
