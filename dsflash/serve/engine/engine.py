"""LLMEngine: requests in, RequestOutputs out, one step at a time, composed of three parts with one owner each:

* ``Scheduler`` (``scheduler.py``): queues, page / slot pools, prefix cache, sequences -> a ``StepPlan``;
* ``Runner`` (``runner.py``): the compiled device programs, the model and row state, their host mirrors;
* ``OutputProcessor`` (``output.py``): tokens -> stops, text, ``RequestOutput``s.

A step is ``plan = scheduler.schedule()`` -> ``runner.launch(...)`` -> ``outputs.process(...)``. DP ranks are a
dimension of the scheduler's pools and the runner's row layout, EPLB a hook of the runner (``runner.after_step``),
P/D a policy of the scheduler (``scheduler.policy``, ``dsflash/serve/pd/engine.py``). See docs/engine.md.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from dsflash.model.state import CacheGeometry
from dsflash.serve.engine import runner as R
from dsflash.serve.engine.adaptive import SpeculationPolicy
from dsflash.serve.engine.backend import make_backend
from dsflash.serve.engine.config import EngineConfig, kernels_summary
from dsflash.serve.engine.metrics import EngineMetrics
from dsflash.serve.engine.output import OutputProcessor
from dsflash.serve.engine.scheduler import DECODE, Scheduler, Sequence
from dsflash.serve.engine.snapshots import SnapshotCache
from dsflash.serve.types import EngineRequest, RequestOutput, SamplingParams

log = logging.getLogger("dsflash.serve.engine")


class LLMEngine:
    def __init__(self, model="demo", config: EngineConfig | None = None, **options):
        """``model``: a name for ``dsflash.load``, a loaded ``Model`` (its run options are carried) or an engine
        backend (``ModelBackend``, ``ToyBackend``). Settings: an ``EngineConfig`` and/or its fields as
        keywords (keywords win)."""
        t0 = time.perf_counter()
        if config is not None:
            options = {**{f: getattr(config, f) for f in config.__dataclass_fields__}, **options}
        self.config = c = EngineConfig.from_kwargs(**options)
        if c.compilation_cache:
            R.enable_compilation_cache(c.compilation_cache_dir)
        R.install_compile_listener()
        self.backend = be = make_backend(model, c)
        self.run_options = be.run_options() if hasattr(be, "run_options") else {}
        self.tokenizer = None if c.skip_tokenizer_init else getattr(be, "tokenizer", None)
        self.model_name = c.model_name or (model if isinstance(model, str) else be.name)
        self.max_num_seqs, self.max_model_len, self.page_size = c.max_num_seqs, c.max_model_len, c.page_size
        self.max_logprobs, self.max_stop_ids = c.max_logprobs, c.max_stop_ids
        self.speculative = bool(c.speculative) and c.speculative_mode != "off" and be.block > 0
        self.speculation = SpeculationPolicy(be.block if self.speculative else 0,
                                             c.speculative_mode if self.speculative else "off",
                                             draft_in_mixed_steps=c.speculative_in_mixed_steps)
        self.k = be.block if self.speculative else 0
        self.async_scheduling = bool(c.async_scheduling)
        # called (on the stepping thread) with the first tokens of prompts that complete in a step carrying a
        # decode call too, before that call runs: a new row joins the step's decode call (scheduler
        # ``_join_decode``), and without this its first token would wait for the whole call (AsyncEngine sets it)
        self.first_token_hook = None
        self.dp = dp = c.dp_size(getattr(be, "dp", 1))
        lay = c.layout(self.k + 1, dp)
        self.pages_per_seq = lay.pages_per_seq
        # exact prefix caching: rings one block longer, so a prompt's last chunk can run past its last full block
        # boundary (where a repeat hits) and that boundary's state is still in the rings to snapshot after the call
        # (snapshots.py "Tail"): one prefill call instead of a chunk cut at the boundary plus a tail call. Only where
        # snapshots will be kept: otherwise the longer rings would be memory for nothing
        slack = max(16, 2 * (self.k + 1))
        self.geo = CacheGeometry(num_slots=c.max_num_seqs, num_pages=lay.num_pages, page_size=c.page_size,
                                 ring_slack=slack)
        self.snapshot_tail = c.page_size if self._keeps_snapshots(be, c, self.geo, lay.num_pages) else 0
        if self.snapshot_tail:
            self.geo = dataclasses.replace(self.geo, ring_slack=slack + self.snapshot_tail)
        # EPLB (docs/engine.md "EPLB"): physical expert arrays + tables in the params, before compiling
        from dsflash.serve.engine import eplb as E
        self.eplb = E.EngineEplb(be, window=c.eplb_window, interval=c.eplb_interval,
                                 redundant=c.eplb_redundant_experts) if c.eplb else None
        self.metrics = EngineMetrics(block=self.k, dp_size=dp)
        self.metrics.kv_pages_total = lay.num_pages
        self.runner = R.Runner(be, self.geo, max_num_seqs=c.max_num_seqs, pages_per_seq=lay.pages_per_seq,
                               prefill_buckets=lay.run_buckets, speculative=self.speculative,
                               max_iters=c.decode_steps, max_logprobs=c.max_logprobs, max_stop_ids=c.max_stop_ids,
                               dp=dp, eplb=self.eplb,
                               snapshot_bytes=c.prefix_snapshot_bytes if self._wants_snapshots(c) else 0,
                               max_snapshots=lay.num_pages, draft_lengths=self.speculation.lengths,
                               lazy_draft_context=c.lazy_draft_context,
                               sequential_verify=self._sequential_verify(c), snapshot_tail=self.snapshot_tail,
                               tap_free_plain=c.tap_free_plain and self.speculation.mode == "adaptive")
        # tap-free plain calls (docs/engine.md "Tap-free plain calls"): the recording calls that rewrite a row's
        # last W taps, all a catch-up reads (rows running decode_steps iterations a call)
        self._tap_lead = -(-self.runner.tap_window // c.decode_steps) if self.runner.tap_free else 0
        self.speculation.sequential_verify = self.runner.sequential_verify     # its cost grows with acceptance
        draft_sampling = getattr(be, "supports_row_keys", True) if c.draft_sampling is None else c.draft_sampling
        self.scheduler = Scheduler(
            num_slots=c.max_num_seqs, num_pages=lay.num_pages, page_size=c.page_size,
            pages_per_seq=lay.pages_per_seq, dp=dp, block=self.k, decode_steps=c.decode_steps,
            max_num_batched_tokens=c.max_num_batched_tokens, prefix_caching=bool(c.enable_prefix_caching),
            prefix_replay=c.prefix_replay, replay_window=be.sliding_window,
            replay_exact=(be.num_layers + 2) * be.sliding_window, prefill_buckets=self.runner.prefill_buckets,
            mirror=self.runner.mirror, draft_sampling=bool(draft_sampling), metrics=self.metrics, seed=c.seed,
            snapshots=SnapshotCache(self.runner.snap.capacity) if self.runner.snap is not None else None,
            prefix_cache_mode=c.prefix_cache_mode, mixed_prefill_tokens=c.max_mixed_prefill_tokens,
            snapshot_tail=self.snapshot_tail)
        if self._wants_snapshots(c) and self.runner.snap is None:
            log.warning("prefix_cache_mode='exact' keeps no snapshots here (%s): prefix-cache hits use the "
                        "replay", "DP mesh" if self.runner.mesh is not None else
                        f"budget {c.prefix_snapshot_bytes} B < one snapshot ({self.runner.snapshot_nbytes} B)")
        self.outputs = OutputProcessor(self.scheduler, self.metrics, tokenizer=self.tokenizer,
                                       eos_token_id=be.eos_token_id, block=self.k)
        self._inflight = None                   # async scheduling: the step dispatched last, not yet processed
        self._bind_multihost(c)
        self.memory = self.runner.state_nbytes()
        self.memory["capacity_tokens"] = lay.num_pages * c.page_size
        self.memory["num_pages"] = lay.num_pages
        t1 = time.perf_counter()
        link = self.runner.link
        sync = {"sync": lambda: link.barrier("warmup")} if link is not None else {}   # multi-controller only
        # background compile (docs/engine.md "Programs"): an adaptive engine serves once its prefill buckets and
        # the plain recording program are compiled; the drafting and the tap-free programs compile on daemon threads
        # and run only once compiled (until then every decode call is plain and records: ``_draft_compiled``)
        later = ()
        if c.background_compile and self.speculation.mode == "adaptive" and link is None:
            later = (self.k, R.TAP_FREE) if self.runner.tap_free else (self.k,)
        self.runner.warmup(threads=c.compile_threads, background=later, **sync)
        if link is not None:
            t2 = time.perf_counter()
            n = link.warmup()
            log.info("multi-controller: %d plan broadcasts compiled in %.1fs", n, time.perf_counter() - t2)
        self.warmup_time = time.perf_counter() - t1
        self.startup_time = time.perf_counter() - t0
        self._compiles_in_steps = 0
        log.info("engine %s: programs compiled in %.1fs%s; %s", self.model_name, self.warmup_time,
                 f" (compiling in the background: {', '.join(R.program_name(d) for d in later)})" if later else "",
                 self.kernels_line)

    # ------------------------------------------------------------------ background compile
    def _draft_compiled(self) -> bool:
        """Whether the drafting program may run (not still compiling in the background, nor failed to)."""
        return not self.k or self.runner.available(self.k)

    @property
    def programs_ready(self) -> bool:
        """Every decode program compiled (False while one compiles in the background or after its compile failed)."""
        return all(b["state"] == "ready" for b in list(self.runner.background.values()))

    def wait_for_programs(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles (``EngineConfig.background_compile``) to finish, compiled or failed;
        False if ``timeout`` seconds passed first. Benchmarks and tests that need every program call this."""
        return self.runner.wait_for_background(timeout)

    # ------------------------------------------------------------------ multi-controller (multihost.py)
    def _bind_multihost(self, c):
        """Several processes (``jax.distributed``): process 0 leads, the others replay its steps (``follow``)."""
        from dsflash.serve.engine import multihost as MH
        if not MH.is_multi_controller():
            return
        if self.runner.mesh is None:
            raise ValueError("mesh: multi-controller serving needs a DP mesh over every process's devices "
                             "(e.g. mesh='dep=8' for 2 processes x 4 devices)")
        if self.eplb is not None:
            raise ValueError("eplb: not supported in multi-controller serving yet (docs/multihost.md)")
        self.runner.link = MH.PlanLink(self.runner)

    @property
    def is_leader(self) -> bool:
        """True in a single-process engine and in process 0 of a multi-controller job."""
        return self.runner.link is None or self.runner.link.leader

    def follow(self) -> int:
        """A follower's whole life: run the leader's steps until it closes (returns the number of steps)."""
        from dsflash.serve.engine.multihost import follow
        return follow(self)

    def close(self) -> None:
        """Release the followers of a multi-controller job (the leader's last call; idempotent)."""
        link = self.runner.link
        if link is None or not link.leader or getattr(self, "_closed", False):
            return
        self._closed = True
        if self._inflight is not None:
            self._inflight[1].result()
            self._inflight = None
        ex = self.runner._executor
        if ex is not None:            # after every step already dispatched on that thread
            ex.submit(link.stop).result()
        else:
            link.stop()

    def _leader_only(self, what: str):
        if not self.is_leader:
            import jax
            raise RuntimeError(f"{what}: process {jax.process_index()} is a follower of a multi-controller job; "
                               "only process 0 takes requests (a follower calls follow())")

    # ------------------------------------------------------------------ the parts' state, by its usual names
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    groups = property(lambda self: self.scheduler.groups)
    pool = property(lambda self: self.scheduler.pool)
    slots = property(lambda self: self.scheduler.slots)
    rank_pools = property(lambda self: self.scheduler.rank_pools)
    balancer = property(lambda self: self.scheduler.balancer)
    prefix_caching = property(lambda self: self.scheduler.prefix_caching)
    prefix_replay = property(lambda self: self.scheduler.prefix_replay,
                             lambda self, mode: setattr(self.scheduler, "prefix_replay", mode))
    # "exact" | "replay"; may change between steps ("exact" needs the snapshot pool built at start-up)
    prefix_cache_mode = property(lambda self: self.scheduler.prefix_cache_mode,
                                 lambda self, mode: setattr(self.scheduler, "prefix_cache_mode", mode))

    def _sequential_verify(self, c) -> bool:
        """EngineConfig.sequential_verify resolved: None = on for adaptive speculation on a CPU backend."""
        if c.sequential_verify is not None:
            return bool(c.sequential_verify)
        import jax
        return self.speculation.mode == "adaptive" and jax.default_backend() == "cpu"

    @staticmethod
    def _wants_snapshots(c) -> bool:
        return bool(c.enable_prefix_caching) and c.prefix_cache_mode == "exact"

    @classmethod
    def _keeps_snapshots(cls, be, c, geo, max_snapshots) -> bool:
        """Whether the runner will build a snapshot pool: exact mode and ``snapshots.pool_capacity`` >= 1, the
        runner's own rule (a snapshot's size does not depend on the tail: ``snapshots.rows_kept``)."""
        mesh = getattr(be, "mesh", None)
        if not cls._wants_snapshots(c) or mesh is not None:     # (no state to trace when the answer is known)
            return False
        import jax

        from dsflash.serve.engine import snapshots as SN
        state = jax.eval_shape(lambda: be.init_state(geo))
        one = SN.snapshot_nbytes(state, SN.slot_leaf_mask(be, state), be.sliding_window)
        return SN.pool_capacity(one, c.prefix_snapshot_bytes, max_snapshots, mesh) >= 1

    @property
    def kernels_line(self) -> str:
        """Which kernels the compiled programs use (logged at start-up; the server prints it)."""
        ro = self.run_options
        if not ro:
            return f"backend: {type(self.backend).__name__} (no kernel backend)"
        cfg = getattr(self.backend, "cfg", None)
        c = self.config
        sizes = {"decode_tokens": c.max_num_seqs * self.runner.K1, "context": c.max_model_len,
                 "prefill_tokens": c.max_num_batched_tokens, "precision": ro["precision"],
                 "moe_layout": ro.get("moe_weight_layout", "checkpoint")} if cfg is not None else {}
        return (f"{kernels_summary(ro['backend'], cfg, **sizes)}; precision={ro['precision']}, "
                f"bounded_replay={ro['bounded_replay'] or 'exact'}{self._plain_program_kernels(cfg, sizes)}")

    def _plain_program_kernels(self, cfg, sizes) -> str:
        """The kernels line's ``decode=`` is the decode program at ``max_num_seqs * (block + 1)`` rows; an adaptive
        engine's draft-length-0 program runs ``max_num_seqs`` rows, where a kernel's gate can pick another
        implementation (H100, demo, batch 8: indexer xla, MoE sw_il, as the plain engine). Read as the program its
        plain calls run, that line suggested they ran the verify-width kernels (issue 23, they do not). This part
        names the plain program's rows and the kernels it runs differently."""
        r = self.runner
        if cfg is None or r.K1 == 1 or 0 not in r.draft_lengths:
            return ""
        from dsflash.kernels.dispatch import kernel_summary
        ro, rows = self.run_options, self.config.max_num_seqs
        wide = kernel_summary(cfg, ro["backend"], **sizes)
        one = kernel_summary(cfg, ro["backend"], **{**sizes, "decode_tokens": rows})
        diff = [f"{k} decode={v['decode']}" for k, v in one.items() if v["decode"] != wide[k]["decode"]]
        return (f"; decode= above: draft length {r.k} ({rows * r.K1} rows); draft length 0 ({rows} rows): "
                + (", ".join(diff) if diff else "the same decode kernels"))

    @property
    def compiles_after_warmup(self) -> int:
        """Traces / compiles / cache loads that happened inside ``step()`` (serving must cause none)."""
        return self._compiles_in_steps

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, dp_rank: int | None = None) -> None:
        """Queue a request. ``dp_rank`` pins it to a DP rank (default: the load balancer picks one)."""
        self.add(EngineRequest(request_id, prompt, params if params is not None else SamplingParams(),
                               arrival_time=arrival_time, dp_rank=dp_rank))

    def add(self, req: EngineRequest) -> None:
        """Queue one request envelope (the HTTP server's and the offline API's)."""
        self._leader_only("add_request")
        params, dp_rank, request_id = req.params, req.dp_rank, req.request_id
        if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, (int, np.integer))
                                    or not 0 <= dp_rank < self.dp):
            raise ValueError(f"dp_rank: {dp_rank!r} is not a DP rank in [0, {self.dp})")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        params.validate()
        text, ids = self._encode(req.prompt)
        V = self.backend.vocab_size
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {V})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room for output (max_model_len={self.max_model_len})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs: at most {self.max_logprobs} (engine max_logprobs)")
        stop = list(dict.fromkeys(params.stop_token_ids))
        if not params.ignore_eos and self.backend.eos_token_id is not None:
            stop = list(dict.fromkeys(stop + [int(self.backend.eos_token_id)]))
        if len(stop) > self.max_stop_ids:
            raise ValueError(f"SamplingParams.stop_token_ids: at most {self.max_stop_ids - 1} ids")
        if any(t >= V for t in stop):
            raise ValueError(f"SamplingParams.stop_token_ids: ids must be < vocab size {V}")
        guide = self._guide_factory(params)
        arrival = time.time() if req.arrival_time is None else req.arrival_time
        base_seed = params.seed if params.seed is not None else self.scheduler.draw_seed()
        seqs = []
        for i in range(params.n):
            s = Sequence(request_id, i, text, ids, params, arrival, base_seed + i, stop)
            s.detok = self.outputs.new_detok(params)
            s.guide = guide() if guide is not None else None
            seqs.append(s)
        self.scheduler.add(request_id, seqs, dp_rank)
        self.metrics.requests_added += 1
        self.metrics.prompt_tokens += len(ids) * params.n

    def _guide_factory(self, params):
        """Structured output: checks the constraint now (ValueError naming its field) and returns a maker of
        one matcher per sequence (None: unconstrained)."""
        if params.guided is None:
            return None
        if self.tokenizer is None or not hasattr(self.tokenizer, "hf"):
            raise ValueError(f"{params.guided.field}: guided decoding needs the model's tokenizer")
        from dsflash.serve.engine.guided import Guide
        V = self.backend.vocab_size
        first = Guide(params.guided, self.tokenizer, V)
        made = []

        def make():
            made.append(1)
            return first if len(made) == 1 else Guide(params.guided, self.tokenizer, V)
        return make

    def _encode(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return prompt, list(self.tokenizer.encode_prompt(prompt))      # BOS first, as the HTTP server
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError("prompt: must be a string or a list of token ids") from None
        return None, ids

    def abort_request(self, request_id: str) -> None:
        seqs = self.groups.get(request_id)
        if not seqs:
            return
        for s in seqs:
            if not s.finished:
                self.scheduler.finish(s, "abort")
        self.metrics.requests_aborted += 1
        self.outputs.emit_now(request_id)

    def discard_pending_outputs(self) -> None:
        """Drop outputs not handed out yet (an offline caller that stopped listening)."""
        self.outputs.pending.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_work or self.outputs.pending or self._inflight is not None)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One step: schedule, launch, process. With ``async_scheduling`` this step's device work is dispatched
        *before* the previous step's results are read back and processed, so host work (output processing,
        detokenisation, stop strings, the next schedule) overlaps the device."""
        t_start = time.perf_counter()
        c0 = R.compile_count()
        # the draft length first: the scheduler grows pages and splits the token budget for draft length + 1
        # tokens per decode iteration (a plain call leaves more of the budget to prefill)
        decoding = [s for s in self.running if s.status == DECODE]
        prefilling = bool(self.waiting) or len(decoding) < len(self.running)
        # ... and plain in a step that prefills where drafting would displace prompt tokens (or in every such step
        # with speculative_in_mixed_steps off: adaptive.py "Prefill first")
        prefill, displaced = self._prefill_conflict(decoding, prefilling)
        # the sequences such a step holds up besides its decode rows: prompts prefilling, waiting ones free slots take
        held = len(self.running) - len(decoding) + min(len(self.waiting), max(0, self.max_num_seqs - len(self.running)))
        self.scheduler.K1 = self.speculation.choose(decoding, prefilling=prefilling, displaces_prefill=displaced,
                                                    prefill_tokens=prefill, held=held,
                                                    draft_ready=self._draft_ready(decoding),
                                                    draft_compiled=self._draft_compiled()) + 1
        plan = self.scheduler.schedule()
        rec = None
        early: list = []          # prefill results already processed (handed out before the decode call)
        if plan:
            inputs = self.runner.step_inputs(plan)       # from the sequences as they are before this step
            self.scheduler.commit(plan)
            draft_len = plan.K1 - 1 if plan.decode else None
            if draft_len == 0 and self._tap_free(decoding):
                draft_len = R.TAP_FREE
                self.speculation.tap_free_calls += 1
            self._track_taps(plan, draft_len, decoding)
            on_prefill = None
            if self.first_token_hook is not None and not self.async_scheduling and plan.decode \
                    and any(last for _, _, last in plan.prefill_items):
                def on_prefill(pf, plan=plan):
                    early.append(pf)
                    first: set[str] = set()
                    self.outputs.process(plan, pf, None, time.time(), first)
                    outs = self.outputs.collect(first, pending=False)
                    if outs:
                        self.first_token_hook(outs)
            rec = (plan, self.runner.launch(*inputs, asynchronous=self.async_scheduling,
                                            restores=plan.restores, saves=plan.saves, draft_len=draft_len,
                                            on_prefill=on_prefill))
        todo = rec
        if self.async_scheduling:
            todo, self._inflight = self._inflight, rec
        progressed: set[str] = set()
        wait = 0.0
        if todo is not None:
            done_plan, handle = todo
            t0 = time.perf_counter()
            pf, dc = handle.result()
            wait = time.perf_counter() - t0
            self.outputs.process(done_plan, None if early else pf, dc, time.time(), progressed)
            if dc is not None:
                self._observe_speculation(done_plan, dc)
            self.runner.after_step(pf, dc)
        outs = self.outputs.collect(progressed)
        t_end = time.perf_counter()
        m = self.metrics
        m.num_steps += 1
        m.step_time.append(t_end - t_start)
        m.host_time.append(t_end - t_start - wait)
        m.num_running = len(self.running)
        m.num_waiting = len(self.waiting)
        m.kv_pages_used = self.pool.num_used
        m.kv_usage = self.pool.usage()
        if self.dp > 1:
            self.scheduler.update_dp_counts()
        self._compiles_in_steps += R.compile_count() - c0
        m.compiles_after_warmup = self.compiles_after_warmup
        return outs

    # ------------------------------------------------------------------ tap-free plain calls
    # Host bookkeeping of the lazy draft context's ring (runner.tap_free): per sequence ``spec_taps``, None while its
    # ring holds every position a catch-up would read (the context current after its prefill or a drafting call, and
    # every plain call since recorded), else the positions recorded since its last tap-free call. A drafting call
    # catches every active row up from its ring's last min(pos - ctx_pos, W) positions, so it may run only once each
    # decoding row has recorded W positions again (``_draft_ready``); the policy then defers a decision to draft.
    def _draft_ready(self, decoding) -> bool:
        if not self._tap_lead:
            return True
        W = self.runner.tap_window
        return all(s.spec_taps is None or s.spec_taps >= W for s in decoding)

    def _tap_free(self, decoding) -> bool:
        """Whether this plain call runs the tap-free program: the policy expects no drafting call within
        ``_tap_lead`` calls (``SpeculationPolicy.tap_free``), and no row is guided (one iteration a call: it would
        need W recording calls, not ``_tap_lead``)."""
        return bool(self._tap_lead) and self.runner.available(R.TAP_FREE) and \
            all(s.guide is None for s in decoding) and self.speculation.tap_free(decoding, self._tap_lead)

    def _track_taps(self, plan, draft_len, decoding):
        """``spec_taps`` after this step's calls (in launch order: async scheduling's later choice sees them)."""
        if not self._tap_lead:
            return
        for s, _, last in plan.prefill_items:      # a prompt's prefill sets its context current
            if last:
                s.spec_taps = None
        if draft_len is None:
            return
        if draft_len > 0:                          # the catch-up sets every active row's context current
            for s in decoding:
                s.spec_taps = None
            for s, _ in plan.decode:
                s.spec_taps = None
        elif draft_len == R.TAP_FREE:
            for s, h in plan.decode:
                if h > 0:
                    s.spec_taps = 0
        else:
            for s, h in plan.decode:
                if s.spec_taps is not None:
                    s.spec_taps += h

    def _prefill_conflict(self, decoding, prefilling) -> tuple[int, int]:
        """(prompt tokens this step prefills with a plain decode call, those a drafting call would take from it: 0
        where the budget has room for both, or the mixed-step cap binds either way), for the adaptive policy's
        prefill-first rule (adaptive.py). The second is only asked where the policy drafts in mixed steps: otherwise
        any prefill runs the call plain."""
        pol = self.speculation
        if pol.mode != "adaptive" or not decoding or not prefilling:
            return 0, 0
        room = self.scheduler.prefill_room
        plain = room(1)
        if not plain or not pol.draft_in_mixed_steps:
            return plain, 0
        return plain, max(0, plain - room(pol.block + 1))

    def _observe_speculation(self, plan, dc):
        """The decode call's cost and each sequence's verifications / accepted drafts, for the next choice."""
        per_seq = []
        for s, _ in (plan.decode if dc["draft_len"] else ()):     # a plain call verifies nothing
            i = s.slot if s.slot is not None else s.last_slot
            if i is not None:
                per_seq.append((s, int(dc["drafts"][i]), int(dc["acc_pos"][i].sum())))
        vr = dc.get("verify_rows")
        self.speculation.observe(int(dc["draft_len"]), dc["elapsed_s"], int(dc["iters"]), per_seq,
                                 None if vr is None else int(vr), max((h for _, h in plan.decode), default=None))

    # ------------------------------------------------------------------ introspection
    def metrics_snapshot(self) -> dict:
        d = self.metrics.snapshot()
        d["num_requests_running"] = len(self.running)
        d["num_requests_waiting"] = len(self.waiting)
        # live, not the last step's: an abort frees pages between steps and the engine may then idle
        d["kv_pages_used"] = self.pool.num_used
        d["kv_usage"] = self.pool.usage()
        d["kv_cached_pages"] = self.pool.num_cached
        d["kv_bytes_per_token"] = self.memory["global_kv_bytes_per_token"]
        d["kv_capacity_tokens"] = self.memory["capacity_tokens"]
        d["speculative"] = self.speculative
        sn = self.scheduler.snapshots
        d["prefix_cache_exact"] = self.scheduler.exact
        d["prefix_snapshots_cached"] = len(sn) if sn is not None else 0
        d["prefix_snapshots_capacity"] = sn.capacity if sn is not None else 0
        d["prefix_snapshot_saves"] = sn.saves if sn is not None else 0
        d["prefix_snapshot_restores"] = sn.restores if sn is not None else 0
        d["prefix_snapshot_evictions"] = sn.evictions if sn is not None else 0
        d["prefix_snapshot_bytes_each"] = self.memory["prefix_snapshot_bytes_each"]
        d["draft_block"] = self.k
        d.update(self.speculation.metrics())
        d["spec_sequential_verify"] = self.runner.sequential_verify
        d["warmup_time_s"] = self.warmup_time
        # background compile: programs still compiling, and per program its state (0 compiling, 1 available, -1 failed)
        # and compile seconds (0 until known)
        r = self.runner
        d["programs_compiling"] = len(r.compiling)
        d["programs_ready"] = self.programs_ready
        d["background_programs"] = {
            ("tap_free" if p == R.TAP_FREE else f"draft{p}"): {
                "state": {"compiling": 0, "ready": 1, "failed": -1}[b["state"]], "compile_s": b["compile_s"] or 0.0}
            for p, b in list(r.background.items())}
        if self.eplb is not None:
            d.update(self.eplb.metrics())
        if self.dp > 1:
            for r in range(self.dp):
                d["dp_ranks"][str(r)]["kv_cached_pages"] = self.rank_pools[r].num_cached
        # the names the HTTP server's Prometheus gauges look for (dsflash/serve/http/metrics.py)
        d["spec_decode_acceptance_rate"] = d["spec_acceptance_rate"]
        d["spec_decode_mean_acceptance_length"] = d["spec_mean_acceptance_length"]
        d["kv_cache_usage"] = d["kv_usage"]
        return d

    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        self.evict_prefix_snapshots()

    def evict_prefix_snapshots(self):
        """Drop every state snapshot not pinned by an admitted sequence (cached pages stay): later hits on
        them take the bounded-replay fallback (counted in ``prefix_snapshot_fallbacks``)."""
        if self.scheduler.snapshots is not None:
            self.scheduler.snapshots.clear()

    def eplb_rebalance(self):
        """Force an EPLB rebalance now (between steps): the policy runs on the current window and every
        layer's new placement (weights + tables) is installed at once. Returns the ``RebalancePlan``."""
        if self.eplb is None:
            raise ValueError("eplb: the engine was built without eplb=True")
        self.runner.params, plan = self.eplb.rebalance_now(self.runner.params)
        return plan

