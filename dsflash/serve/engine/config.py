"""``EngineConfig``: every engine setting, typed and validated once, built from keyword arguments or CLI
arguments by field name (``LLMEngine(model, max_num_seqs=8)``, ``EngineConfig.from_namespace(args)``).

The model's run options (``precision``, kernel ``backend``, ``bounded_replay``) are *carried*, not
re-defaulted: left unset they come from the loaded ``Model`` (``dsflash.load(..., backend="triton")`` runs
Triton in the engine too); set, they are honoured and the override is logged (``run_options``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

log = logging.getLogger("dsflash.serve.engine")

BACKENDS = ("auto", "xla", "triton")
PRECISIONS = ("reference", "bf16", "fp32")
BOUNDED_REPLAY = ("exact", "report", "layer20_full")   # "exact" = off (RunOptions' None)
PREFIX_CACHE_MODES = ("exact", "replay")
MOE_WEIGHT_LAYOUTS = ("auto", "checkpoint", "il")


def resolve_backend(name: str) -> str:
    """Kernel backend name -> the one the compiled programs use ("xla" | "triton").

    "auto" is Triton on a CUDA device when jax-triton imports, XLA otherwise. The one seam for this choice in
    the engine: it defers to ``dsflash.kernels.dispatch.resolve_backend`` when that exists."""
    try:
        from dsflash.kernels.dispatch import resolve_backend as _dispatch_resolve
    except ImportError:
        _dispatch_resolve = None
    if _dispatch_resolve is not None:
        return _dispatch_resolve(name)
    if name != "auto":
        return name
    import jax
    if jax.default_backend() != "gpu":
        return "xla"
    try:
        import jax_triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Triton kernels
        return "xla"
    return "triton"


def kernels_summary(backend: str, cfg=None, **sizes) -> str:
    """One line naming what the compiled programs run: per kernel (``dsflash.kernels.dispatch.describe``) when
    the model config is known, else the backend alone."""
    if cfg is None:
        return f"backend={backend} -> {resolve_backend(backend)}"
    from dsflash.kernels.dispatch import describe
    return describe(cfg, backend, **sizes)


class Layout(NamedTuple):
    """The engine's memory layout, derived from a config (``EngineConfig.layout``)."""
    pages_per_seq: int      # page-table width: the longest sequence plus one decode call of lookahead
    num_pages: int
    buckets: list           # prefill buckets per DP rank, (rows, tokens)
    run_buckets: list       # the compiled ones: rank r's rows at [r*rows, (r+1)*rows)


@dataclass
class EngineConfig:
    """Engine settings. ``None`` means "decided from the model" where the field says so."""
    # batch and memory geometry
    max_num_seqs: int = 16
    max_model_len: int = 512
    max_num_batched_tokens: int = 256
    num_pages: Optional[int] = None            # None: every slot can hold max_model_len
    page_size: int = 64
    prefill_buckets: Optional[list] = None     # [(rows, tokens), ...]; None: (r, B // r) and (1, r * (B // r))
    # a step that also decodes prefills at most this many tokens per DP rank, in a bucket of at most this many
    # rows x tokens (with the default buckets two are added for it; given buckets: those that fit, if any), so a
    # long prompt stalls the decode rows less; None: no cap. A chunk run in
    # the smaller program rounds differently (docs/engine.md), so outputs then depend on the load
    max_mixed_prefill_tokens: Optional[int] = None
    decode_steps: int = 4                      # on-device decode iterations per call
    max_logprobs: int = 20
    max_stop_ids: int = 16
    # decoding
    speculative: bool = True                   # DSpark draft-and-verify when the model has a draft
    # "adaptive": per decode call, draft or not by a measured cost model and each request's acceptance
    # (adaptive.py); "always": draft every call; "off": never (as speculative=False)
    speculative_mode: str = "adaptive"
    # adaptive: let the cost model draft in a step that also prefills, where the token budget has room for both
    # (False: every such call plain, adaptive.py "Prefill first"). On by default since session 28: one H100, demo,
    # 128 chat prompts x 5 passes, 1.65x plain against 1.29x at 8 sequences, 1.18x against 1.14x at 32 (BENCHMARKS)
    speculative_in_mixed_steps: bool = True
    # adaptive: the plain program skips the draft's context update; drafting catches it up from recorded taps
    lazy_draft_context: bool = True
    # adaptive with the lazy draft context: long plain stretches run a third decode program that records no taps,
    # recording again ceil(W / decode_steps) calls before a drafting call the policy schedules (a decision to draft
    # otherwise waits until every row's last W taps are recorded again; docs/engine.md "Tap-free plain calls")
    tap_free_plain: bool = True
    # verify as block + 1 one-row forwards, so a row rounds the same whatever the draft length (reproducible
    # adaptive output); None: on for adaptive speculation on CPU, where it costs little (docs/engine.md)
    sequential_verify: Optional[bool] = None
    draft_sampling: Optional[bool] = None      # sampled drafts at temperature > 0; None: when the backend can
    seed: int = 0                              # unseeded requests draw their seeds from this
    # the model's run options: None = the loaded model's own ("reference" / "auto" / exact for a name)
    precision: Optional[str] = None
    backend: Optional[str] = None              # "auto" | "xla" | "triton"
    bounded_replay: Optional[str] = None       # "exact" | "report" | "layer20_full"
    # routed-expert weights as stored ("checkpoint") or repacked once at load into the "il" layout the Triton MoE
    # decode reads with half the instructions (dsflash/kernels/moe_layout.py; other paths convert back per call)
    # "auto": "il" where the Triton backend runs on one device without EPLB, else "checkpoint"
    moe_weight_layout: str = "auto"
    # prefix cache
    enable_prefix_caching: bool = True
    # "exact": hits restore the per-slot state snapshotted at the block boundary (snapshots.py) and equal
    # misses; "replay": every hit rebuilds it by prefix_replay (the pre-snapshot behaviour)
    prefix_cache_mode: str = "exact"
    prefix_snapshot_bytes: int = 256 * 2**20   # device memory for the snapshots (at most one per page)
    prefix_replay: Any = "bounded"             # "bounded" (one window, SPEC §6.1) | "exact" | a token count;
                                               # exact mode uses it only where no snapshot was kept
    # scheduling
    async_scheduling: bool = False             # measured slower on one H200 (docs/engine.md)
    data_parallel_size: Optional[int] = None   # None: the mesh's DP size
    # EPLB (docs/engine.md "EPLB")
    eplb: bool = False
    eplb_window: int = 1000
    eplb_interval: int = 3000
    eplb_redundant_experts: int = 0
    # loading
    mesh: Any = None                           # a spec such as "dep=2" or a Mesh (model names only)
    load_options: Optional[dict] = None        # more dsflash.load keywords (model names only)
    model_name: Optional[str] = None
    skip_tokenizer_init: bool = False          # run without the model's tokenizer: token-id prompts, token-id outputs
    compilation_cache: bool = True             # persistent XLA cache (unless JAX's own cache dir is configured)
    compilation_cache_dir: Optional[str] = None  # its folder; None: $DSFLASH_CACHE_DIR, else ~/.cache/dsflash/jax
    compile_threads: Optional[int] = None      # threads compiling the programs at start-up; None: $DSFLASH_COMPILE_THREADS, else 1
    # adaptive speculation: serve once the prefill buckets and the plain decode program are compiled, compiling the
    # drafting and tap-free programs on background threads (each used once compiled; until then every call is plain);
    # False: every program compiled before the engine is ready (docs/engine.md "Programs")
    background_compile: bool = True

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ValueError(f"unknown engine options: {', '.join(unknown)}")
        return cls(**kw)

    @classmethod
    def from_namespace(cls, args, **overrides) -> "EngineConfig":
        """From parsed CLI arguments: every attribute named like a field (``--max-num-seqs`` ->
        ``max_num_seqs``); other attributes are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in vars(args).items() if k in names}
        kw.update(overrides)
        return cls(**kw)

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ validation (once, naming the field)
    def validate(self) -> None:
        def bad(name, msg):
            raise ValueError(f"EngineConfig.{name}: {msg}")

        def integer(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        for name, lo in (("max_num_seqs", 1), ("max_model_len", 2), ("max_num_batched_tokens", 1),
                         ("page_size", 1), ("decode_steps", 1), ("max_logprobs", 0), ("max_stop_ids", 1)):
            v = getattr(self, name)
            if not integer(v) or v < lo:
                bad(name, f"must be an integer >= {lo}, got {v!r}")
        if self.compile_threads is not None and (not integer(self.compile_threads) or self.compile_threads < 1):
            bad("compile_threads", f"must be a positive integer or None, got {self.compile_threads!r}")
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, (str, os.PathLike)):
            bad("compilation_cache_dir", f"must be a path or None, got {self.compilation_cache_dir!r}")
        if self.max_mixed_prefill_tokens is not None and (not integer(self.max_mixed_prefill_tokens)
                                                          or not 1 <= self.max_mixed_prefill_tokens):
            bad("max_mixed_prefill_tokens", f"must be a positive integer or None, got {self.max_mixed_prefill_tokens!r}")
        if self.num_pages is not None and (not integer(self.num_pages) or self.num_pages < 1):
            bad("num_pages", f"must be a positive integer or None, got {self.num_pages!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            bad("precision", f"must be one of {', '.join(PRECISIONS)} (or None: the model's), got {self.precision!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            bad("backend", f"must be one of {', '.join(BACKENDS)} (or None: the model's), got {self.backend!r}")
        if self.bounded_replay is not None and self.bounded_replay not in BOUNDED_REPLAY:
            bad("bounded_replay", f"must be one of {', '.join(BOUNDED_REPLAY)} (or None: the model's), "
                                  f"got {self.bounded_replay!r}")
        if self.moe_weight_layout not in MOE_WEIGHT_LAYOUTS:
            bad("moe_weight_layout", f"must be one of {', '.join(MOE_WEIGHT_LAYOUTS)}, got {self.moe_weight_layout!r}")
        if self.moe_weight_layout == "il" and (self.mesh is not None or self.eplb):
            bad("moe_weight_layout", "'il' is single-device only for now (the expert-parallel and EPLB paths read "
                                     "the checkpoint layout)")
        from dsflash.serve.engine.adaptive import SPECULATIVE_MODES
        if self.speculative_mode not in SPECULATIVE_MODES:
            bad("speculative_mode", f"must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative_mode!r}")
        if self.prefix_cache_mode not in PREFIX_CACHE_MODES:
            bad("prefix_cache_mode", f"must be one of {', '.join(PREFIX_CACHE_MODES)}, got {self.prefix_cache_mode!r}")
        if not integer(self.prefix_snapshot_bytes) or self.prefix_snapshot_bytes < 0:
            bad("prefix_snapshot_bytes", f"must be an integer >= 0, got {self.prefix_snapshot_bytes!r}")
        pr = self.prefix_replay
        if pr not in ("bounded", "exact") and not (integer(pr) and pr >= 1):
            raise ValueError("prefix_replay must be 'bounded' (SPEC §6.1, one window), 'exact' or a token count")
        if self.data_parallel_size is not None and (not integer(self.data_parallel_size)
                                                    or self.data_parallel_size < 1):
            raise ValueError(f"data_parallel_size: must be a positive integer, got {self.data_parallel_size!r}")
        from dsflash.serve.engine.eplb import check_options
        check_options(self.eplb, self.eplb_window, self.eplb_interval, self.eplb_redundant_experts)

    # ------------------------------------------------------------------ the model's run options
    def run_options(self, model_opts=None) -> dict:
        """``precision`` / ``backend`` (resolved: "xla" | "triton") / ``bounded_replay`` (None = exact) the
        engine's programs run with. Unset fields take the model's ``RunOptions`` (``model_opts``); a set field
        that differs from the model's is honoured and logged, never silently dropped."""
        have = {"precision": getattr(model_opts, "precision", None) or "reference",
                "backend": getattr(model_opts, "backend", None) or "auto",
                "bounded_replay": getattr(model_opts, "bounded_replay", None) or "exact"}
        out = {}
        for name, model_value in have.items():
            mine = getattr(self, name)
            if mine is None or mine == model_value:
                out[name] = model_value
                continue
            if model_opts is not None and not (name == "backend" and mine == "auto"):
                log.warning("engine %s=%r overrides the loaded model's %s=%r", name, mine, name, model_value)
            # "auto" asked of the engine with a model that chose a backend: the model's choice stands
            out[name] = model_value if (name == "backend" and mine == "auto" and model_opts is not None) else mine
        out["backend"] = resolve_backend(out["backend"])
        if out["bounded_replay"] == "exact":
            out["bounded_replay"] = None
        return out

    # ------------------------------------------------------------------ derived sizes
    def dp_size(self, mesh_dp) -> int:
        """DP ranks: the model's mesh DP size (dp x dep axes), or ``data_parallel_size`` (which must then agree;
        without a mesh it gives logical ranks: per-rank pools and row layout, one device)."""
        mesh_dp = int(mesh_dp or 1)
        want = self.data_parallel_size
        if want is None:
            return mesh_dp
        if mesh_dp > 1 and want != mesh_dp:
            raise ValueError(f"data_parallel_size: {want} but the mesh has DP size {mesh_dp}")
        return int(want)

    def layout(self, K1: int, dp: int) -> Layout:
        """Pages, page-table width and prefill buckets for ``K1`` tokens per decode iteration over ``dp`` ranks."""
        S, B, P = self.max_num_seqs, self.max_num_batched_tokens, self.page_size
        if S % dp:
            raise ValueError(f"max_num_seqs: {S} slots do not divide over the {dp} DP ranks")
        buckets = self.prefill_buckets
        if buckets is None:   # every bucket is one more forward to compile at start-up
            r = min(4, S // dp)    # with DP ranks, buckets and the token budget are per rank
            t = max(1, B // r)
            buckets = [(r, t)]
            if r > 1:   # a lone prompt gets the whole budget per step, not a quarter and 3 rows of padding; the
                buckets.append((1, r * t))   # same rows x tokens, so a prompt rounds the same in either (docs)
            cap = self.max_mixed_prefill_tokens
            if cap is not None and cap < r * t:     # the programs a mixed step runs
                tc = max(1, cap // r)
                buckets += [(r, tc)] + ([(1, r * tc)] if r > 1 else [])
        for rb, tb in buckets:
            if rb < 1 or tb < 1 or rb * tb > max(B, tb):
                raise ValueError(f"prefill bucket {(rb, tb)} exceeds max_num_batched_tokens={B}")
        pages_per_seq = math.ceil((self.max_model_len + (self.decode_steps + 1) * K1) / P)
        num_pages = self.num_pages if self.num_pages is not None else S * pages_per_seq
        if num_pages % dp:
            raise ValueError(f"num_pages: {num_pages} pages do not divide over the {dp} DP ranks")
        if num_pages // dp < math.ceil((self.max_model_len + K1) / P):
            raise ValueError(f"num_pages={num_pages} x page_size={P} cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}" + (f" per DP rank ({dp} ranks)" if dp > 1 else ""))
        run_buckets = buckets if dp == 1 else [(rb * dp, tb) for rb, tb in buckets]
        return Layout(pages_per_seq, num_pages, list(buckets), run_buckets)
