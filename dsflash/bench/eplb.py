"""``python -m dsflash.bench eplb``: EPLB balancedness before/after a rebalance for real, uniform and skewed
routing on a chosen mesh.

:func:`synthetic_rows` measures *uniform* and *Zipf-skewed* synthetic routing for the target model and the
DSpark draft (one row each, printed and written to the JSON). On top of that:

* ``--mesh dep=8`` (any spec: the EP group is the product of the mesh's expert axes under the DEP
  rule table; no devices are needed) instead of ``--ranks``;
* redundant-expert counts rounded up so physical slots divide over the EP ranks (noted when changed);
* **real** routing (target model): the preset's model (random weights, ``init_params``) runs one forward
  over random token ids and its own router's top-k ids are recorded per layer (through the
  ``routed_fn`` hook); the same procedure as :func:`synthetic_rows` follows: ``--steps`` steps of ``--tokens``
  tokens fill the window, the policy rebalances, and a fresh forward (other token ids, same count as the
  whole window) is routed through the new tables to measure balancedness after. Needs a model that fits
  on the machine (not ``v41_flash``: then real routing is skipped with a note);
* JSON in ``benchmarks/results/eplb_<date>_<device>.json`` (``--out``, ``--no-save``).

Balancedness = Σ_layers mean rank load / Σ_layers max rank load (1.0 = perfect).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

import numpy as np

from dsflash.bench.kernels import _commit

def ep_ranks(spec: str) -> int:
    """EP group size of a mesh spec under the DEP rule table (dep x ep x tp)."""
    from dsflash.sharding import rules
    from dsflash.sharding.mesh import abstract_mesh, mesh_sizes
    mesh = abstract_mesh(spec)
    sizes = mesh_sizes(mesh)
    return int(np.prod([sizes[a] for a in rules.expert_axes(mesh, "dep")] or [1]))


def round_up_redundant(E: int, R: int, ranks: int) -> int:
    return R + (-(E + R)) % ranks


def synthetic_rows(cfg, ranks: int, redundant: int, draft_redundant: int, tokens: int, steps: int,
                   zipf: float = 1.2) -> list[dict]:
    """Balancedness before / after one rebalance for uniform and Zipf-skewed synthetic routing, target model
    then DSpark draft: ``steps`` steps of ``tokens`` tokens fill the window, the policy rebalances, and a fresh
    draw (as many tokens as the whole window) is routed through the new tables. One row per (model, routing)."""
    import jax.numpy as jnp

    from dsflash.sharding.eplb import (EplbConfig, EplbState, balancedness, route, sample_topk,
                                       zipf_popularity)

    rng = np.random.default_rng(0)
    rows = []
    for draft, R in ((False, redundant), (True, draft_redundant)):
        L = cfg.n_stages if draft else cfg.num_hidden_layers
        E = cfg.dspark_n_routed_experts if draft else cfg.n_routed_experts
        k = cfg.dspark_num_experts_per_tok if draft else cfg.num_experts_per_tok
        for kind in ("uniform", "skewed"):
            pop = (np.full((L, E), 1.0 / E) if kind == "uniform" else zipf_popularity(L, E, zipf))
            st = EplbState(L, E, ranks, EplbConfig(window_size=steps, step_interval=steps,
                                                    num_redundant_experts=R), "draft" if draft else "target", draft)
            for _ in range(steps):
                load = np.zeros((L, st.P), np.int64)
                for l in range(L):
                    ids = sample_topk(pop[l], tokens, k, rng)
                    _, ld = route(jnp.asarray(ids), st.tables.log2phy[l], st.tables.logcnt[l], num_physical=st.P)
                    load[l] = np.asarray(ld)
                st.record(load)
            plan = st.rebalance()
            st.commit(plan)
            load = np.zeros((L, st.P), np.int64)
            for l in range(L):
                ids = sample_topk(pop[l], tokens * steps, k, rng)
                _, ld = route(jnp.asarray(ids), st.tables.log2phy[l], st.tables.logcnt[l], num_physical=st.P)
                load[l] = np.asarray(ld)
            rows.append({"model": st.name, "kind": kind, "E": E, "P": st.P, "ranks": ranks,
                         "before": float(plan.balancedness_before), "after": float(balancedness(load, ranks)),
                         "predicted_after": float(plan.balancedness_after), "expert_copies": int(plan.num_copies)})
    return rows


def format_row(r: dict) -> str:
    """One row as the bench prints it."""
    return (f"{r['model']:6s} E={r['E']} P={r['P']} ranks={r['ranks']} {r['kind']:8s} balancedness before "
            f"{r['before']:.4f} after {r['after']:.4f} (predicted {r['predicted_after']:.4f}, "
            f"{r['expert_copies']} expert copies)")


def real_routing_ids(cfg, num_tokens: int, seed: int, seq: int = 256):
    """Logical top-k ids [L, T, k] chosen by the model's own router for ``num_tokens`` random token ids
    (rows of ``seq`` tokens, a single-device prefill from position 0)."""
    import importlib

    import jax
    import jax.numpy as jnp

    from dsflash.kernels import moe_gemm
    from dsflash.model.params import init_params
    from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch
    F = importlib.import_module("dsflash.model.forward")

    S = min(seq, num_tokens)
    B = -(-num_tokens // S)
    page = 64
    pages = -(-S // page)
    params = init_params(cfg, seed=0)
    opts = RunOptions(precision="bf16", logits="none", page_size=page)

    def fn(params, tokens):
        ids = []

        def hook(x, idx, w, *a, **k):
            ids.append(idx)
            return moe_gemm.routed_moe(x, idx, w, *a, **k)

        state = init_state(cfg, CacheGeometry(B, B * pages, page), "bf16")
        F.forward(params, cfg, make_batch(tokens, pages_per_seq=pages), state, opts, routed_fn=hook)
        return jnp.stack(ids)

    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    ids = np.asarray(jax.jit(fn)(params, tokens))            # [L, B*S, k]
    return ids[:, :num_tokens]


def real_eplb(cfg, ranks: int, redundant: int, tokens: int, steps: int, seed: int = 0) -> dict:
    """:func:`synthetic_rows`' procedure with the model's own routing: fill the window, rebalance, measure after."""
    import jax.numpy as jnp

    from dsflash.sharding.eplb import EplbConfig, EplbState, balancedness, route

    L, E = cfg.num_hidden_layers, cfg.n_routed_experts
    st = EplbState(L, E, ranks, EplbConfig(window_size=steps, step_interval=steps, num_redundant_experts=redundant),
                   "target", False)
    ids = real_routing_ids(cfg, tokens * steps, seed)
    for s in range(steps):
        load = np.zeros((L, st.P), np.int64)
        for l in range(L):
            _, ld = route(jnp.asarray(ids[l, s * tokens:(s + 1) * tokens]), st.tables.log2phy[l],
                          st.tables.logcnt[l], num_physical=st.P)
            load[l] = np.asarray(ld)
        st.record(load)
    plan = st.rebalance()
    st.commit(plan)
    fresh = real_routing_ids(cfg, tokens * steps, seed + 1)
    load = np.zeros((L, st.P), np.int64)
    for l in range(L):
        _, ld = route(jnp.asarray(fresh[l]), st.tables.log2phy[l], st.tables.logcnt[l], num_physical=st.P)
        load[l] = np.asarray(ld)
    return {"model": "target", "kind": "real", "E": E, "P": st.P, "ranks": ranks,
            "before": plan.balancedness_before, "after": balancedness(load, ranks),
            "predicted_after": plan.balancedness_after, "expert_copies": plan.num_copies}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsflash.bench eplb", description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default=None, help="mesh spec; EP ranks = its expert-parallel group (default dep=8)")
    ap.add_argument("--ranks", type=int, default=None, help="EP ranks directly (instead of --mesh)")
    ap.add_argument("--preset", default="tiny", help="model preset (real routing needs one that fits: not v41_flash)")
    ap.add_argument("--redundant", type=int, default=None, help="redundant target experts (default: E/4, rounded up)")
    ap.add_argument("--draft-redundant", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per step")
    ap.add_argument("--steps", type=int, default=20, help="steps in the window before the rebalance")
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--no-real", action="store_true", help="skip real routing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)

    from dsflash.config import preset

    if args.ranks and args.mesh:
        print("give --mesh or --ranks, not both", file=sys.stderr)
        return 2
    mesh = args.mesh or (None if args.ranks else "dep=8")
    try:
        ranks = args.ranks or ep_ranks(mesh)
        cfg = preset(args.preset)
    except ValueError as e:
        print(f"bench eplb: {e}", file=sys.stderr)
        return 2
    E, Ed = cfg.n_routed_experts, cfg.dspark_n_routed_experts
    R0 = args.redundant if args.redundant is not None else E // 4
    R = round_up_redundant(E, R0, ranks)
    Rd = round_up_redundant(Ed, args.draft_redundant, ranks)
    notes = []
    if R != R0:
        notes.append(f"target redundant experts {R0} -> {R} so that {E}+R divides over {ranks} ranks")
    if Rd != args.draft_redundant:
        notes.append(f"draft redundant experts {args.draft_redundant} -> {Rd} so that {Ed}+R divides over {ranks} ranks")
    for n in notes:
        print(f"note: {n}")
    print(f"bench eplb: preset {args.preset}, {ranks} EP ranks ({mesh or 'given'}), {args.steps} steps x "
          f"{args.tokens} tokens, Zipf {args.zipf}")
    t0 = time.time()
    rows = synthetic_rows(cfg, ranks, R, Rd, args.tokens, args.steps, args.zipf)
    for r in rows:
        print(format_row(r))
    if args.no_real:
        pass
    elif args.preset == "v41_flash":
        notes.append("real routing skipped: v41_flash does not fit; use a bench/tiny preset")
        print(f"note: {notes[-1]}")
    else:
        r = real_eplb(cfg, ranks, R, args.tokens, args.steps)
        rows.append(r)
        print(format_row(r))
    print()
    print(f"{'model':7} {'routing':8} {'E':>4} {'P':>4} {'ranks':>5} {'before':>7} {'after':>7}")
    for r in rows:
        print(f"{r['model']:7} {r['kind']:8} {r['E']:>4} {r['P']:>4} {r['ranks']:>5} {r['before']:>7.4f} {r['after']:>7.4f}")
    if not args.no_save:
        import jax
        dev = jax.devices()[0]
        now = _dt.datetime.now(_dt.timezone.utc)
        kind = dev.device_kind.replace(" ", "_").lower()
        short = "h200" if "h200" in kind else ("cpu" if dev.platform == "cpu" else kind)
        out_dir = args.out or os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"eplb_{now.strftime('%Y%m%d')}_{short}.json")
        result = dict(benchmark="eplb", date=now.isoformat(timespec="seconds"), commit=_commit(),
                      device=dev.device_kind, mesh=mesh, ep_ranks=ranks, preset=args.preset,
                      config_hash=cfg.hash(), redundant=R, draft_redundant=Rd, tokens=args.tokens,
                      steps=args.steps, zipf=args.zipf, notes=notes, rows=rows, wall_s=round(time.time() - t0, 2),
                      method="synthetic_rows (uniform, Zipf-skewed) + the model's own router on random token ids "
                             "(real); balancedness = sum_l mean rank load / sum_l max rank load",
                      command="python -m dsflash.bench eplb " + " ".join(sys.argv[1:] if argv is None else argv))
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
