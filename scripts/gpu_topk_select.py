"""The sort-free top-k (kernels/topk_select.py) against lax.top_k on one device, in pieces and in variants (digit
width, 16-bit keys, stacked / sibling counts), each checked for equal outputs on its data. JSON in $OUT/topk_select.json. From the repo root:

  python3 scripts/gpu_topk_select.py --contexts 32768 131072 --seqs 32 --rows 6 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from gpu_indexer_split import timed

    from dsflash.kernels import indexer_topk as ik
    from dsflash.kernels import topk_select as ts

    topk, B, S = 512, a.seqs, a.rows
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(a), "points": []}
    for T in a.contexts:
        score = jax.random.normal(jax.random.PRNGKey(T), (B, S, T), jnp.float32).astype(jnp.bfloat16)
        score = score.astype(jnp.float32)
        visible = jnp.full((B, S), T, jnp.int32).at[:, -1].set(T // 2)
        k = min(topk, T)
        sel = {"sorted": lambda s: ik.select_topk_sorted(s, visible, topk),
               "radix": lambda s: ts.select_topk_threshold(s, visible, topk),           # DIGIT_BITS (2)
               "radix4": lambda s: ts.select_topk_threshold(s, visible, topk, digit_bits=4),
               "radix4_sibling": lambda s: ts.select_topk_threshold(s, visible, topk, digit_bits=4,
                                                                    counts="sibling"),
               "radix2_sibling": lambda s: ts.select_topk_threshold(s, visible, topk, digit_bits=2,
                                                                    counts="sibling"),
               "radix1": lambda s: ts.select_topk_threshold(s, visible, topk, digit_bits=1),
               "radix8": lambda s: ts.select_topk_threshold(s, visible, topk, digit_bits=8),
               "radix_key16": lambda s: ts.select_topk_threshold(s, visible, topk, key_bits=16)}
        parts = {"pass_over_scores": lambda s: jnp.max(s, axis=-1),
                 "kth_key2": lambda s: ts.kth_largest_key(ts.total_order_key(s), k, digit_bits=2),
                 "kth_key4": lambda s: ts.kth_largest_key(ts.total_order_key(s), k, digit_bits=4),
                 "topk_mask": lambda s: ts.topk_mask(s, k),
                 "cumsum": lambda s: jnp.cumsum(s > 1.0, axis=-1, dtype=jnp.int32),
                 "compact": lambda s: ts.compact_ascending(s > 2.9, k)}
        cand = {"cand_sorted": lambda s: ik.candidate_mask_sorted(s, visible, 8, 2048),
                "cand_radix": lambda s: ts.candidate_mask_threshold(s, visible, 8, 2048),
                "cand_radix4": lambda s: ts.candidate_mask_threshold(s, visible, 8, 2048, digit_bits=4),
                "cand_radix4_sibling": lambda s: ts.candidate_mask_threshold(s, visible, 8, 2048, digit_bits=4,
                                                                             counts="sibling")}
        row = {"T": T, "B": B, "S": S, "ms": {}, "mismatch": {}}
        for group, ref in ((sel, "sorted"), (parts, None), (cand, "cand_sorted")):
            fns = {n: jax.jit(f) for n, f in group.items()}
            want = None if ref is None else np.asarray(fns[ref](score))
            for n, fn in fns.items():
                try:
                    row["ms"][n] = timed(fn, score, reps=a.reps)
                    if want is not None:
                        row["mismatch"][n] = int(np.sum(np.asarray(fn(score)) != want))
                except Exception as e:  # noqa: BLE001
                    row["ms"][n] = repr(e)[:300]
        res["points"].append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(a.out, "topk_select.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
