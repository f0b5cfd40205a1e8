"""Where the long-context indexer's time goes (issue 19): the pieces of one index-source layer's decode call timed
apart on the GPU -- the gather + decode of every MXFP4 index key through the page table, the Triton scorer, the
top-512 selection (``lax.top_k`` + sort, and the sort-free threshold path of kernels/topk_select.py: ``*_radix_ms``,
with a mismatch count that must be 0; the Triton radix top-k of kernels/topk_triton.py: ``*_triton{32,16}_ms``),
layer 20's candidate filter (top-2048 of 8-entry blocks, both paths) and the
paged scorer that reads the packed keys through the page table instead of the gather + scorer. One call,
a table last, JSON in $OUT/indexer_split.json. From the repo root:

  python3 scripts/gpu_indexer_split.py --contexts 4096 32768 131072 --seqs 32 --rows 6 --out $OUT

The paged scorer's variants (session 30: indexer_paged_triton.KEY_DECODE / PAIRED_ROUND / RELU_ONE_COMPARE; all three
on by default since session 30; where / unpaired / relu_nan set each back), timed after the default and checked bit
for bit against it (the fp32 forms, i.e. the kernel before session 30, then the default's own parts):

  python3 scripts/gpu_indexer_split.py --contexts 131072 --seqs 32 --rows 6 --page-size 64 --reps 20 --parts paged \
      --paged-variants where+unpaired+relu_nan where paired+relu1 table:s3 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())


def timed(fn, *args, reps=10):
    import jax
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return 1e3 * ts[len(ts) // 2]


def selection_timings(score, visible, topk, reps):
    """Both selection paths forced (lax.top_k + sort vs the sort-free threshold search, kernels/topk_select.py),
    timed, and their outputs compared on this data (mismatching entries; 0 is the only right answer)."""
    import jax
    import numpy as np

    from dsflash.kernels import indexer_topk as ik
    from dsflash.kernels import topk_select as ts
    paths = {"topk_ms": jax.jit(lambda s: ik.select_topk_sorted(s, visible, topk)),
             "topk_radix_ms": jax.jit(lambda s: ts.select_topk_threshold(s, visible, topk)),
             "cand_filter_ms": jax.jit(lambda s: ik.candidate_mask_sorted(s, visible, 8, 2048)),
             "cand_filter_radix_ms": jax.jit(lambda s: ts.candidate_mask_threshold(s, visible, 8, 2048))}
    pairs = [("topk", "topk_ms", "topk_radix_ms"), ("cand_filter", "cand_filter_ms", "cand_filter_radix_ms")]
    try:   # the Triton radix top-k (kernels/topk_triton.py: one program a row; topk_split_triton: a row over several),
        # 32-bit keys and 16-bit ones (the scores are bf16-valued)
        from dsflash.kernels import topk_split_triton as tst, topk_triton as tt
        impls = {"triton": (tt.select_topk_triton, tt.candidate_mask_triton),
                 "split": (tst.select_topk_split, tst.candidate_mask_split)}
        for tag, (sel, cand) in impls.items():
            for bits in (32, 16):
                paths[f"topk_{tag}{bits}_ms"] = jax.jit(lambda s, b=bits, f=sel: f(s, visible, topk, key_bits=b))
                paths[f"cand_filter_{tag}{bits}_ms"] = jax.jit(lambda s, b=bits, f=cand: f(s, visible, 8, 2048,
                                                                                             key_bits=b))
                pairs += [(f"topk_{tag}{bits}", "topk_ms", f"topk_{tag}{bits}_ms"),
                          (f"cand_filter_{tag}{bits}", "cand_filter_ms", f"cand_filter_{tag}{bits}_ms")]
    except Exception as e:  # noqa: BLE001
        print("no Triton top-k:", repr(e)[:300], flush=True)
    row = {}
    for name, fn in paths.items():
        try:
            row[name] = timed(fn, score, reps=reps)
        except Exception as e:  # noqa: BLE001
            row[name.replace("_ms", "_error")] = repr(e)[:300]
    for what, a, b in pairs:
        if a in row and b in row:
            row[f"{what}_mismatch"] = int(np.sum(np.asarray(paths[a](score)) != np.asarray(paths[b](score))))
    return row


# session 30's switches of the paged scorer: name -> (module attribute, value); the first three are the default
# since session 30, the last three set each back to the fp32 form ("where+unpaired+relu_nan" = the kernel before)
PAGED_SWITCHES = {"table": ("KEY_DECODE", "table"), "paired": ("PAIRED_ROUND", True),
                  "relu1": ("RELU_ONE_COMPARE", True), "where": ("KEY_DECODE", "where"),
                  "unpaired": ("PAIRED_ROUND", False), "relu_nan": ("RELU_ONE_COMPARE", False)}


def paged_variant(spec):
    """'table+paired:s3' -> ({module attribute: value}, num_stages or None)."""
    name, _, st = spec.partition(":")
    sets = {}
    for part in name.split("+"):
        if part not in PAGED_SWITCHES:
            raise ValueError(f"--paged-variants: unknown switch {part!r} in {spec!r} (known: {sorted(PAGED_SWITCHES)})")
        attr, val = PAGED_SWITCHES[part]
        sets[attr] = val
    if st and not (st.startswith("s") and st[1:].isdigit()):
        raise ValueError(f"--paged-variants: stages must be ':s<N>', got {spec!r}")
    return sets, (int(st[1:]) if st else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--ratio", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="out")
    ap.add_argument("--parts", default="gather,select,scores,paged",
                    help="comma-separated subset of gather, select, scores, paged: under Nsight Compute, `--parts paged` "
                         "runs no XLA sort (ncu segfaulted on the whole script, session 29)")
    ap.add_argument("--paged-stages", type=int, nargs="+", default=None,
                    help="also time the paged scorer at these num_stages (indexer_paged_triton.NUM_STAGES; "
                         "scores_paged_s<N>_ms), after the default")
    ap.add_argument("--paged-variants", nargs="+", default=None,
                    help="also time the paged scorer with session 30's opt-in switches, each a '+'-joined set of "
                         f"{sorted(PAGED_SWITCHES)} with an optional ':s<N>' (num_stages), e.g. table paired "
                         "table+paired+relu1 table+paired+relu1:s3 (scores_paged_<variant>_ms, and "
                         "paged_<variant>_equal: its scores bit-identical to the default's)")
    a = ap.parse_args()
    for v in a.paged_variants or ():
        try:
            paged_variant(v)
        except ValueError as e:
            ap.error(str(e))
    parts = set(a.parts.split(","))
    if parts - {"gather", "select", "scores", "paged"}:
        ap.error(f"--parts: unknown {sorted(parts - {'gather', 'select', 'scores', 'paged'})}")
    os.makedirs(a.out, exist_ok=True)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsflash.kernels import indexer_topk as ik
    from dsflash.model import state as st
    from dsflash.model.attention import gather_pool, pool_addresses

    Hi, Di, topk = 32, 128, 512
    B, S = a.seqs, a.rows
    res = {"device": jax.devices()[0].device_kind, "args": vars(a), "points": []}
    key = jax.random.PRNGKey(0)
    for C in a.contexts:
        T = C // a.ratio
        per_page = a.page_size // a.ratio
        pages = T // per_page
        kq, kk, kw, ks = jax.random.split(jax.random.fold_in(key, C), 4)
        pool = st.encode_index_k(jax.random.normal(kk, (B * T, Di), jnp.float32), "reference")
        # a host permutation: jax.random.permutation is a sort on the device (see --parts)
        page_table = jnp.asarray(np.random.default_rng(C).permutation(B * pages).reshape(B, pages), jnp.int32)
        entries = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        q = jax.random.normal(kq, (B, S, Hi, Di), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (B, S, Hi), jnp.float32) * 0.02).astype(jnp.bfloat16)
        visible = jnp.full((B, S), T, jnp.int32)
        valid = jnp.ones((B, S), bool)
        nan = float("nan")

        gather = jax.jit(lambda pool, pt: gather_pool(pool, pool_addresses(pt, entries, per_page),
                                                      st.decode_index_k, jnp.bfloat16))
        k_all = gather(pool, page_table)
        row = {"context": C, "T": T, "B": B, "S": S,
               "index_key_MB": sum(x.size * x.dtype.itemsize for x in pool.values()) / 1e6,
               "gathered_bf16_MB": k_all.size * 2 / 1e6}
        row["gather_ms"] = timed(gather, pool, page_table, reps=a.reps) if "gather" in parts else nan
        if "select" in parts:
            score = jax.random.normal(ks, (B, S, T), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
            row.update(selection_timings(score, visible, topk, a.reps))
            del score
        if "scores" in parts:
            row["scores_xla_ms"] = timed(jax.jit(lambda q, w, k: ik.indexer_scores_reference(q, w, k, visible, valid)),
                                         q, w, k_all, reps=a.reps)
        try:
            if "scores" not in parts:
                raise RuntimeError("not in --parts")
            from dsflash.kernels import indexer_topk_triton as it
            row["scores_triton_ms"] = timed(jax.jit(lambda q, w, k: it.indexer_scores_triton(q, w, k, visible, valid)),
                                            q, w, k_all, reps=a.reps)
        except Exception as e:  # noqa: BLE001
            row["scores_triton_error"] = repr(e)[:300]
        try:   # the paged scorer: keys read straight from the pool (no gather)
            if "paged" not in parts:
                raise RuntimeError("not in --parts")
            from dsflash.kernels import indexer_paged_triton as ipt
            paged = jax.jit(lambda q, w, pool, pt: ipt.indexer_scores_paged_triton(q, w, pool, pt, per_page, visible,
                                                                                   valid))
            row["scores_paged_ms"] = timed(paged, q, w, pool, page_table, reps=a.reps)
            ref = ik.indexer_scores_reference(q, w, k_all, visible, valid)
            got = paged(q, w, pool, page_table)
            row["paged_max_rel_diff"] = float(jnp.max(jnp.abs(got - ref) / (jnp.abs(ref) + 1e-30)))
            default_stages = ipt.NUM_STAGES
            for st_n in a.paged_stages or ():      # each a fresh trace: the launch reads NUM_STAGES when traced
                ipt.NUM_STAGES = st_n
                try:
                    f = jax.jit(lambda q, w, pool, pt: ipt.indexer_scores_paged_triton(q, w, pool, pt, per_page,
                                                                                       visible, valid))
                    row[f"scores_paged_s{st_n}_ms"] = timed(f, q, w, pool, page_table, reps=a.reps)
                    row[f"paged_s{st_n}_equal"] = bool(jnp.array_equal(f(q, w, pool, page_table), got))
                finally:
                    ipt.NUM_STAGES = default_stages
            for spec in a.paged_variants or ():    # each a fresh trace: the launch reads the switches when traced
                sets, st_n = paged_variant(spec)
                saved = {k: getattr(ipt, k) for k in [*sets, "NUM_STAGES"]}
                tag = spec.replace("+", "_").replace(":", "_")
                try:
                    for k, v in sets.items():
                        setattr(ipt, k, v)
                    if st_n:
                        ipt.NUM_STAGES = st_n
                    f = jax.jit(lambda q, w, pool, pt: ipt.indexer_scores_paged_triton(q, w, pool, pt, per_page,
                                                                                       visible, valid))
                    row[f"scores_paged_{tag}_ms"] = timed(f, q, w, pool, page_table, reps=a.reps)
                    row[f"paged_{tag}_equal"] = bool(jnp.array_equal(
                        jax.lax.bitcast_convert_type(f(q, w, pool, page_table), jnp.uint32),
                        jax.lax.bitcast_convert_type(got, jnp.uint32)))
                except Exception as e:  # noqa: BLE001
                    row[f"scores_paged_{tag}_error"] = repr(e)[:300]
                finally:
                    for k, v in saved.items():
                        setattr(ipt, k, v)
            if a.paged_variants and a.reps > 1:    # the default again, last: drift over the call shows up here
                row["scores_paged_again_ms"] = timed(paged, q, w, pool, page_table, reps=a.reps)
            del ref, got
        except Exception as e:  # noqa: BLE001
            row["scores_paged_error"] = repr(e)[:300]
        res["points"].append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(a.out, "indexer_split.json"), "w") as f:
            json.dump(res, f, indent=1)
        del pool, k_all
    nan = float("nan")
    print("\ncontext  gather  scores(xla)  scores(triton)  paged  top-512 (sort / radix, mismatch)  cand-filter (sort / "
          "radix, mismatch)   (ms; keys MB packed / gathered bf16)")
    for r in res["points"]:
        print(f"{r['context']:>7} {r['gather_ms']:>7.3f} {r.get('scores_xla_ms', nan):>12.3f} "
              f"{r.get('scores_triton_ms', float('nan')):>15.3f} {r.get('scores_paged_ms', float('nan')):>6.3f} "
              f"{r.get('topk_ms', nan):>8.3f} / {r.get('topk_radix_ms', nan):.3f}, "
              f"{r.get('topk_mismatch', '-'):>3}    {r.get('cand_filter_ms', nan):>12.3f} / "
              f"{r.get('cand_filter_radix_ms', nan):.3f}, "
              f"{r.get('cand_filter_mismatch', '-'):>3}   {r['index_key_MB']:.0f} / {r['gathered_bf16_MB']:.0f}")
    print("\ncontext  Triton top-512 32-bit / 16-bit keys (mismatch)  Triton cand-filter 32 / 16 (mismatch)   (ms)")
    for r in res["points"]:
        print(f"{r['context']:>7} {r.get('topk_triton32_ms', nan):>10.3f} / {r.get('topk_triton16_ms', nan):.3f} "
              f"({r.get('topk_triton32_mismatch', '-')}, {r.get('topk_triton16_mismatch', '-')})"
              f" {r.get('cand_filter_triton32_ms', nan):>14.3f} / {r.get('cand_filter_triton16_ms', nan):.3f} "
              f"({r.get('cand_filter_triton32_mismatch', '-')}, {r.get('cand_filter_triton16_mismatch', '-')})")
    print("\ncontext  split top-512 32-bit / 16-bit keys (mismatch)  split cand-filter 32 / 16 (mismatch)   (ms)")
    for r in res["points"]:
        print(f"{r['context']:>7} {r.get('topk_split32_ms', nan):>10.3f} / {r.get('topk_split16_ms', nan):.3f} "
              f"({r.get('topk_split32_mismatch', '-')}, {r.get('topk_split16_mismatch', '-')})"
              f" {r.get('cand_filter_split32_ms', nan):>14.3f} / {r.get('cand_filter_split16_ms', nan):.3f} "
              f"({r.get('cand_filter_split32_mismatch', '-')}, {r.get('cand_filter_split16_mismatch', '-')})")


if __name__ == "__main__":
    main()
