"""PNG plots for benchmark results. matplotlib is imported lazily (``pip install dsflash[bench]``);
without it a plot is skipped with a warning and the JSON results are still written."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from dsflash.plots import pyplot as _pyplot


def plot_serve_sweep(result: dict, path: str | Path) -> Optional[Path]:
    """``bench serve`` sweep: output tokens/s/GPU against p90 interactivity (1 / p90 ITL), one
    point per concurrency (median over repeats, whiskers = min..max), next to the p90 latencies
    against concurrency. Returns the PNG path, or None when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    summary = result.get("summary") or []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))

    xs, ys, cs, xerr, yerr, valid = [], [], [], [[], []], [[], []], []
    for s in summary:
        inter, tput = s.get("p90_interactivity"), s.get("output_throughput_per_gpu")
        if not inter or not tput:
            continue
        xs.append(inter["median"])
        ys.append(tput["median"])
        cs.append(s["concurrency"])
        xerr[0].append(inter["median"] - inter["min"])
        xerr[1].append(inter["max"] - inter["median"])
        yerr[0].append(tput["median"] - tput["min"])
        yerr[1].append(tput["max"] - tput["median"])
        valid.append(s.get("valid", True))
    if xs:
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="-o", capsize=3, label=result.get("label", "run"))
        for x, y, c, ok in zip(xs, ys, cs, valid):
            ax.annotate(f"c={c}" + ("" if ok else " (invalid)"), (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color="black" if ok else "red")
    ax.set_xlabel("p90 interactivity (tok/s/user = 1 / p90 ITL)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title("throughput vs interactivity")
    ax.grid(True, alpha=0.3)
    if xs:
        ax.legend(fontsize=8)

    conc = [s["concurrency"] for s in summary]
    for key, name in (("ttft_p90_ms", "p90 TTFT"), ("tpot_p90_ms", "p90 TPOT"),
                      ("itl_p90_ms", "p90 ITL"), ("e2el_p90_ms", "p90 E2EL")):
        vals = [(c, s[key]["median"]) for c, s in zip(conc, summary) if key in s]
        if vals:
            ax2.plot([v[0] for v in vals], [v[1] for v in vals], "-o", label=name)
    if len(set(conc)) > 1 and min(conc) > 0:
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(sorted(set(conc)))
        ax2.set_xticklabels([str(c) for c in sorted(set(conc))])
        ax2.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrency (live sessions)")
    ax2.set_ylabel("ms")
    ax2.set_title("p90 latencies")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)

    cfg = result.get("config", {})
    fig.suptitle(f"bench serve · {result.get('label', '')} · {cfg.get('model', '')} · "
                 f"{cfg.get('workload', '')} · {cfg.get('num_gpus', 1)} GPU(s) · "
                 f"{str(result.get('commit', ''))[:10]} · {result.get('date', '')}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scale_model(result: dict, path: str | Path) -> Optional[Path]:
    """``bench scale-model``: predicted decode tokens/s/GPU against the DEP size (one line per sequences per
    GPU), against per-user tokens/s (one curve per DEP size, TP4 at one user marked), and the per-term step
    breakdown at 32 sequences per GPU. Returns the PNG path, or None when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    dec = result["predictions"]["decode"]
    deps = sorted({p["dep"] for p in dec})
    batches = sorted({p["sequences"] for p in dec})
    at = {(p["dep"], p["sequences"]): p for p in dec}
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    for b in batches:
        ax.plot(deps, [at[(n, b)]["tokens_per_s_per_gpu"] for n in deps], "-o", label=f"{b} seq/GPU")
    ax.set_xscale("log", base=2)
    ax.set_xticks(deps)
    ax.set_xticklabels([str(n) for n in deps], rotation=60, fontsize=8)
    ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax.set_xlabel("DEP size (GPUs)")
    ax.set_ylabel("predicted output tokens/s per GPU")
    ax.set_title("decode throughput vs DEP size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)

    for n in deps:
        xs = [at[(n, b)]["tokens_per_s_per_user"] for b in batches]
        ys = [at[(n, b)]["tokens_per_s_per_gpu"] for b in batches]
        ax2.plot(xs, ys, "-o", label=f"DEP{n}")
    tp = result["predictions"].get("tp4_one_user") or {}
    if tp.get("tp4"):
        ax2.plot([tp["tp4"]["tokens_per_s_per_user"]], [tp["tp4"]["tokens_per_s_per_gpu"]], "k*", ms=12,
                 label="TP4, one user")
    ax2.set_yscale("log")
    ax2.set_xlabel("tokens/s per user (1 / step)")
    ax2.set_ylabel("predicted output tokens/s per GPU")
    ax2.set_title("throughput vs interactivity (points: seq/GPU)")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7)

    b0 = 32 if 32 in batches else batches[len(batches) // 2]
    terms = list(at[(deps[0], b0)]["terms_ms"])
    bottom = [0.0] * len(deps)
    for term in terms:
        vals = [at[(n, b0)]["terms_ms"][term] for n in deps]
        ax3.bar([str(n) for n in deps], vals, bottom=bottom, label=term)
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax3.set_xlabel("DEP size (GPUs)")
    ax3.set_ylabel("ms per decode step")
    ax3.set_title(f"step terms at {b0} seq/GPU")
    ax3.legend(fontsize=7)
    s = result.get("settings", {})
    fig.suptitle(f"scale model (predicted, not measured): V4.1-Flash 40 layers from one-H200 per-op costs; "
                 f"fabric {s.get('fabric')}, {s.get('collective')}, context {result.get('context')}",
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
