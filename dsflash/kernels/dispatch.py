"""The one kernel dispatch seam: which implementation each hot op runs, the pure-JAX reference (``"xla"``) or its
Triton kernel (``"triton"``). Every kernel front-end (``moe_gemm.routed_moe``, ``sparse_attention.
sparse_sink_attention``, ``indexer_topk.indexer_topk`` / ``select_topk``, ``mhc_fused.mhc_fused``) decides here and nowhere else.

Stable API (the engine and the server call these; keep the names and signatures):

  BACKENDS                       ("auto", "xla", "triton"): the values a ``backend`` setting may take
  resolve_backend(backend)       -> "xla" | "triton". "auto" is "triton" iff JAX's default backend is a GPU and
                                 ``import jax_triton`` succeeds (decided once per process, cached), else "xla".
                                 Anything else: ValueError naming ``backend``.
  use_triton(kernel, backend, size, *, precision=None, force=False) -> bool
                                 whether ``kernel`` (a key of GATES) runs its Triton kernel at ``size``
  kernel_summary(cfg, backend, **sizes) -> {kernel: {"decode": impl, "prefill": impl}}
                                 what each kernel runs at decode / prefill sizes of ``cfg`` (startup log);
                                 ``impl`` is "xla" or "triton" (the MoE's adds its config: "triton:sw_eo_np_bm8")
  describe(cfg, backend, **sizes) -> str   the same as one log line
  use_threshold_topk(entries) -> bool      whether the indexer's top-k runs the sort-free path (not a Triton kernel:
                                 GATES["topk_select"], on a GPU only)

The rule ``use_triton`` applies, in order:
  1. the backend: "xla" -> no; "triton" -> yes; "auto" -> ``resolve_backend("auto")``.
  2. the platform: off a GPU every kernel runs its reference, whatever was asked (so "triton" is safe anywhere).
  3. precision: a kernel that does not implement the run's precision (the MoE GEMM has no "fp32") runs the
     reference under "auto"; under an explicit "triton" the kernel is called and raises its own clear error.
  4. the measured crossover: ``GATES[kernel].triton`` lists the size ranges where a GPU run measured the kernel
     faster than the jitted XLA reference; elsewhere the reference runs. ``force=True`` (tests, the kernel bench)
     skips this step only.
Each table is one line of data below, changed only with a measurement behind it (the JSON under
``benchmarks/results/`` named in ``evidence``; docs/model-contract.md has the table in prose).

Why "auto" reaches the kernels unresolved (``RunOptions.backend`` keeps "auto"; this module resolves it at trace
time): building a ``RunOptions`` must not start JAX's backends (defaults are built at import time, and a multi-host
launch must call ``jax.distributed.initialize`` first), and step 3 needs to know that "triton" was not asked for
explicitly. The resolution is cached per process, so an "auto" program is the very program its concrete backend
traces (on CPU: bit-identical to "xla"; tests/test_kernels_dispatch.py). The cost: ``RunOptions(backend="auto")``
and ``RunOptions(backend="xla")`` are different static arguments, so a process using both compiles the same program
twice (the persistent cache, keyed by the HLO, then hits). Callers that branch on the backend themselves (e.g. "XLA
on one CPU device: dequantise the weights once") should branch on ``resolve_backend(backend)``, not the raw string.

Layering: this module imports nothing of dsflash but ``dsflash.kernels.moe_plan`` (pure JAX, for the summary) and
imports jax lazily (argument parsers import ``BACKENDS`` before JAX_PLATFORMS is settled); never the Triton modules.
"""
from __future__ import annotations

import dataclasses
import functools

BACKENDS = ("auto", "xla", "triton")
KERNELS = ("moe", "sparse_attention", "sparse_attention_paged", "indexer", "indexer_paged", "mhc", "fp8_linear",
           "topk")


@dataclasses.dataclass(frozen=True)
class Crossover:
    """Where one kernel's Triton implementation runs on a GPU.

    size        what ``use_triton``'s ``size`` counts for this kernel
    triton      inclusive (lo, hi) ranges of ``size`` measured faster than XLA (hi None: no upper bound)
    precisions  the run precisions the kernel implements (None: all)
    evidence    the measurement behind ``triton``"""
    size: str
    triton: tuple
    precisions: tuple | None = None
    evidence: str = ""

    def replace(self, **kw) -> "Crossover":
        return dataclasses.replace(self, **kw)

    def covers(self, size: int) -> bool:
        return any(lo <= size and (hi is None or size <= hi) for lo, hi in self.triton)


# The indexer's rule as measured: at or below this many (query row x index entry) scores the Triton scorer loses
# (H200, commit 199278b: 1 row x 8192 entries 0.095 ms vs XLA 0.078, launch-bound; 64 x 16384 1.18x, 32 x 65536
# 1.22x, 128 x 6 x 16384 1.11x). The crossover between 8K and 1M row-entries is unmeasured; only the losing point is.
INDEXER_XLA_MAX_ROW_ENTRIES = 8192
PAGED_MAX_ROWS = 8     # the paged indexer scores decode calls only (1 + drafts); prefill chunks gather the keys
# The Triton top-k ("topk" gate) splits rows of at least this many entries over several programs
# (topk_split_triton). H200 run 32 (kernel busy time in a trace, 32 x 6 rows x 131,072 entries, 16-bit keys): 0.329 ms
# split vs 0.442 one program a row; shorter rows are not measured split (so the candidate filter's 16,384 blocks stay
# on one program a row). JSON benchmarks/results/topk_trace_20261202_h200_run32.json
TOPK_SPLIT_MIN_ENTRIES = 131072

GATES = {
    # always, where the precision is implemented; the variant per size is moe_plan.pick_config (BM 8 decode tiles
    # up to 384 slots, BM 16 up to 32 slots per expert, the prefill kernel above)
    "moe": Crossover(
        "token slots (T * top-k)", ((1, None),), ("reference", "bf16"),
        "faster than XLA at every measured size: kernels_20261130_h200_run{7,8,9}*.json, "
        "kernels_20261201_h200_run12_moe_ps.json, kernels_20261201_h200_run13_moe_default.json"),
    # v3 "flash" kernel: 128 rows 0.108 ms vs XLA 0.181 (1.68x), 192 rows 0.153 vs 0.253 (1.65x); slower at 1 row
    # (0.054 vs 0.036) and 32 rows (0.074 vs 0.066); 33-127 rows not measured (one run at 64 rows in run 15 won,
    # ~15 % run-to-run spread: not enough to move the line)
    "sparse_attention": Crossover(
        "query rows (B * S)", ((128, None),), None,
        "kernels_20261201_h200_run11_attn_v3.json (run 15: kernels_20261201_h200_run15_attn_hs4.json)"),
    # the flash kernel reading the picked compressed entries straight from the NVFP4 pool (no bf16 gather, no
    # concatenation). GPU test passed (H200 s15, H100 s16). Timed in the step on an H100 (s16): no gain -- at 32 x 6
    # the kernel costs 0.13 ms more than the flash kernel on bf16 rows, the gather it removes saved 0.12; kernel-busy
    # equal at 1 / 32 x 6, back to back equal at 1 / 32 / 64 x 6. So no range (``force`` runs it for tests, the bench)
    "sparse_attention_paged": Crossover(
        "query rows (B * S)", (), ("reference",),
        "no faster in the step: step_profile_20261206_h100_s16_paged.json, step_profile_20261206_h100_s16_b2b.json"),
    "indexer": Crossover(
        "query rows x index entries (B * S * T)", ((INDEXER_XLA_MAX_ROW_ENTRIES + 1, None),), None,
        "kernels_20261130_h200_indexer_mhc.json (commit 199278b)"),
    # the scorer reading MXFP4 keys straight from the paged pool (decode rows only: indexer_topk.PAGED_MAX_ROWS);
    # replaces the bf16 gather of every key + the "indexer" scorer. H200 run 25 (32 x 6 rows): 128K entries 1.316 ms
    # against gather 2.174 + scorer 2.836; 4K 0.220 against 0.232 + 0.257; in the 32 x 6 @ 128K step 18.57 -> 13.19 ms.
    # The lower end copies the "indexer" gate's (one row over <= 8K entries stays on XLA, not re-measured)
    "indexer_paged": Crossover(
        "query rows x index entries (B * S * T)", ((INDEXER_XLA_MAX_ROW_ENTRIES + 1, None),), None,
        "indexer_split_20261202_h200_run25.json, step_profile_20261202_h200_run25_128k.json"),
    # split-d kernel: 0.099 / 0.079 / 0.085 / 0.104 / 0.586 / 1.851 ms at 1 / 16 / 64 / 256 / 4096 / 16384 tokens
    # against XLA 0.318 / 0.395 / 0.423 / 0.305 / 1.207 / 4.316 (2.1-5.0x). The tiny random model cannot judge it end
    # to end at "reference" (one fp32 ulp of coefficient noise moves its logits by 1.7e-1), so the switch was decided
    # on the trained demo model by tests/gpu/test_model_mhc_kernel.py (H200, 2026-12-01: kernel vs XLA logits 3.1e-2
    # against 3.9e-2 for 4e-6 coefficient noise)
    # dense FP8-stored linears (fp8_linear.py), in the whole step (bench-4l-96e, per-op trace, run 21): 1 x 6 rows
    # q / o / shared 1.26 -> 0.71 ms, step 4.54 -> 3.97 ms; 32 x 6 (192 rows) 1.79 -> 1.51 ms, step 10.40 -> 10.15.
    # The kernel-only loop timings (run 20) lost at 4096 rows (0.6-0.8x cuBLAS behind XLA's dequantised copy). Session
    # 24 (H200, il layout, variants moeil / moeil_fp8_256 / moeil_fp8off): 64 x 6 (384) rows 11.34 -> 10.90 ms with the
    # band stopped at 256 (10.74 with no band); 32 x 6 (192) rows 8.47 / 8.45 / 9.04. So the band stops at 256 (no
    # row count between 192 and 384 measured)
    "fp8_linear": Crossover(
        "rows (M)", ((1, 256),), ("reference", "bf16"),
        "step_profile_20261202_h200_run21.json (variants new / fp8lin); kernels_20261202_h200_run20_fp8linear.json; "
        "step_profile_20261207_h200_s24_fp8band.json"),
    "mhc": Crossover(
        "tokens (T)", ((1, None),), None,
        "kernels_20261130_h200_run10_mhc_split_moe16k.json (commit 4ae4c64); gpu_tests_20261201_h200_run11.log"),
    # the Triton radix top-k (topk_triton.py; the indexer's top-512 and the candidate filter's top blocks, same bits
    # as lax.top_k), taking precedence over "topk_select" where on. H200 run 26 (32 x 6 rows, ms, kernel 16-bit keys /
    # 32-bit keys vs lax.top_k + sort): top-512 of 4,096 entries 0.144 / 0.212 vs 0.193, 32,768: 0.371 / 0.417 vs
    # 0.905, 131,072: 1.008 / 1.286 vs 2.642; candidate filter over 512 blocks 0.180 vs 0.151 (loses), 4,096 blocks
    # 0.158 vs 0.246, 16,384: 0.234 vs 0.592. Mismatch 0 everywhere. So from 4,096 (16-bit keys, the bf16 indexer's
    # case; 32-bit keys lose 10 % there: fp32-precision runs only); below 4,096 unmeasured
    "topk": Crossover(
        "entries per row (T; blocks for the candidate filter)", ((4096, None),), None,
        "indexer_split_20261202_h200_run26.json (topk_triton{16,32}_ms, cand_filter_triton{16,32}_ms; mismatch 0)"),
    # Not a Triton kernel: the sort-free exact top-k (kernels/topk_select.py, pure JAX, same bits as lax.top_k) in
    # indexer_topk.select_topk / candidate_mask; ``triton`` here lists the row lengths (entries, or blocks for the
    # candidate filter) where it replaces lax.top_k on a GPU (use_threshold_topk). H200 run 25 (32 x 6 rows): top-512
    # of 131,072 entries 2.149 ms vs lax.top_k 2.286 (1.06x), the candidate filter's top-2048 of 16,384 blocks 0.334
    # vs 0.617 (1.85x); at 4,096 entries / 512 blocks it loses (0.264 vs 0.201, 0.234 vs 0.135), below the line.
    # 16K-64K entries are unmeasured (the line is a guess between the two points). Off a GPU: lax.top_k always
    # (on CPU the threshold path is mixed at short rows and 2-8x slower at 131072 entries: NOTES.md, 2026-12-02)
    "topk_select": Crossover(
        "entries per row (T)", ((16384, None),), None,
        "indexer_split_20261202_h200_run25.json (topk_radix_ms / cand_filter_radix_ms; mismatch 0)"),
}


def check_backend(backend, what: str = "backend") -> str:
    """``backend`` if it is one of BACKENDS, else ValueError naming ``what``."""
    if backend not in BACKENDS:
        raise ValueError(f"{what} must be one of {BACKENDS}, got {backend!r}")
    return backend


def on_gpu() -> bool:
    """The platform check (a function so tests can pretend)."""
    import jax
    return jax.default_backend() == "gpu"


def jax_triton_importable() -> bool:
    try:
        import jax_triton  # noqa: F401
    except Exception:      # ImportError, or a broken CUDA/triton install: either way no kernels
        return False
    return True


@functools.cache
def _auto_backend() -> str:
    return "triton" if on_gpu() and jax_triton_importable() else "xla"


def resolve_backend(backend, what: str = "backend") -> str:
    """"xla" | "triton" for a ``backend`` setting ("auto": Triton on a GPU with jax-triton, XLA otherwise)."""
    if check_backend(backend, what) == "auto":
        return _auto_backend()
    return backend


def use_triton(kernel: str, backend, size: int, *, precision: str | None = None, force: bool = False) -> bool:
    """True when ``kernel`` should run its Triton implementation at ``size`` (the rule: module docstring)."""
    if kernel not in GATES:
        raise ValueError(f"kernel must be one of {tuple(GATES)}, got {kernel!r}")
    if resolve_backend(backend) != "triton" or not on_gpu():
        return False
    gate = GATES[kernel]
    if precision is not None and gate.precisions is not None and precision not in gate.precisions:
        return backend == "triton"          # explicit: the kernel raises its own error
    return force or gate.covers(size)


def use_threshold_topk(entries: int) -> bool:
    """True when the indexer's top-k over rows of ``entries`` runs the sort-free path (GATES["topk_select"]): on a
    GPU in its range, whatever the backend (both paths are plain XLA and give the same bits)."""
    return on_gpu() and GATES["topk_select"].covers(entries)


# ------------------------------------------------------------------------------------------ startup summary

def _moe_config_name(rows: int, experts: int, precision: str, layout: str = "checkpoint") -> str:
    from dsflash.kernels import moe_plan
    cfg = moe_plan.pick_config(rows, experts, act_fp8=precision == "reference", layout=layout)
    return next((n for n, c in moe_plan.named_configs().items() if c is cfg), "unnamed")


def kernel_summary(cfg, backend, *, decode_tokens: int | None = None, prefill_tokens: int = 2048,
                   context: int = 8192, precision: str = "reference", expert_shards: int = 1,
                   moe_layout: str = "checkpoint") -> dict:
    """What each kernel runs at one decode step and one prefill chunk of ``cfg`` (a ModelConfig).

    decode_tokens   query rows of a decode step (default: one sequence's verification, 1 + DSpark block)
    prefill_tokens  query rows of a prefill chunk
    context         tokens the page table covers (the indexer scores every compressed entry of it)
    precision       the run precision (the MoE kernel has no "fp32")
    expert_shards   expert-parallel ranks (the MoE kernel sees n_routed_experts / expert_shards experts)
    moe_layout      the routed experts' weight layout ("checkpoint", or "il" repacked at load: its decode config)
    -> {kernel of KERNELS: {"decode": impl, "prefill": impl}} ("indexer_paged": only calls of <= PAGED_MAX_ROWS
        rows, larger ones gather the keys; "sparse_attention_paged": only calls whose picks number fewer than the
        page table's entries, as ``model/attention.py`` decides)"""
    if decode_tokens is None:
        decode_tokens = 1 + (cfg.dspark_block_size if cfg.num_nextn_predict_layers else 0)
    ratios = [cfg.compress_ratios[i] for i in cfg.index_source_layer_ids if i < cfg.num_hidden_layers]
    entries = context // min([r for r in ratios if r] or [1])
    experts = max(1, cfg.n_routed_experts // expert_shards)
    out = {}
    for phase, t in (("decode", decode_tokens), ("prefill", prefill_tokens)):
        sizes = {"moe": t * cfg.num_experts_per_tok, "sparse_attention": t, "indexer": t * entries, "mhc": t,
                 "fp8_linear": t, "indexer_paged": t * entries if t <= PAGED_MAX_ROWS else 0, "topk": entries,
                 "sparse_attention_paged": t if t * cfg.index_topk < entries else 0}
        for kernel, size in sizes.items():
            impl = "triton" if use_triton(kernel, backend, size, precision=precision) else "xla"
            supported = GATES[kernel].precisions is None or precision in GATES[kernel].precisions
            if impl == "triton" and not supported:
                impl += f":no-{precision}(raises)"
            elif kernel == "moe" and impl == "triton":
                impl += ":" + _moe_config_name(size, experts, precision, moe_layout)
            out.setdefault(kernel, {})[phase] = impl
    return out


def describe(cfg, backend, **sizes) -> str:
    """kernel_summary as one line: ``kernels (backend auto -> triton): moe decode=triton:... prefill=...; ...``."""
    import jax
    s = kernel_summary(cfg, backend, **sizes)
    body = "; ".join(f"{k} decode={v['decode']} prefill={v['prefill']}" for k, v in s.items())
    return f"kernels (backend {backend} -> {resolve_backend(backend)}, platform {jax.default_backend()}): {body}"
