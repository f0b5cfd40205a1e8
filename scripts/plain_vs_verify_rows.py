"""Where the plain decode forward (1 row per sequence) and the verify forward (1 + block rows) round a row
differently: same model state, same tokens, logits and every recorded intermediate of row 0 compared bitwise.

  PYTHONPATH=. python scripts/plain_vs_verify_rows.py [--model demo] [--precision reference] [--batch 8]
      [--context 100] [--trials 6]

Prompts are the demo model's held-out rows (random ids for other vocabularies). Prints, per differing trial, the
sequences and the first intermediate (in trace order) whose row 0 differs. Found 2026-12-02 (CPU, jax 0.10.2, demo,
reference, batch 8): trials 4 and 5; first difference ``engram.inject`` (one bf16 ulp from its fp32 reductions over
d, whose XLA CPU loop order depends on the op's row count), then everything after it.
"""
import argparse
import importlib

import jax
import jax.numpy as jnp
import numpy as np

import dsflash
from dsflash.model.params import dequantized_weights
from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch

F = importlib.import_module("dsflash.model.forward")
TRACED = [(F, "engram_step"), (F.engram, "inject"), (F.mhc, "pre_mix"), (F.mhc, "post_mix"), (F, "csa_attention"),
          (F, "moe"), (F, "block")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--precision", default="reference")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--trials", type=int, default=6)
    a = ap.parse_args()
    m = dsflash.load(a.model, precision=a.precision)
    cfg, params = m.cfg, dequantized_weights(m.cfg, m.params) or m.params      # as the engine runs on CPU
    B, n, K1 = a.batch, a.context, cfg.dspark_block_size + 1
    page = 64
    pages = -(-(n + K1) // page)
    geo = CacheGeometry(num_slots=B, num_pages=B * pages, page_size=page)
    opts = RunOptions(precision=a.precision, logits="all", page_size=page)
    rec, names = [], []
    for mod, nm in TRACED:
        def wrap(*args, _f=getattr(mod, nm), _nm=nm, **kw):
            out = _f(*args, **kw)
            rec.append((_nm, out))
            return out
        setattr(mod, nm, wrap)

    def fwd(params, batch, state):
        rec.clear()
        out, st = F.forward(params, cfg, batch, state, opts)
        names[:] = [k for k, _ in rec]
        return out["logits"], st, [jax.tree.leaves(v)[0] for _, v in rec]
    fj = jax.jit(fwd)
    from dsflash.api import SHIPPED
    rows = np.load(SHIPPED["demo"] + "/heldout_rows.npy").astype(np.int32) if a.model == "demo" else None
    for t in range(a.trials):
        rng = np.random.default_rng(t)
        toks = rows[t * B:(t + 1) * B, :n + K1] if rows is not None else \
            rng.integers(4, cfg.vocab_size, size=(B, n + K1)).astype(np.int32)
        lg, st0, _ = fj(params, make_batch(toks[:, :n], pages_per_seq=pages), init_state(cfg, geo, a.precision))
        res = {}
        for k in (1, K1):       # row 0 is the same token at the same position on the same state
            chunk = np.concatenate([np.asarray(jnp.argmax(lg[:, n - 1], -1))[:, None], toks[:, n + 1:n + k]], 1)
            o, _, inter = fj(params, make_batch(chunk.astype(np.int32), start=[n] * B, lengths=[k] * B,
                                                pages_per_seq=pages), jax.tree.map(jnp.copy, st0))
            res[k] = (np.asarray(o)[:, 0], [np.asarray(x).reshape(B, k, *x.shape[2:])[:, 0] for x in inter])
        (la, ia), (lb, ib) = res[1], res[K1]
        if np.array_equal(la, lb):
            continue
        seqs = np.nonzero((la != lb).any(-1))[0].tolist()
        first = next((f"{names[i]} (call {i})" for i in range(len(ia)) if not np.array_equal(ia[i], ib[i])), None)
        print(f"trial {t}: row 0 logits differ for sequences {seqs} (max {np.abs(la - lb).max():.3g}); "
              f"first differing intermediate: {first}")
    print("done")


if __name__ == "__main__":
    main()
