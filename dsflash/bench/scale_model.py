"""A calibrated scale model: predicted decode / prefill step time per GPU for DEP4 ... DEP72 (and TP4 at one
user) of the full DeepSeek-V4.1-Flash, built from measured per-op costs on one H200 (issue 24 item 3).

    python -m dsflash.bench scale-model [--dep 4,8,16,32,64,72] [--fabric nvlink-h200] [--out JSON] [--plot PNG]

Pure Python + numpy (the EPLB term reuses the numpy policy of ``dsflash.sharding.eplb``). Nothing here runs a
model: every number is a measured input (``benchmarks/results/*.json``, named per term in the output) or a stated
assumption (``ASSUMPTIONS``; vendor / public figures where nothing was measured).

**Inputs.** The per-op step profiles of ``bench-4l-96e`` on one H200 (real widths, 4 layers: SWA, SWA, ratio-2
Full, ratio-1 Full; 96 routed experts = one GPU's share of 384 at DEP4; traced without command buffers, step
time with them): decode 1 x 6 and 32 x 6 rows at 4K context (run 24, the shipped grouped-FP8 ``wo_a``), 32 x 6 at
128K (run 25, paged indexer), prefill 4096 new tokens (run 18). ``t`` = tokens (rows) per GPU in the call.

**Per op, dense / attention (data-parallel: independent of the DEP size N).** Every op ``o`` of the profile is
in a layer class ``k(o)``: every layer (projections, mHC, norms, shared expert, gate, sparse attention, writes),
indexer layers (``index_source_layer_ids``: indexer q, scores + top-k), KV-source layers (compressor, index
keys), compressed layers (ratio > 0: the selected-KV gather) or once per step (head, embedding). The target's
time for the op is the bench's times the count ratio of its class::

    T_o(t, C) = m_k(o) * [ lin_o(t) + (t / 192) * (C - 4096) / (131072 - 4096) * (v_o(192, 128K) - v_o(192, 4K)) ]
    lin_o(t)  = v_o(6, 4K) + (t - 6) / (192 - 6) * (v_o(192, 4K) - v_o(6, 4K))       (t >= 6; v_o(6, 4K) below)
    m_k       = (count of class k in V4.1: 40 / 8 / 4 / 38 / 1) / (count in bench-4l-96e: 4 / 2 / 2 / 2 / 1)

Prefill (one chunk of ``t`` new tokens over ``C`` cached): every op scales with ``t / 4096`` from the prefill
point, the indexer's scores with ``t (C + t/2) / (4096 * 2048)`` (each token scores every earlier entry).

**Routed experts (the MoE grouped GEMM of the GPU's local experts), per layer**::

    T_moe = max over ranks r of  max(a h_r + c s_r + o, F)      h_r: local experts hit, s_r: slots received

``E_loc = (E + R) / N`` (R redundant experts, rounded up so slots divide). ``a`` (ms per expert hit: streaming
its 18.8 MB of MXFP4 weights), ``c`` (ms per slot) and ``o`` are solved exactly from the three profiled points
(h = the router's measured hits per layer, s = t k); ``F`` = the MoE op at 1 token (kernel benchmark run 13),
the launch-bound floor the linear law would undercut. At N = 1 (and TP): ``h = E_loc (1 - (1 - k/E)^(N t))``,
``s = t k``. At N > 1, h_r and s_r are sampled: each expert's count of the N t tokens is binomial at its top-k
inclusion probability (uniform, or Zipf-skewed popularity), split evenly over its replicas, placed contiguously
(EPLB off) or by DeepSeek's policy on the expected load (EPLB on: the window's load = the true popularity).
**Balancedness** beta = sum_l mean_r s_r / sum_l max_r s_r, as ``dsflash.sharding.eplb``.

**EP dispatch / combine, per layer** (two collectives; ``N = 1``: none)::

    all_to_all (dsflash): bytes_out = p * t k d (b_x + b_o) (N - 1) / N
                          p = capacity_factor (decode buffer) | N (prefill buffer: every destination x t k rows)
                          | 1 / beta ("ragged": only the real rows, the fullest rank; what DeepEP sends)
    allgather  (dsflash): bytes_in  = (N - 1) t d (b_x + 4)               (bf16 gather, fp32 reduce-scatter)
    T_comm = 2 alpha + bytes_nvlink / (eta B_nvlink) (+ bytes off the island / (eta B_ib), taken in parallel)

with the fabric's per-GPU bandwidth per direction ``B`` and efficiency ``eta`` from vendor figures (no
multi-GPU collective was measured: the one DEP2 run used the XLA path). ``overlap`` (default 0: dsflash has
no micro-batch overlap) hides that fraction of T_comm behind the compute.

**Launch gaps and host time.** ``g`` = step (command buffers on) - kernel-busy at the profiled point: the device
idles ~3.5 us between the ~340 kernels of a 4-layer step. Default ``gaps="per_layer"``: the target launches
``m_layer`` times as many kernels, so ``T_gap = m_layer g(t)`` (``"per_step"``: ``T_gap = g(t)``). Both are
constant in N. ``host_ms`` (engine host work per step that async scheduling does not hide; default 0) adds once.
**Stragglers**: in an EP step every rank waits for the slowest, so ``T_strag = sigma * E[max of N standard
normals]``, sigma = the step-time spread of one GPU ((p90 - median) / 1.2816 at 32 x 6).

**Step and throughput**::

    T_step = sum_o T_o + L T_moe + L (1 - overlap) T_comm + T_gap + host_ms + T_strag
    tokens/s/GPU = b * tokens_per_step / T_step,   tokens/s/user = tokens_per_step / T_step

TP (``predict(..., dep=1, tp=4)``, one sequence): dense ops and head split ``1 / tp`` (a perfect split:
optimistic), every expert's slices too: ``T_moe = max((a h + c s) / tp + o, F)`` with ``h`` over all 384
experts; two ring all-reduces of ``t d`` bf16 per layer; the same gaps; tokens/s/GPU divides by ``tp``.

**What it cannot know** (also in ``ASSUMPTIONS`` / the docs): collective bandwidth and latency beyond one GPU
(vendor figures), how the kernels behave at shapes never timed (t > 192 decode rows, other contexts: linear
inter-/extrapolation), the Engram lookups and the DSpark draft (not in the bench model), XLA scheduling of a
40-layer program, real routing skew, and host behaviour of a multi-host job (``host_ms``, sigma: assumptions).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# which measured point feeds which calibration slot: (file, selector)
CALIBRATION_POINTS = {
    "decode_6_4k": ("step_profile_20261202_h200_run24.json", {"phase": "decode", "n": 1, "C": 4096,
                                                               "variant": "fp8grp"}),
    "decode_192_4k": ("step_profile_20261202_h200_run24.json", {"phase": "decode", "n": 32, "C": 4096,
                                                                 "variant": "fp8grp"}),
    "decode_192_128k": ("step_profile_20261202_h200_run25_128k.json", {"phase": "decode", "n": 32, "C": 131072,
                                                                        "variant": "new"}),
    "prefill_4096": ("step_profile_20261201_h200_run18_grid.json", {"phase": "prefill", "n": 4096, "C": 0,
                                                                     "variant": "new"}),
}
# the same slots from run 18 alone (older code: gathered indexer, pre-FP8 linears): a context-interpolation check
RUN18_POINTS = {
    "decode_6_4k": ("step_profile_20261201_h200_run18_grid.json", {"phase": "decode", "n": 1, "C": 4096}),
    "decode_192_4k": ("step_profile_20261201_h200_run18_grid.json", {"phase": "decode", "n": 32, "C": 4096}),
    "decode_192_128k": ("step_profile_20261201_h200_run18_grid.json", {"phase": "decode", "n": 32, "C": 131072}),
    "prefill_4096": ("step_profile_20261201_h200_run18_grid.json", {"phase": "prefill", "n": 4096, "C": 0}),
}
MOE_KERNEL_FILES = ("kernels_20261201_h200_run13_moe_default.json", "kernels_20261130_h200_run9_moe_swap_bd.json",
                    "kernels_20261130_h200_run10_mhc_split_moe16k.json")

OP_CLASS = {
    "head": "step", "embed": "step",
    "indexer_topk": "index", "indexer_q": "index",
    "compressor": "kv_source", "index_keys": "kv_source",
    "kv_gather": "compressed",
}  # every other op: "layer"; "routed_experts" is the MoE term
MOE_OP = "routed_experts"
INDEX_SCORE_OPS = ("indexer_topk",)  # prefill: grows with the context each token scores

FABRICS = {
    # per GPU, per direction, GB/s; island = GPUs on one NVLink domain
    "nvlink-h200": {"nvlink_GBps": 450.0, "island": 10 ** 6, "ib_GBps": 50.0,
                    "source": "H200 NVLink 4: 900 GB/s bidirectional per GPU (NVIDIA H200 datasheet); every "
                              "rank on one NVLink domain (an NVL72-style rack with H200 links: hypothetical "
                              "beyond 8 GPUs)"},
    "hgx-ib": {"nvlink_GBps": 450.0, "island": 8, "ib_GBps": 50.0,
               "source": "HGX H200: 8 GPUs on NVLink 4 (450 GB/s per direction), one 400 Gb/s ConnectX-7 "
                         "InfiniBand NIC per GPU (50 GB/s per direction) between hosts"},
    "nvl72-gb200": {"nvlink_GBps": 900.0, "island": 72, "ib_GBps": 50.0,
                    "source": "GB200 NVL72: NVLink 5, 1.8 TB/s bidirectional per GPU, 72 GPUs on one domain "
                              "(NVIDIA); compute still the H200's measured per-op costs"},
}

ASSUMPTIONS = {
    "collective_efficiency": "eta = 0.75 of the link bandwidth for all-to-all / all-gather (DeepEP's normal "
                             "kernels reach ~153 GB/s of H800 NVLink's ~200 GB/s per direction; not measured "
                             "here)",
    "collective_latency": "alpha = 20 us per collective launch (NCCL small-message latency on NVLink is ~10-30 us; "
                          "DeepEP low-latency dispatch is 77 us at EP8 / 128 tokens over RDMA); not measured",
    "dtype": "dispatch in bf16 (2 B) and combine in bf16 (2 B) as dsflash's all_to_all sends them; allgather "
             "reduce-scatters fp32 (4 B); FP8 dispatch (DeepEP) would halve the dispatch bytes",
    "no_overlap": "overlap = 0: dsflash's step has no dual-micro-batch overlap, every collective is exposed",
    "dense_data_parallel": "attention, projections, mHC, shared expert and head run data-parallel: their time "
                           "per GPU depends on the GPU's own rows and contexts only, never on N",
    "tokens_not_sequences": "ops are interpolated in tokens per GPU t = sequences x rows; the 1 x 6 and 32 x 6 "
                            "points are the only decode batch sizes profiled at the current code; t > 192 is "
                            "a linear extrapolation",
    "context": "context-dependent cost is linear in C between 4K and 128K (measured at 32 x 6 only; scaled by "
               "t / 192 at other t)",
    "layer_classes": "per-op times scale by the count of layers of their class (indexer ops with the 8 indexer "
                     "layers, the compressor with the 4 KV sources, the selected-KV gather with the 38 "
                     "compressed layers, the rest with the 40 layers); the V4.1 Reuse / Reindex layers are "
                     "assumed to cost what the bench's Full layers' share does",
    "moe_law": "routed-expert time per layer = a * experts hit + c * slots of the fullest rank + o, one law for "
               "the decode and prefill kernels (fitted exactly on three profiled points)",
    "routing": "expert hits and balancedness from independent tokens with uniform (or Zipf) popularity; random "
               "weights route near-uniformly; real traffic is more skewed",
    "gaps": "launch gaps (device idle between kernels) scale with the kernel count, i.e. with the layer count "
            "(gaps='per_layer'); a CUDA-graph / fused step would shrink them",
    "straggler": "per-step host jitter sigma is the one-GPU step spread; in EP every rank waits for the slowest "
                 "of N draws each layer's collective (modelled once per step)",
    "not_modelled": "Engram n-gram lookups (host tables), the DSpark draft's own forward, sampling, KV-cache "
                    "memory traffic beyond what the profile saw, thermal / clock effects, multi-host control",
}


# ------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Per-class layer counts and MoE shape of a model (``from_config``)."""
    name: str
    layers: int
    compressed: int
    index: int
    kv_source: int
    experts: int
    topk: int
    hidden: int
    inter: int

    @classmethod
    def from_config(cls, name: str, cfg) -> "Layout":
        L = cfg.num_hidden_layers
        ratios = tuple(cfg.compress_ratios)[:L]
        return cls(name=name, layers=L, compressed=sum(1 for r in ratios if r > 0),
                   index=len(cfg.index_source_layer_ids), kv_source=len(cfg.kv_source_layer_ids),
                   experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok, hidden=cfg.hidden_size,
                   inter=cfg.moe_intermediate_size)

    def count(self, klass: str) -> int:
        return {"layer": self.layers, "step": 1, "index": self.index, "kv_source": self.kv_source,
                "compressed": self.compressed}[klass]

    @property
    def expert_bytes(self) -> float:
        """MXFP4 bytes of one expert's w1 / w3 / w2 with one UE8M0 scale per 32 (the 18.8 MB of BENCHMARKS)."""
        n = 3 * self.inter * self.hidden
        return n / 2 + n / 32


def layouts():
    from dsflash.config import preset
    return (Layout.from_config("bench-4l-96e", preset("bench-4l-96e")),
            Layout.from_config("v41_flash", preset("v41_flash")))


# ------------------------------------------------------------------------------------------- calibration


def _select(points, sel):
    for p in points:
        if all(p.get(k) == v for k, v in sel.items()):
            return p
    raise ValueError(f"calibration point {sel} not in the file")


def read_point(path: Path, sel: dict) -> dict:
    d = json.loads(Path(path).read_text())
    p = _select(d["points"], sel)
    prof = p["profile"]
    tokens = p["n"] * p["S"] if p["phase"] == "decode" else p["n"]
    ops = {k: float(v["ms_per_step"]) for k, v in prof["ops"].items()}
    st = p["step_ms"]
    return {"file": Path(path).name, "selector": sel, "phase": p["phase"], "sequences": p["n"], "rows": p["S"],
            "tokens": tokens, "context": p["C"], "ops": ops, "step_ms": float(st["median"]),
            "step_p90_ms": float(st["p90"]), "busy_ms": float(sum(ops.values())),
            "kernels_per_step": float(prof["kernels_per_step"]),
            "experts_hit": float(np.mean(p["experts_touched_per_layer"]))}


@dataclass
class Calibration:
    """The measured inputs, per op, and the MoE law fitted on them."""
    points: dict
    bench: Layout
    moe_abc: tuple = field(default=(0.0, 0.0, 0.0))
    moe_floor_ms: float = 0.0

    @classmethod
    def load(cls, results_dir=RESULTS, which=None, bench: Layout | None = None) -> "Calibration":
        which = which or CALIBRATION_POINTS
        missing = set(CALIBRATION_POINTS) - set(which)
        if missing:
            raise ValueError(f"calibration: missing points {sorted(missing)}")
        pts = {k: read_point(Path(results_dir) / f, sel) for k, (f, sel) in which.items()}
        cal = cls(points=pts, bench=bench or layouts()[0])
        cal.moe_abc = cal._fit_moe()
        cal.moe_floor_ms = moe_floor_ms(results_dir)
        return cal

    def _fit_moe(self):
        k = self.bench.topk
        rows, rhs = [], []
        for name in ("decode_6_4k", "decode_192_4k", "prefill_4096"):
            p = self.points[name]
            rows.append([p["experts_hit"], p["tokens"] * k, 1.0])
            rhs.append(p["ops"][MOE_OP] / self.bench.layers)
        a, c, o = np.linalg.solve(np.array(rows), np.array(rhs))
        return float(a), float(c), float(o)

    @property
    def op_names(self):
        names = []
        for p in self.points.values():
            names += [o for o in p["ops"] if o not in names]
        return names

    def gap_ms(self, name):
        p = self.points[name]
        return p["step_ms"] - p["busy_ms"]

    def sigma_ms(self):
        p = self.points["decode_192_4k"]
        return max(0.0, (p["step_p90_ms"] - p["step_ms"]) / 1.2816)


def moe_floor_ms(results_dir=RESULTS) -> float:
    """The MoE op at 1 token (6 experts, the shipped decode config) from the kernel benchmark (run 13): the
    launch-bound floor of one layer's routed experts, which the linear law would undercut at a few hits."""
    rows = json.loads((Path(results_dir) / MOE_KERNEL_FILES[0]).read_text())["moe_gemm"]
    return 1e3 * min(r["triton_s"] for r in rows if r["T"] == 1)


def _lin(x, x0, y0, x1, y1):
    return y0 + (x - x0) / (x1 - x0) * (y1 - y0)


def bench_op_ms(cal: Calibration, op: str, phase: str, t: float, C: float) -> float:
    """One op's time on the bench model (4 layers) at t tokens per GPU and context C (module docstring)."""
    P = cal.points
    v = lambda name: P[name]["ops"].get(op, 0.0)  # noqa: E731
    if phase == "prefill":
        p = P["prefill_4096"]
        base = v("prefill_4096")
        if op in INDEX_SCORE_OPS:
            return base * t * (C + t / 2) / (p["tokens"] * (p["context"] + p["tokens"] / 2))
        return base * t / p["tokens"]
    t0, t1 = P["decode_6_4k"]["tokens"], P["decode_192_4k"]["tokens"]
    c0, c1 = P["decode_192_4k"]["context"], P["decode_192_128k"]["context"]
    lin = v("decode_6_4k") if t <= t0 else _lin(t, t0, v("decode_6_4k"), t1, v("decode_192_4k"))
    ctx = (t / t1) * (C - c0) / (c1 - c0) * (v("decode_192_128k") - v("decode_192_4k"))
    return max(0.0, lin + ctx)


def bench_gap_ms(cal: Calibration, phase: str, t: float, C: float) -> float:
    P = cal.points
    if phase == "prefill":
        return cal.gap_ms("prefill_4096")
    t0, t1 = P["decode_6_4k"]["tokens"], P["decode_192_4k"]["tokens"]
    c0, c1 = P["decode_192_4k"]["context"], P["decode_192_128k"]["context"]
    g0, g1, g2 = cal.gap_ms("decode_6_4k"), cal.gap_ms("decode_192_4k"), cal.gap_ms("decode_192_128k")
    lin = g0 if t <= t0 else _lin(t, t0, g0, t1, g1)
    return max(0.0, lin + (t / t1) * (C - c0) / (c1 - c0) * (g2 - g1))


# ------------------------------------------------------------------------------------------- terms


def redundant_for(E: int, R: int, N: int) -> int:
    """Smallest R' >= R with (E + R') divisible by N."""
    return R + (-(E + R)) % N


def experts_hit(E_loc: float, E: int, k: int, tokens_total: float) -> float:
    """Expected distinct local experts hit by ``tokens_total`` tokens routed top-k uniformly over E."""
    return E_loc * (1.0 - (1.0 - k / E) ** tokens_total)


def moe_layer_ms(cal: Calibration, hit: float, slots_max: float) -> float:
    """a h + c s + o, never below the smallest measured MoE op (``Calibration.moe_floor_ms``)."""
    a, c, o = cal.moe_abc
    return max(a * hit + c * slots_max + o, cal.moe_floor_ms)


_ROUTING_CACHE: dict = {}


def routing_stats(N: int, tokens_per_gpu: float, E: int = 384, k: int = 6, R: int = 0, eplb: bool = False,
                  zipf: float = 0.0, moe_abc=(0.0, 0.0, 0.0), floor_ms: float = 0.0, layers: int = 8,
                  draws: int = 4, seed: int = 0) -> dict:
    """One step's MoE loads over N EP ranks, by sampling: per expert a binomial count of the N t tokens at its
    top-k inclusion probability (uniform k / E, or Zipf-skewed popularity through Gumbel top-k), split evenly
    over its replicas (a replica is hit when the expert got more tokens than its replica index), placed
    contiguously (EPLB off; redundant slot p holds expert p mod E) or by DeepSeek's policy on the expected load
    (EPLB on). Returns ``balancedness`` (Σ_l mean rank load / Σ_l max rank load, as dsflash.sharding.eplb),
    ``hits_mean`` (local experts hit per rank and layer) and ``moe_ms`` (per layer, the slowest rank's
    a h_r + c s_r + o, at least the floor; averaged over layers and draws)."""
    key = (N, float(tokens_per_gpu), E, k, R, eplb, zipf, tuple(moe_abc), floor_ms, layers, draws, seed)
    if key in _ROUTING_CACHE:
        return _ROUTING_CACHE[key]
    rng = np.random.default_rng(seed)
    T = int(round(N * tokens_per_gpu))
    if zipf > 0:
        base = 1.0 / np.arange(1, E + 1) ** zipf
        base /= base.sum()
        pop = np.stack([base[rng.permutation(E)] for _ in range(layers)])
        incl = np.zeros_like(pop)
        for li in range(layers):  # top-k inclusion probability from 4096 sampled tokens
            g = rng.gumbel(size=(4096, E))
            top = np.argsort(-(np.log(pop[li])[None] + g), axis=1)[:, :k]
            incl[li] = np.bincount(top.ravel(), minlength=E) / 4096
    else:
        incl = np.full((layers, E), k / E)
    P = E + R
    if eplb:
        from dsflash.sharding.eplb import rebalance_experts
        phy2log, _, logcnt = rebalance_experts(incl * max(T, 1), P, 1, 1, N)
        phy2log, logcnt = np.asarray(phy2log), np.asarray(logcnt)
    else:
        phy2log = np.tile(np.arange(P) % E, (layers, 1))
        logcnt = np.stack([np.bincount(row, minlength=E) for row in phy2log])
    rep = np.zeros_like(phy2log)  # replica index of each physical slot among its expert's slots
    for li in range(layers):
        seen = np.zeros(E, np.int64)
        for j, e in enumerate(phy2log[li]):
            rep[li, j] = seen[e]
            seen[e] += 1
    a, c, o = moe_abc
    num = den = hits = ms = 0.0
    for _ in range(draws):
        load = rng.binomial(T, np.clip(incl, 0, 1)).astype(np.float64)                 # [L, E]
        per = np.take_along_axis(load / logcnt, phy2log, axis=1)                         # [L, P]
        hit = np.take_along_axis(load, phy2log, axis=1) > rep                            # [L, P]
        s_r = per.reshape(layers, N, P // N).sum(2)
        h_r = hit.reshape(layers, N, P // N).sum(2)
        num += s_r.mean(1).sum()
        den += s_r.max(1).sum()
        hits += h_r.mean()
        ms += np.maximum(a * h_r + c * s_r + o, floor_ms).max(1).mean()
    out = {"balancedness": float(num / den) if den > 0 else 1.0, "hits_mean": hits / draws, "moe_ms": ms / draws}
    _ROUTING_CACHE[key] = out
    return out


def balancedness(N: int, tokens_per_gpu: float, E: int = 384, k: int = 6, R: int = 0, eplb: bool = False,
                 zipf: float = 0.0) -> float:
    """EPLB balancedness of one step's MoE loads (``routing_stats``); 1.0 at N = 1."""
    if N <= 1:
        return 1.0
    return routing_stats(N, tokens_per_gpu, E, k, R, eplb, zipf)["balancedness"]


def straggler_factor(N: int) -> float:
    """E[max of N iid standard normals] (Blom's approximation; 0 at N = 1)."""
    if N <= 1:
        return 0.0
    return NormalDist().inv_cdf((N - 0.375) / (N + 0.25))


@dataclass
class Settings:
    """Everything a prediction depends on besides the calibration (all validated in ``check``)."""
    fabric: str = "nvlink-h200"
    collective: str = "all_to_all"     # all_to_all | allgather | ragged
    capacity_factor: float = 2.0
    dispatch_bytes: float = 2.0
    combine_bytes: float = 2.0
    efficiency: float = 0.75
    latency_us: float = 20.0
    overlap: float = 0.0
    redundant: int = 0
    eplb: bool = False
    zipf: float = 0.0
    gaps: str = "per_layer"            # per_layer | per_step
    host_ms: float = 0.0
    sigma_ms: float | None = None      # None: from the calibration

    def check(self):
        if self.fabric not in FABRICS:
            raise ValueError(f"fabric: unknown {self.fabric!r}; choose one of {', '.join(FABRICS)}")
        if self.collective not in ("all_to_all", "allgather", "ragged"):
            raise ValueError(f"collective: unknown {self.collective!r}; choose all_to_all, allgather or ragged")
        if self.gaps not in ("per_layer", "per_step"):
            raise ValueError(f"gaps: unknown {self.gaps!r}; choose per_layer or per_step")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap: must be in [0, 1], got {self.overlap}")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"efficiency: must be in (0, 1], got {self.efficiency}")
        for name in ("capacity_factor", "dispatch_bytes", "combine_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("latency_us", "host_ms", "zipf"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.sigma_ms is not None and self.sigma_ms < 0:
            raise ValueError(f"sigma_ms: must be >= 0, got {self.sigma_ms}")
        if self.redundant < 0:
            raise ValueError(f"redundant: must be >= 0, got {self.redundant}")
        return self


def comm_layer_ms(s: Settings, N: int, t: float, d: int, k: int, beta: float, phase: str,
                  tp: int = 1) -> tuple[float, float]:
    """(ms, bytes per GPU) of one layer's EP dispatch + combine (or TP all-reduces) on fabric ``s.fabric``."""
    f = FABRICS[s.fabric]
    if tp > 1:  # two ring all-reduces of t x d bf16 per layer
        nbytes = 2 * 2 * (tp - 1) / tp * t * d * 2
        peers = tp
    elif N <= 1:
        return 0.0, 0.0
    else:
        peers = N
        if s.collective == "allgather":
            nbytes = (N - 1) * t * d * (s.dispatch_bytes + 4.0)
        else:
            if s.collective == "ragged":
                pad = 1.0 / beta
            else:
                pad = s.capacity_factor if phase == "decode" else float(N)
            nbytes = pad * t * k * d * (s.dispatch_bytes + s.combine_bytes) * (N - 1) / N
    island = min(f["island"], peers)
    off = max(0, peers - island) / max(1, peers - 1)  # share of the peers off this GPU's NVLink island
    eff = s.efficiency * 1e9 / 1e3  # bytes per ms at 1 GB/s
    ms = max(nbytes * (1 - off) / (eff * f["nvlink_GBps"]), nbytes * off / (eff * f["ib_GBps"]))
    return 2 * s.latency_us / 1e3 + ms, nbytes


def predict(cal: Calibration, layout: Layout, *, phase: str = "decode", dep: int = 4, sequences: int = 32,
            rows: int = 1, context: int = 4096, settings: Settings | None = None, tp: int = 1,
            hits_override: float | None = None, tokens_per_step: float | None = None) -> dict:
    """One step's predicted time per GPU and its terms. decode: ``sequences`` x ``rows`` tokens per GPU at
    ``context``; prefill: ``sequences`` = 1, ``rows`` = new tokens of the chunk over ``context`` cached."""
    s = (settings or Settings()).check()
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase: must be decode or prefill, got {phase!r}")
    for name, val in (("dep", dep), ("sequences", sequences), ("rows", rows), ("tp", tp)):
        if not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {val!r}")
    if context < 0:
        raise ValueError(f"context: must be >= 0, got {context}")
    if tp > 1 and dep > 1:
        raise ValueError("tp: TP is modelled alone (dep must be 1 when tp > 1)")
    bench = cal.bench
    t = float(sequences * rows)
    E, k, L, d = layout.experts, layout.topk, layout.layers, layout.hidden
    ops = {}
    for op in cal.op_names:
        if op == MOE_OP:
            continue
        klass = OP_CLASS.get(op, "layer")
        m = layout.count(klass) / bench.count(klass)
        ops[op] = m * bench_op_ms(cal, op, phase, t, context) / tp
    N = dep
    R = redundant_for(E, s.redundant, N)
    E_loc = (E + R) / N
    if tp == 1 and N > 1 and hits_override is None:   # sampled loads: the slowest rank sets the layer's time
        st = routing_stats(N, t, E, k, R, s.eplb, s.zipf, cal.moe_abc, cal.moe_floor_ms)
        beta, hit = st["balancedness"], st["hits_mean"]
        slots_max = t * k / beta
        moe = L * st["moe_ms"]
    else:
        beta = 1.0
        hit = hits_override if hits_override is not None else experts_hit(E_loc, E, k, N * t)
        slots_max = t * k
        moe = L * moe_layer_ms(cal, hit, slots_max)
        if tp > 1:  # expert slices split over TP: per-expert and per-slot work split, the floor does not
            a, c, o = cal.moe_abc
            moe = L * max((a * hit + c * slots_max) / tp + o, cal.moe_floor_ms)
    comm_l, comm_bytes = comm_layer_ms(s, N, t, d, k, beta, phase, tp=tp)
    comm = L * comm_l * (1 - s.overlap)
    g = bench_gap_ms(cal, phase, t, context)
    gaps = g * (L / bench.layers if s.gaps == "per_layer" else 1.0)
    sigma = cal.sigma_ms() if s.sigma_ms is None else s.sigma_ms
    strag = sigma * straggler_factor(N if tp == 1 else tp)
    dense = sum(v for o, v in ops.items() if OP_CLASS.get(o, "layer") != "step")
    head = sum(v for o, v in ops.items() if OP_CLASS.get(o, "layer") == "step")
    terms = {"dense_attention": dense, "head_embed": head, "routed_experts": moe, "dispatch_combine": comm,
             "launch_gaps": gaps, "host": s.host_ms, "straggler": strag}
    total = sum(terms.values())
    per_seq = tokens_per_step if tokens_per_step is not None else (1.0 if phase == "decode" else t)
    out_tokens = sequences * per_seq if phase == "decode" else t
    return {
        "phase": phase, "dep": N, "tp": tp, "sequences": sequences, "rows": rows, "tokens_per_gpu": t,
        "context": context, "step_ms": total, "terms_ms": terms, "ops_ms": ops,
        "moe": {"local_experts": E_loc, "redundant": R, "experts_hit_per_layer": hit,
                "expert_bytes_hit_per_layer": hit * layout.expert_bytes / (tp if tp > 1 else 1),
                "slots_fullest_rank": slots_max, "balancedness": beta},
        "dispatch": {"collective": s.collective if tp == 1 else "allreduce", "bytes_per_gpu_per_layer": comm_bytes,
                     "ms_per_layer": comm_l},
        "tokens_per_s_per_gpu": 1e3 * out_tokens / total / (tp if tp > 1 else 1),
        "tokens_per_s_per_user": 1e3 * per_seq / total if phase == "decode" else None,
    }


# ------------------------------------------------------------------------------------------- memory


def memory_gb(layout: Layout, dep: int, redundant: int, dense_per_layer_gb: float = 0.175,
              head_embed_gb: float = 2.65) -> float:
    """Weights per GPU (GB): dense per layer (BENCHMARKS: 2.02 GB of bench dense weights less the 1.32 GB head,
    over 4 layers), head + embedding (bf16, 2 x 1.32 GB), the local experts' MXFP4 bytes."""
    E_loc = (layout.experts + redundant_for(layout.experts, redundant, dep)) / dep
    return layout.layers * (dense_per_layer_gb + E_loc * layout.expert_bytes / 1e9) + head_embed_gb


# ------------------------------------------------------------------------------------------- validation


def _err(pred, meas):
    return 100.0 * (pred - meas) / meas


def validate(cal: Calibration, bench: Layout, results_dir=RESULTS) -> list[dict]:
    """Predicted vs measured at every measured point (DEP1 on one H200, DEP2 on two), error %."""
    rows = []
    one = Settings(sigma_ms=0.0)
    # 1. calibration points: exact by construction (per op and the step)
    for name, p in cal.points.items():
        ph = p["phase"]
        pr = predict(cal, bench, phase=ph, dep=1, sequences=p["sequences"] if ph == "decode" else 1,
                     rows=p["rows"] if ph == "decode" else p["tokens"], context=p["context"], settings=one,
                     hits_override=p["experts_hit"])
        per_op = dict(pr["ops_ms"])
        per_op[MOE_OP] = pr["terms_ms"]["routed_experts"]
        op_err = {o: _err(per_op.get(o, 0.0), v) for o, v in p["ops"].items() if v > 0}
        rows.append({"point": f"DEP1 {name} (calibration)", "source": f"{p['file']} {p['selector']}",
                     "measured_ms": p["step_ms"], "predicted_ms": pr["step_ms"],
                     "error_pct": _err(pr["step_ms"], p["step_ms"]),
                     "max_abs_op_error_pct": max(abs(e) for e in op_err.values()), "kind": "calibration"})
    # 2. context interpolation on run 18's own grid: 32 x 6 @ 32K from its 4K / 128K points
    r18 = Calibration.load(results_dir, RUN18_POINTS, bench)
    m = read_point(Path(results_dir) / "step_profile_20261201_h200_run18_grid.json",
                   {"phase": "decode", "n": 32, "C": 32768})
    pr = predict(r18, bench, dep=1, sequences=32, rows=6, context=32768, settings=one, hits_override=m["experts_hit"])
    rows.append({"point": "DEP1 decode 32 x 6 @ 32K (held out; run 18 code, calibrated on run 18's 4K / 128K)",
                 "source": "step_profile_20261201_h200_run18_grid.json", "measured_ms": m["step_ms"],
                 "predicted_ms": pr["step_ms"], "error_pct": _err(pr["step_ms"], m["step_ms"]), "kind": "held_out"})
    # 3. routed-expert law vs the MoE kernel benchmark (one layer, 96 experts, the op alone)
    for f in MOE_KERNEL_FILES:
        path = Path(results_dir) / f
        if not path.exists():
            continue
        for r in json.loads(path.read_text())["moe_gemm"]:
            if not r.get("triton_s"):
                continue
            if f != MOE_KERNEL_FILES[0] and r["T"] < 4096:
                continue  # decode sizes: the newest defaults (run 13) only
            pred = moe_layer_ms(cal, r["active_experts"], r["slots"])
            floor = f == MOE_KERNEL_FILES[0] and r["T"] == 1
            rows.append({"point": f"MoE op, {r['T']} tokens x 96 experts "
                                  + ("(calibration: the law's floor)" if floor else "(held out)"),
                         "source": f"{f} ({r.get('triton_best_config')})", "measured_ms": 1e3 * r["triton_s"],
                         "predicted_ms": pred, "error_pct": _err(pred, 1e3 * r["triton_s"]),
                         "kind": "calibration" if floor else "held_out"})
    # 4. the engine's decode iteration (32 sequences x 1 row, ~2.1K context; run 22, before the grouped wo_a)
    eng = Path(results_dir) / "engine_bench-4l-96e_20261202_h200_run22.json"
    if eng.exists():
        d_ = json.loads(eng.read_text())
        e = d_["results"][0]
        C = d_["args"]["prompt_len"] + d_["args"]["max_tokens"] // 2  # mid-generation context
        pr = predict(cal, bench, dep=1, sequences=32, rows=1, context=C, settings=one)
        meas = e["decode_phase"]["ms_per_iter"]
        rows.append({"point": "DEP1 engine decode iteration, 32 x 1 @ ~2.1K (held out; code before the grouped "
                              "wo_a, ~0.1 ms slower o_proj)", "source": eng.name, "measured_ms": meas,
                     "predicted_ms": pr["step_ms"], "error_pct": _err(pr["step_ms"], meas), "kind": "held_out"})
    # 5. batch shape against issue 19's grid (commit 4ad97a8, triton, totals only): ratios within that run
    i19 = {6: 5.47, 48: 10.15, 192: 18.28, 384: 27.40}
    pred = {t: predict(cal, bench, dep=1, sequences=t // 6, rows=6, context=4096, settings=one)["step_ms"]
            for t in i19}
    for a_, b_ in ((48, 6), (384, 192)):
        rows.append({"point": f"DEP1 ratio step({a_ // 6} x 6) / step({b_ // 6} x 6) @ 4K (held out; issue 19 "
                              "grid, older code)", "source": "issue 19 (commit 4ad97a8)",
                     "measured_ms": i19[a_] / i19[b_], "predicted_ms": pred[a_] / pred[b_],
                     "error_pct": _err(pred[a_] / pred[b_], i19[a_] / i19[b_]), "kind": "held_out_ratio"})
    # 6. DEP2 on two H200 (bench-4l-48e, backend xla, allgather EP): an XLA calibration of the same law
    rows.append(validate_dep2_xla(results_dir))
    return rows


def validate_dep2_xla(results_dir=RESULTS) -> dict:
    """The only multi-GPU point ran the XLA reference path, whose per-op costs the Triton profile does not
    describe. Its own calibration: the XLA MoE reference per layer = e * local experts (it dequantises every
    local expert each call) + s * rows routed to them, fitted on the kernel benchmark's XLA times at 1 and 256
    tokens x 96 experts (run 13); the rest of the step = issue 19's XLA 32 x 6 @ 4K total (bench-4l-96e,
    100.3 ms, a later commit than the DEP2 run) less 4 such layers; DEP2 = that rest + 4 layers at 24 local
    experts over the rows the allgather brings them (384 tokens x 6 / 2 ranks / the run's balancedness; the
    decode buffer's unfilled rows fall past the last group and are not multiplied) + the allgather /
    reduce-scatter on H200 NVLink. ``alternative``: the same with a row cost that scales with the local
    expert count too (a ragged_dot that touches every group per row), which brackets the unknown."""
    k13 = json.loads((Path(results_dir) / MOE_KERNEL_FILES[0]).read_text())["moe_gemm"]
    x = {r["T"]: (r["slots"], 1e3 * r["xla_ref_s"]) for r in k13 if r.get("xla_ref_s")}
    (s1, y1), (s2, y2) = x[1], x[256]
    s_ = (y2 - y1) / (s2 - s1)
    e_ = (y1 - s_ * s1) / 96
    rest = 100.3 - 4 * (e_ * 96 + s_ * 1152)
    dep2 = json.loads((Path(results_dir) / "forward_20261130_h200_dep2.json").read_text())
    pt = dep2["points"][0]
    meas = pt["step_ms"]["median"]
    beta = pt["balancedness"]["real"]
    rows_rank = pt["tokens"] * 6 / 2 / beta
    moe2 = 4 * (e_ * 24 + s_ * rows_rank)
    moe2_alt = 4 * (e_ * 24 + s_ * rows_rank * 24 / 96)
    comm, _ = comm_layer_ms(Settings(collective="allgather"), 2, pt["tokens_per_rank"], 5120, 6, beta, "decode")
    pred = rest + moe2 + 4 * comm
    alt = rest + moe2_alt + 4 * comm
    return {"point": "DEP2 decode 32 x 6 @ 4K per rank, two H200 (bench-4l-48e, backend xla, allgather EP)",
            "source": "forward_20261130_h200_dep2.json; XLA law from kernels run 13 + issue 19's XLA total",
            "measured_ms": meas, "predicted_ms": pred, "error_pct": _err(pred, meas), "kind": "held_out",
            "terms_ms": {"non_moe_xla": rest, "moe_xla_4_layers": moe2, "allgather_4_layers": 4 * comm},
            "xla_law": {"ms_per_local_expert": e_, "ms_per_row": s_},
            "alternative": {"law": "row cost x local experts / 96", "predicted_ms": alt,
                            "error_pct": _err(alt, meas)}}


# ------------------------------------------------------------------------------------------- sweep + CLI


def sweep(cal: Calibration, layout: Layout, deps, settings: Settings, decode_batches, context: int,
          prefill_tokens, prefill_context: int, rows: int = 1, accept_len: float | None = None) -> dict:
    per_step = accept_len if accept_len is not None else 1.0
    out = {"decode": [], "prefill": [], "prefill_ragged": [], "tp4_one_user": None}
    for N in deps:
        R = redundant_for(layout.experts, settings.redundant, N)
        for b in decode_batches:
            p = predict(cal, layout, phase="decode", dep=N, sequences=b, rows=rows, context=context,
                        settings=settings, tokens_per_step=per_step)
            p["weights_gb_per_gpu"] = memory_gb(layout, N, settings.redundant)
            p["fits_141gb"] = p["weights_gb_per_gpu"] < 141.0
            out["decode"].append(p)
        for tkn in prefill_tokens:
            p = predict(cal, layout, phase="prefill", dep=N, sequences=1, rows=tkn, context=prefill_context,
                        settings=settings)
            p["redundant"] = R
            out["prefill"].append(p)
            rg = predict(cal, layout, phase="prefill", dep=N, sequences=1, rows=tkn, context=prefill_context,
                         settings=Settings(**{**asdict(settings), "collective": "ragged"}))
            out["prefill_ragged"].append(rg)
    tp = predict(cal, layout, phase="decode", dep=1, tp=4, sequences=1, rows=rows, context=context,
                 settings=settings, tokens_per_step=per_step)
    dep4 = predict(cal, layout, phase="decode", dep=4, sequences=1, rows=rows, context=context, settings=settings,
                   tokens_per_step=per_step)
    out["tp4_one_user"] = {"tp4": tp, "dep4_one_sequence_per_gpu": dep4}
    return out


def seed_comparison(cal: Calibration, layout: Layout, settings: Settings, context: int) -> dict:
    """The seed's MoE 13.4 -> 6.0 ms from DEP4 to DEP32 (ratio 0.45), and DEP32 slower than DEP16 from host
    overhead: the model's MoE ratio (routed experts + dispatch/combine) at several batches, and the straggler
    sigma at which DEP32's step would pass DEP16's."""
    rows = []
    for t in (8, 32, 64, 128, 256):
        p4 = predict(cal, layout, dep=4, sequences=t, rows=1, context=context, settings=settings)
        p16 = predict(cal, layout, dep=16, sequences=t, rows=1, context=context, settings=settings)
        p32 = predict(cal, layout, dep=32, sequences=t, rows=1, context=context, settings=settings)
        moe = lambda p: p["terms_ms"]["routed_experts"] + p["terms_ms"]["dispatch_combine"]  # noqa: E731
        gap = p32["step_ms"] - p16["step_ms"]
        sig = (-gap / (straggler_factor(32) - straggler_factor(16)))
        per_rank = -gap / (32 - 16)
        rows.append({"tokens_per_gpu": t, "moe_dep4_ms": moe(p4), "moe_dep32_ms": moe(p32),
                     "moe_ratio_dep32_over_dep4": moe(p32) / moe(p4),
                     "routed_only_ratio": p32["terms_ms"]["routed_experts"] / p4["terms_ms"]["routed_experts"],
                     "step_dep16_ms": p16["step_ms"], "step_dep32_ms": p32["step_ms"],
                     "extra_sigma_for_dep32_slower_ms": max(0.0, sig),
                     "host_ms_per_rank_for_dep32_slower": max(0.0, per_rank)})
    return {"seed": {"moe_dep4_ms": 13.4, "moe_dep32_ms": 6.0, "ratio": 6.0 / 13.4,
                     "dep32_slower_than_dep16": "from host overhead, before it was removed"},
            "model": rows}


def eplb_scenarios(cal: Calibration, layout: Layout, settings: Settings, deps, context: int, rows: int,
                   sequences: int = 32, zipf: float = 1.2, redundant: int = 32) -> list[dict]:
    """Decode at ``sequences`` per GPU under uniform routing, Zipf-skewed routing with contiguous experts, and
    the same skew with DeepSeek's EPLB placement and ``redundant`` extra experts (the policy of
    ``dsflash.sharding.eplb``, on the expected load)."""
    out = []
    cases = (("uniform, EPLB off", dict(zipf=0.0, eplb=False, redundant=0)),
             (f"Zipf {zipf}, EPLB off", dict(zipf=zipf, eplb=False, redundant=0)),
             (f"Zipf {zipf}, EPLB on, {redundant} redundant", dict(zipf=zipf, eplb=True, redundant=redundant)))
    for N in deps:
        row = {"dep": N}
        for name, kw in cases:
            p = predict(cal, layout, dep=N, sequences=sequences, rows=rows, context=context,
                        settings=Settings(**{**asdict(settings), **kw}))
            row[name] = {"step_ms": p["step_ms"], "balancedness": p["moe"]["balancedness"],
                         "routed_experts_ms": p["terms_ms"]["routed_experts"],
                         "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"]}
        out.append(row)
    return out


def _csv(s, typ=int):
    try:
        return [typ(x) for x in str(s).split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"bad list {s!r}: {e}") from None


def build(args) -> dict:
    bench, v41 = layouts()
    cal = Calibration.load(args.results_dir, bench=bench)
    s = Settings(fabric=args.fabric, collective=args.collective, capacity_factor=args.capacity_factor,
                 efficiency=args.efficiency, latency_us=args.latency_us, overlap=args.overlap,
                 redundant=args.redundant, eplb=args.eplb, zipf=args.zipf, gaps=args.gaps, host_ms=args.host_ms,
                 sigma_ms=args.sigma_ms).check()
    deps = _csv(args.dep)
    if not deps or any(n < 1 for n in deps):
        raise ValueError(f"dep: need DEP sizes >= 1, got {args.dep!r}")
    batches = _csv(args.batches)
    if not batches or any(b < 1 for b in batches):
        raise ValueError(f"batches: need sequences per GPU >= 1, got {args.batches!r}")
    prefill = _csv(args.prefill_tokens)
    if any(p < 1 for p in prefill):
        raise ValueError(f"prefill_tokens: need >= 1, got {args.prefill_tokens!r}")
    if args.rows < 1:
        raise ValueError(f"rows: must be >= 1, got {args.rows}")
    if args.context < 0 or args.prefill_context < 0:
        raise ValueError("context: must be >= 0")
    if args.accept_len is not None and not 0 < args.accept_len <= args.rows:
        raise ValueError(f"accept_len: must be in (0, rows={args.rows}], got {args.accept_len}")
    sw = sweep(cal, v41, deps, s, batches, args.context, prefill, args.prefill_context, rows=args.rows,
               accept_len=args.accept_len)
    alt = Settings(**{**asdict(s), "gaps": "per_step"})
    gaps_alt = [predict(cal, v41, dep=N, sequences=32, rows=args.rows, context=args.context, settings=alt)["step_ms"]
                for N in deps]
    val = validate(cal, bench, args.results_dir)
    fabrics = {}
    for fname in FABRICS:
        fs = Settings(**{**asdict(s), "fabric": fname})
        fabrics[fname] = [{"dep": N,
                           "decode_32_step_ms": predict(cal, v41, dep=N, sequences=32, rows=args.rows,
                                                        context=args.context, settings=fs)["step_ms"],
                           "prefill_4096_ragged_step_ms": predict(
                               cal, v41, phase="prefill", dep=N, sequences=1, rows=4096,
                               context=args.prefill_context,
                               settings=Settings(**{**asdict(fs), "collective": "ragged"}))["step_ms"]}
                          for N in deps]
    scen = eplb_scenarios(cal, v41, s, deps, args.context, args.rows) if not args.no_eplb_scenarios else None
    return {
        "benchmark": "scale_model",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit_or_none(),
        "model": "v41_flash (40 layers, 384 routed experts top-6, d 5120) from bench-4l-96e per-op costs, one H200",
        "equations": __doc__,
        "settings": asdict(s), "fabric": FABRICS[s.fabric], "assumptions": ASSUMPTIONS,
        "layouts": {"bench": asdict(bench), "target": asdict(v41)},
        "calibration": {
            "points": {k: {kk: vv for kk, vv in p.items()} for k, p in cal.points.items()},
            "moe_law_per_layer": {"ms_per_expert_hit": cal.moe_abc[0], "ms_per_slot": cal.moe_abc[1],
                                  "ms_fixed": cal.moe_abc[2],
                                  "implied_weight_TBps": bench.expert_bytes / (cal.moe_abc[0] * 1e-3) / 1e12},
            "sigma_ms": cal.sigma_ms(),
            "layer_class_multipliers": {kl: v41.count(kl) / bench.count(kl)
                                        for kl in ("layer", "index", "kv_source", "compressed", "step")},
        },
        "context": args.context, "rows": args.rows, "accept_len": args.accept_len,
        "predictions": sw,
        "gaps_per_step_alternative": {"sequences": 32, "dep": deps, "step_ms": gaps_alt},
        "fabric_comparison": fabrics,
        "validation": val,
        "memory_check": {"weights_gb_per_gpu_dep4": memory_gb(v41, 4, 0), "issue_9_dep4_gb": 84.6,
                         "weights_gb_per_gpu_dep8": memory_gb(v41, 8, 0), "issue_9_dep8_gb": 47.6},
        "eplb_scenarios": scen,
        "seed_comparison": seed_comparison(cal, v41, s, args.context),
    }


def _commit_or_none():
    try:
        from dsflash.bench.kernels import _commit
        return _commit()
    except Exception:  # noqa: BLE001 - the commit is a label, never a reason to fail
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsflash.bench scale-model", description=__doc__.split("\n")[0])
    ap.add_argument("--dep", default="4,8,16,32,64,72", help="DEP sizes (GPUs), comma separated")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128", help="decode sequences per GPU")
    ap.add_argument("--rows", type=int, default=1, help="rows per sequence per step (1 plain, 6 = 1 + 5 drafts)")
    ap.add_argument("--accept-len", type=float, default=None, help="tokens per sequence per step (spec)")
    ap.add_argument("--context", type=int, default=8192, help="decode context (tokens)")
    ap.add_argument("--prefill-tokens", default="4096,8192,16384,32768", help="prefill chunk sizes per GPU")
    ap.add_argument("--prefill-context", type=int, default=0)
    ap.add_argument("--fabric", default="nvlink-h200", help=f"one of {', '.join(FABRICS)}")
    ap.add_argument("--collective", default="all_to_all", help="all_to_all | allgather | ragged")
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--efficiency", type=float, default=0.75)
    ap.add_argument("--latency-us", type=float, default=20.0)
    ap.add_argument("--overlap", type=float, default=0.0)
    ap.add_argument("--redundant", type=int, default=0, help="redundant experts (rounded up to divide)")
    ap.add_argument("--eplb", action="store_true", help="experts placed by DeepSeek's policy (else contiguous)")
    ap.add_argument("--zipf", type=float, default=0.0, help="routing skew (0 = uniform)")
    ap.add_argument("--gaps", default="per_layer", help="per_layer | per_step")
    ap.add_argument("--host-ms", type=float, default=0.0)
    ap.add_argument("--sigma-ms", type=float, default=None)
    ap.add_argument("--no-eplb-scenarios", action="store_true", help="skip the Zipf / EPLB table (imports jax)")
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--out", default=str(RESULTS / f"scale_model_{_dt.date.today():%Y%m%d}.json"))
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out); 'none' to skip")
    a = ap.parse_args(argv)
    res = build(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=float) + "\n")
    print(format_summary(res))
    print(f"# wrote {out}")
    if a.plot != "none":
        from dsflash.bench.plots import plot_scale_model
        png = plot_scale_model(res, a.plot or out.with_suffix(".png"))
        if png:
            print(f"# wrote {png}")
    return 0


def format_summary(res: dict) -> str:
    lines = [f"# scale model: {res['model']}; fabric {res['settings']['fabric']}, collective "
             f"{res['settings']['collective']}, context {res['context']}, rows {res['rows']}"]
    lines.append(f"{'DEP':>4} {'seq/GPU':>7} {'step ms':>8} {'dense':>7} {'experts':>8} {'a2a':>6} {'gaps':>6} "
                 f"{'strag':>6} {'beta':>5} {'tok/s/GPU':>9} {'tok/s/user':>10}")
    for p in res["predictions"]["decode"]:
        t = p["terms_ms"]
        lines.append(f"{p['dep']:>4} {p['sequences']:>7} {p['step_ms']:>8.2f} "
                     f"{t['dense_attention'] + t['head_embed']:>7.2f} {t['routed_experts']:>8.2f} "
                     f"{t['dispatch_combine']:>6.2f} {t['launch_gaps']:>6.2f} {t['straggler']:>6.2f} "
                     f"{p['moe']['balancedness']:>5.2f} {p['tokens_per_s_per_gpu']:>9.0f} "
                     f"{p['tokens_per_s_per_user']:>10.1f}")
    tp = res["predictions"]["tp4_one_user"]
    lines.append(f"# one user: TP4 {tp['tp4']['step_ms']:.2f} ms ({tp['tp4']['tokens_per_s_per_user']:.1f} tok/s), "
                 f"DEP4 at 1 seq/GPU {tp['dep4_one_sequence_per_gpu']['step_ms']:.2f} ms")
    lines.append("# validation (predicted vs measured):")
    for v in res["validation"]:
        lines.append(f"  {v['error_pct']:+7.1f} %  {v['predicted_ms']:9.3f} vs {v['measured_ms']:9.3f}  {v['point']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
