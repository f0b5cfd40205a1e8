"""LLMEngine: requests in, RequestOutputs out, one scheduling step at a time.

Per step: (1) page growth for decoding sequences (preempting the youngest running sequence by recompute
when the pool is full), (2) FCFS admission with prefix-cache lookup, (3) chunked prefill within the token
budget packed into one compiled bucket, (4) one on-device decode loop over every decoding sequence
(several draft-and-verify steps per call), (5) host processing of what came back (stop conditions,
detokenisation, prefix-cache registration, metrics). See docs/engine.md.

Data parallelism (a mesh with DP size D = dp * dep > 1, or ``data_parallel_size``): each DP rank owns the
contiguous slot range ``[r*S/D, (r+1)*S/D)`` and page range ``[r*N/D, (r+1)*N/D)``; a
``DPLoadBalancer`` picks each request's rank (or the request pins one with ``dp_rank``); every step
each rank admits, grows and plans its own rows, and the device calls lay rank r's rows in its own row
range of the global batch (ranks without work contribute dummy rows). D == 1 is the plain engine.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import random
import time
from collections import deque

import jax
import numpy as np

from dsflash.model.state import CacheGeometry
from dsflash.serve.engine import runner as R
from dsflash.serve.engine.config import EngineConfig, kernels_summary
from dsflash.serve.engine.kv_cache import PagePool, PagePoolGroup, SlotPool, SlotPoolGroup
from dsflash.serve.engine.metrics import EngineMetrics
from dsflash.serve.engine.scheduler import DECODE, FINISHED, PREFILL, WAITING, SchedulerMixin, Sequence
from dsflash.serve.types import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams

log = logging.getLogger("dsflash.serve.engine")


def enable_compilation_cache():
    """Persistent XLA compilation cache under ~/.cache/dsflash/jax unless the user configured one."""
    try:
        if not jax.config.jax_compilation_cache_dir:
            path = os.environ.get("DSFLASH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dsflash",
                                                                        "jax")
            os.makedirs(path, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", path)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # a read-only home must not stop serving
        pass


def make_backend(model, c: EngineConfig):
    """The engine's view of ``model`` (``backend.py``), with the run options ``c`` resolves against the
    model's own. A prebuilt backend cannot change its options: an explicit, different setting is an error."""
    from dsflash.model.api import Model
    from dsflash.serve.engine.backend import ModelBackend, load_model
    if not isinstance(model, (str, Model)) and all(hasattr(model, a) for a in ("propose", "init_state",
                                                                                "forward")):
        have = model.run_options() if hasattr(model, "run_options") else {}
        want = c.run_options(None) if have else {}
        for name in ("precision", "backend", "bounded_replay"):
            if have and getattr(c, name) is not None and want[name] != have[name]:
                raise ValueError(f"EngineConfig.{name}: {getattr(c, name)!r}, but the engine backend passed in "
                                 f"was built with {have[name]!r}; pass the Model (or set it on ModelBackend)")
        return model
    if isinstance(model, str):
        ro = c.run_options(None)
        load_opts = dict(c.load_options or {})
        if c.mesh is not None:
            load_opts["mesh"] = c.mesh
        load_opts.setdefault("precision", ro["precision"])
        load_opts.setdefault("backend", ro["backend"])
        model = load_model(model, **load_opts)
    elif c.mesh is not None or c.load_options:
        raise ValueError("EngineConfig.mesh / load_options: apply to model names; the Model passed in is loaded")
    ro = c.run_options(model.opts)
    return ModelBackend(model, precision=ro["precision"], backend=ro["backend"], bounded_replay=ro["bounded_replay"])


class LLMEngine(SchedulerMixin):
    def __init__(self, model="demo", config: EngineConfig | None = None, **options):
        """``model``: a name for ``dsflash.load``, a loaded ``Model`` (its run options are carried) or an engine
        backend (``ModelBackend``, ``ToyBackend``). Settings: an ``EngineConfig`` and/or its fields as
        keywords (keywords win)."""
        t0 = time.perf_counter()
        if config is not None:
            options = {**{f: getattr(config, f) for f in config.__dataclass_fields__}, **options}
        self.config = c = EngineConfig.from_kwargs(**options)
        if c.compilation_cache:
            enable_compilation_cache()
        R.install_compile_listener()
        self.backend = be = make_backend(model, c)
        self.run_options = be.run_options() if hasattr(be, "run_options") else {}
        self.tokenizer = getattr(be, "tokenizer", None)
        self.model_name = c.model_name or (model if isinstance(model, str) else be.name)
        max_num_seqs, max_model_len, page_size = c.max_num_seqs, c.max_model_len, c.page_size
        max_num_batched_tokens, num_pages = c.max_num_batched_tokens, c.num_pages
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculative = bool(c.speculative) and be.block > 0
        self.k = be.block if self.speculative else 0
        self.K1 = self.k + 1
        self.decode_steps = c.decode_steps
        self.max_logprobs = c.max_logprobs
        self.max_stop_ids = c.max_stop_ids
        self.prefix_caching = bool(c.enable_prefix_caching)
        self.prefix_replay = c.prefix_replay
        self.async_scheduling = bool(c.async_scheduling)
        self.draft_sampling = bool(getattr(be, "supports_row_keys", True) if c.draft_sampling is None
                                   else c.draft_sampling)
        buckets = c.prefill_buckets
        dp = self._dp_size(be, c.data_parallel_size)
        eplb_opts = dict(eplb=c.eplb, window=c.eplb_window, interval=c.eplb_interval,
                         redundant=c.eplb_redundant_experts)
        self.dp = dp
        if max_num_seqs % dp:
            raise ValueError(f"max_num_seqs: {max_num_seqs} slots do not divide over the {dp} DP ranks")
        if buckets is None:   # one bucket: every extra bucket is one more forward to compile at start-up
            r = min(4, max_num_seqs // dp)    # with DP ranks, buckets and the token budget are per rank
            buckets = [(r, max(1, max_num_batched_tokens // r))]
        for rb, tb in buckets:
            if rb < 1 or tb < 1 or rb * tb > max(max_num_batched_tokens, tb):
                raise ValueError(f"prefill bucket {(rb, tb)} exceeds max_num_batched_tokens={max_num_batched_tokens}")
        # geometry: one page table wide enough for the longest sequence plus one decode call of lookahead
        self.pages_per_seq = math.ceil((max_model_len + (self.decode_steps + 1) * self.K1) / page_size)
        if num_pages is None:
            num_pages = max_num_seqs * self.pages_per_seq
        if num_pages % dp:
            raise ValueError(f"num_pages: {num_pages} pages do not divide over the {dp} DP ranks")
        if num_pages // dp < math.ceil((max_model_len + self.K1) / page_size):
            raise ValueError(f"num_pages={num_pages} x page_size={page_size} cannot hold one sequence of "
                             f"max_model_len={max_model_len}" + (f" per DP rank ({dp} ranks)" if dp > 1 else ""))
        self.geo = CacheGeometry(num_slots=max_num_seqs, num_pages=num_pages, page_size=page_size,
                                 ring_slack=max(16, 2 * self.K1))
        # per-slot page-table fill for free rows (its rank's first page: idle rows read rank-local memory)
        self._pt_fill = np.zeros((max_num_seqs,), np.int32)
        if dp == 1:
            self.pool = PagePool(num_pages, page_size, self.prefix_caching)
            self.slots = SlotPool(max_num_seqs)
            self.rank_pools, self.rank_slots = [self.pool], [self.slots]
            self.balancer = None
            run_buckets = buckets
        else:
            from dsflash.sharding.dp_balance import DPLoadBalancer
            self.pool = PagePoolGroup(num_pages, page_size, self.prefix_caching, dp)
            self.slots = SlotPoolGroup(max_num_seqs, dp)
            self.rank_pools, self.rank_slots = self.pool.ranks, self.slots.ranks
            self.balancer = DPLoadBalancer(dp)
            self._pt_fill[:] = np.repeat(np.arange(dp, dtype=np.int32) * (num_pages // dp), max_num_seqs // dp)
            run_buckets = [(rb * dp, tb) for rb, tb in buckets]     # rank r's rows at [r*rb, (r+1)*rb)
        from dsflash.serve.engine import eplb as E
        # EPLB (docs/engine.md "EPLB"): physical expert arrays + tables in the params, before compiling
        self.eplb = E.EngineEplb(be, window=eplb_opts["window"], interval=eplb_opts["interval"],
                                 redundant=eplb_opts["redundant"]) if eplb_opts["eplb"] else None
        self.runner = R.Runner(be, self.geo, max_num_seqs=max_num_seqs, pages_per_seq=self.pages_per_seq,
                               prefill_buckets=run_buckets, speculative=self.speculative, max_iters=self.decode_steps,
                               max_logprobs=self.max_logprobs, max_stop_ids=self.max_stop_ids)
        self.metrics = EngineMetrics(block=self.k, dp_size=dp)
        self.metrics.kv_pages_total = num_pages
        self._rng = random.Random(c.seed)
        self._order = itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.groups: dict[str, list[Sequence]] = {}
        self._pending_outputs: dict[str, RequestOutput] = {}
        self._inflight = None
        self._executor = None
        # per-slot host mirrors of what the decode call needs
        self._pt = np.zeros((max_num_seqs, self.pages_per_seq), np.int32)
        self._pt[:] = self._pt_fill[:, None]
        self._sp = R.empty_sampling(max_num_seqs, self.max_stop_ids)
        self._floor = np.zeros((max_num_seqs,), np.int32)
        self.memory = self.runner.state_nbytes()
        self.memory["capacity_tokens"] = num_pages * page_size
        self.memory["num_pages"] = num_pages
        t1 = time.perf_counter()
        self.runner.warmup()
        self.warmup_time = time.perf_counter() - t1
        self.startup_time = time.perf_counter() - t0
        log.info("engine %s: programs compiled in %.1fs; %s", self.model_name, self.warmup_time, self.kernels_line)
        self._compiles_in_steps = 0

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _dp_size(be, requested):
        """DP ranks: the backend's mesh DP size (dp x dep axes), or ``data_parallel_size`` (which must then
        agree; without a mesh it gives logical ranks: per-rank pools and row layout, one device)."""
        mesh_dp = int(getattr(be, "dp", 1) or 1)
        if requested is None:
            return mesh_dp
        if not isinstance(requested, int) or requested < 1:
            raise ValueError(f"data_parallel_size: must be a positive integer, got {requested!r}")
        if mesh_dp > 1 and requested != mesh_dp:
            raise ValueError(f"data_parallel_size: {requested} but the mesh has DP size {mesh_dp}")
        return requested

    @property
    def kernels_line(self) -> str:
        """Which kernels the compiled programs use (logged at start-up; the server prints it)."""
        ro = self.run_options
        if not ro:
            return f"backend: {type(self.backend).__name__} (no kernel backend)"
        cfg = getattr(self.backend, "cfg", None)
        sizes = {"decode_tokens": self.max_num_seqs * self.K1, "context": self.max_model_len,
                 "prefill_tokens": self.max_num_batched_tokens, "precision": ro["precision"]} if cfg is not None else {}
        return (f"{kernels_summary(ro['backend'], cfg, **sizes)}; precision={ro['precision']}, "
                f"bounded_replay={ro['bounded_replay'] or 'exact'}")

    @property
    def compiles_after_warmup(self) -> int:
        """Traces / compiles / cache loads that happened inside ``step()`` (serving must cause none)."""
        return self._compiles_in_steps

    # ------------------------------------------------------------------ requests
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

    def _new_detok(self, params):
        tok = self.tokenizer
        if tok is None or not hasattr(tok, "token_bytes"):
            return None
        from dsflash.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(tok, params.stop, skip_special_tokens=params.skip_special_tokens,
                                      include_stop=params.include_stop_str_in_output)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, dp_rank: int | None = None) -> None:
        """Queue a request. ``dp_rank`` pins it to a DP rank (default: the load balancer picks one)."""
        params = params if params is not None else SamplingParams()
        if dp_rank is None:     # the HTTP server's X-data-parallel-rank rides on the params object
            dp_rank = getattr(params, "dp_rank", None)
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
        text, ids = self._encode(prompt)
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
        arrival = time.time() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        rank = 0
        if self.balancer is not None:       # a request (all its n samples) stays on its rank for life
            rank = self.balancer.choose(None if dp_rank is None else int(dp_rank))
            self.balancer.waiting[rank] += params.n - 1
        seqs = []
        for i in range(params.n):
            s = Sequence(request_id, i, text, ids, params, arrival, base_seed + i, stop)
            s.detok = self._new_detok(params)
            s.rank = rank
            seqs.append(s)
        self.groups[request_id] = seqs
        self.waiting.extend(seqs)
        self.metrics.requests_added += 1
        self.metrics.prompt_tokens += len(ids) * params.n

    def abort_request(self, request_id: str) -> None:
        seqs = self.groups.get(request_id)
        if not seqs:
            return
        for s in seqs:
            if not s.finished:
                self._finish(s, "abort")
        self.metrics.requests_aborted += 1
        self._pending_outputs[request_id] = self._make_output(request_id)
        self._retire_group(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._pending_outputs or self._inflight is not None)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ------------------------------------------------------------------ resources
    def _free(self, s: Sequence):
        if s.pages:
            self.rank_pools[s.rank].free(s.pages)
            s.pages = []
        if s.slot is not None:
            s.last_slot = s.slot
            self.rank_slots[s.rank].free(s.slot)
            self._pt[s.slot] = self._pt_fill[s.slot]
            s.slot = None
        s.hashes = []

    def _finish(self, s: Sequence, reason, stop_reason=None):
        s.finish_reason, s.stop_reason = reason, stop_reason
        if reason == "abort" and s.detok is not None and not s.detok.stopped:
            s.detok.finish()
        if s.status == WAITING:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass
        elif s in self.running:
            self.running.remove(s)
            self._register(s, s.computed if s.status == PREFILL else len(s.all_ids) - 1)
        self._free(s)
        s.status = FINISHED
        now = time.time()
        s.metrics.finished_time = now
        s.metrics.num_generation_tokens = len(s.out_ids)
        if reason != "abort":
            self.metrics.e2e.append(now - s.metrics.arrival_time)

    def _retire_group(self, rid):
        seqs = self.groups.get(rid)
        if seqs and all(s.finished for s in seqs):
            del self.groups[rid]
            self.metrics.requests_finished += 1

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One scheduling step. With ``async_scheduling`` the device work of this step is
        dispatched *before* the results of the previous step are read back and processed, so host work
        (output processing, detokenisation, stop strings, the next schedule) overlaps the device."""
        t_start = time.perf_counter()
        c0 = R.compile_count()
        progressed: set[str] = set()
        plan, decode = self._schedule()
        rec = self._dispatch(plan, decode)
        if self.async_scheduling:
            todo, self._inflight = self._inflight, rec
        else:
            todo = rec
        wait = 0.0
        if todo is not None:
            wait = self._process(todo, progressed)
        outs = [self._make_output(rid) for rid in progressed if rid in self.groups]
        for rid in [o.request_id for o in outs]:
            self._retire_group(rid)
        outs.extend(self._pending_outputs.values())
        self._pending_outputs.clear()
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
            self._update_dp_counts()
        self._compiles_in_steps += R.compile_count() - c0
        m.compiles_after_warmup = self.compiles_after_warmup
        return outs

    def _update_dp_counts(self):
        """Per-rank waiting / running (sequences) into the metrics and the load balancer (every step)."""
        D, m = self.dp, self.metrics
        w, u = [0] * D, [0] * D
        for s in self.waiting:
            w[s.rank] += 1
        for s in self.running:
            u[s.rank] += 1
        m.dp_num_waiting, m.dp_num_running = w, u
        m.dp_kv_usage = [p.usage() for p in self.rank_pools]
        self.balancer.update_all(list(zip(w, u)))

    def _count_dummy(self, ranks, rows):
        """A device call whose real rows belong to ``ranks`` (one entry per row): the other ranks' ``rows``
        rows run as dummy rows (valid=False)."""
        from dsflash.sharding.dp_balance import plan_step
        st = plan_step(np.bincount(ranks, minlength=self.dp), buckets=[rows])
        m = self.metrics
        for r, d in enumerate(st.dummy):
            if d:
                m.dp_dummy_rows += rows
                m.dp_dummy_calls[r] += 1

    def _dispatch(self, plan, decode):
        """Launch this step's device programs and advance the optimistic host state.

        Inputs are built here, on the calling thread. With ``async_scheduling`` the calls themselves run on
        a one-thread executor: JAX dispatch is asynchronous on CPU, but a ``while_loop`` on GPU returns only
        when the loop ends (its predicate goes to the host every iteration), so the thread is what lets the
        host process the previous step while the device runs this one. The executor keeps calls in order."""
        if not plan and not decode:
            return None
        rec = {"prefill": None, "decode": None}
        pf_inp = dc_inp = None
        if plan:
            bucket, chunks, rows = plan
            rec["prefill_rows"] = rows
            pf_inp = self._prefill_inputs(bucket, chunks, rows)
            if self.dp > 1:
                rb = bucket[0] // self.dp
                self._count_dummy([r // rb for r in rows], rb)
            items = []
            for s, n in chunks:
                last = s.computed + n == len(s.all_ids)
                s.computed += n
                if last:
                    s.status = DECODE
                    s.pending += 1
                    s.pending_lb += 1
                items.append((s, n, last))
            rec["prefill"] = items
            self.metrics.num_prefill_calls += 1
        if decode:
            dc_inp = self._decode_inputs(decode)
            if self.dp > 1:
                self._count_dummy([s.rank for s, _ in decode], self.max_num_seqs // self.dp)
            for s, h in decode:
                s.pending += h * self.K1
                s.pending_lb += h
            rec["decode"] = decode
            self.metrics.num_decode_calls += 1
        runner = self.runner

        def launch():   # dispatch, then bring the (small) results to the host on the same thread
            pf = runner.prefill(pf_inp) if pf_inp is not None else None
            dc = runner.decode(dc_inp) if dc_inp is not None else None
            return jax.device_get(pf), jax.device_get(dc)

        if self.async_scheduling:
            if self._executor is None:
                from concurrent.futures import ThreadPoolExecutor
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="dsflash-dispatch")
            rec["future"] = self._executor.submit(launch)
        else:
            rec["launch"] = launch         # run (and waited for) by _process in the same step
        return rec

    def _process(self, rec, progressed) -> float:
        """Read back one dispatched step and apply it; returns the seconds spent waiting for the device."""
        t0 = time.perf_counter()
        pf, dc = rec["future"].result() if "future" in rec else rec["launch"]()
        wait = time.perf_counter() - t0
        now = time.time()
        if pf is not None:
            self._process_prefill(rec["prefill"], pf, now, progressed, rec["prefill_rows"])
        if dc is not None:
            self._process_decode(rec["decode"], dc, now, progressed)
        if self.eplb is not None:       # one [L, P] load per engine step (valid rows of every forward)
            loads = [r["eplb_load"] for r in (pf, dc) if r is not None]
            if loads:
                self.runner.params = self.eplb.after_step(sum(loads), self.runner.params)
        return wait

    def _prefill_inputs(self, bucket, plan, rows):
        """``rows[i]``: the batch row of chunk ``i`` (DP: rank r's chunks in rows [r*Rb, (r+1)*Rb)); rows
        without a chunk are dummy rows (length 0) pointing at their rank's own first slot and page."""
        inp = self.runner.empty_prefill_inputs(bucket)
        sp = inp["sp"]
        if self.dp > 1:     # (one rank: rank 0's first slot and page are the zeros already there)
            rb = bucket[0] // self.dp
            inp["slots"][:] = np.repeat(np.arange(self.dp, dtype=np.int32) * (self.max_num_seqs // self.dp), rb)
            inp["page_table"][:] = np.repeat(self._pt_fill[::self.max_num_seqs // self.dp], rb)[:, None]
        for r, (s, n) in zip(rows, plan):
            ids = s.all_ids
            inp["tokens"][r, :n] = ids[s.computed:s.computed + n]
            inp["start"][r] = s.computed
            inp["lengths"][r] = n
            inp["slots"][r] = inp["row_slot"][r] = s.slot
            inp["page_table"][r] = self._pt[s.slot]
            inp["floor"][r] = s.floor
            inp["kv_write_from"][r] = s.kv_from
            if "prev" in inp:      # Engram history from the token ids: the slot may never have run the prefix
                h = inp["prev"].shape[1]
                prev = ids[max(0, s.computed - h):s.computed]
                if len(prev):
                    inp["prev"][r, h - len(prev):] = prev
            inp["first"][r] = s.computed == s.prefill_start
            inp["last"][r] = s.computed + n == len(ids)
            inp["out_start"][r] = len(s.prompt_ids)
            inp["n_gen0"][r] = len(s.out_ids)
            for f in sp:
                sp[f][r] = self._sp[f][s.slot]
        return inp

    def _decode_inputs(self, decode):
        inp = self.runner.empty_decode_inputs()
        inp["page_table"] = self._pt.copy()
        inp["floor"] = self._floor.copy()
        inp["sp"] = {f: a.copy() for f, a in self._sp.items()}
        for s, h in decode:
            inp["row_steps"][s.slot] = h
        return inp

    # ------------------------------------------------------------------ results
    def _lp_entry(self, s, tok, lp, top_ids, top_lp):
        top = {int(t): float(v) for t, v in zip(top_ids[:s.params.logprobs], top_lp[:s.params.logprobs])}
        return {"token_id": int(tok), "logprob": float(lp), "top": top}

    def _append(self, s: Sequence, toks, lps, now):
        """Append generated tokens, applying stop conditions; returns True if the sequence finished."""
        p = s.params
        if s.metrics.first_token_time is None and toks:
            s.metrics.first_token_time = now
            self.metrics.ttft.append(now - s.metrics.arrival_time)
        elif toks and s.last_token_time is not None:
            d = (now - s.last_token_time) / len(toks)
            self.metrics.itl.extend([d] * len(toks))
        if toks:
            s.last_token_time = now
        for i, t in enumerate(toks):
            s.out_ids.append(t)
            if s.logprobs is not None and lps is not None:
                s.logprobs.append(self._lp_entry(s, t, *[x[i] for x in lps]))
            self.metrics.generation_tokens += 1
            if t in s.stop_ids:
                eos = t == self.backend.eos_token_id and t not in p.stop_token_ids
                return self._done(s, "stop", None if eos else t)
            if s.detok is not None:
                s.detok.add(t)
                if s.detok.stopped:
                    return self._done(s, "stop", s.detok.stop_reason)
            if len(s.out_ids) >= p.max_tokens:
                return self._done(s, "length", None)
        return False

    def _detok(self, s):
        if s.detok is not None:
            return s.detok.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(s.out_ids, skip_special_tokens=s.params.skip_special_tokens)

    def _done(self, s, reason, stop_reason):
        if s.detok is not None and not s.detok.stopped:
            s.detok.finish()
        s.text = self._detok(s)
        self._finish(s, reason, stop_reason)
        return True

    def _process_prefill(self, items, res, now, progressed, rows):
        for r, (s, n, last) in zip(rows, items):
            self.metrics.computed_prompt_tokens += n
            if s.finished:
                continue
            self._register(s, s.computed)
            if last:
                s.pending -= 1
                s.pending_lb -= 1
                lps = (res["lp"][r:r + 1], res["top_ids"][r:r + 1], res["top_lp"][r:r + 1])
                self._append(s, [int(res["tok"][r])], lps, now)
                progressed.add(s.request_id)

    def _process_decode(self, decode, res, now, progressed):
        m = self.metrics
        m.num_decode_iters += int(res["iters"])
        for s, h in decode:
            s.pending -= h * self.K1
            s.pending_lb -= h
            if s.finished:
                continue
            i = s.slot if s.slot is not None else s.last_slot
            n = int(res["n_out"][i])
            if self.speculative:
                nd = int(res["drafts"][i])
                acc = res["acc_pos"][i]
                m.spec_num_drafts += nd
                m.spec_num_draft_tokens += nd * self.k
                m.spec_num_accepted_tokens += int(acc.sum())
                for j in range(self.k):
                    m.spec_accepted_per_pos[j] += int(acc[j])
                s.metrics.num_drafts += nd
                s.metrics.num_draft_tokens += nd * self.k
                s.metrics.num_accepted_tokens += int(acc.sum())
                if nd:
                    m.acceptance_length.append(n / nd)
            if n == 0:
                continue
            toks = [int(t) for t in res["tok"][i, :n]]
            lps = (res["lp"][i, :n], res["top_ids"][i, :n], res["top_lp"][i, :n])
            self._append(s, toks, lps, now)
            progressed.add(s.request_id)
            if s.status == DECODE:
                if s.pending == 0:
                    assert int(res["pos"][i]) == len(s.all_ids) - 2, (int(res["pos"][i]), len(s.all_ids))
                self._register(s, len(s.all_ids) - 1)

    def _make_output(self, rid) -> RequestOutput:
        seqs = self.groups[rid]
        outs = []
        for s in seqs:
            text = s.text = self._detok(s)
            outs.append(CompletionOutput(index=s.index, text=text, token_ids=list(s.out_ids),
                                         finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                         logprobs=list(s.logprobs) if s.logprobs is not None else None))
        s0 = seqs[0]
        met = s0.metrics
        if len(seqs) > 1:
            met = RequestMetrics(**vars(s0.metrics))
            met.num_generation_tokens = sum(len(s.out_ids) for s in seqs)
            for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                setattr(met, f, sum(getattr(s.metrics, f) for s in seqs))
        else:
            met.num_generation_tokens = len(s0.out_ids)
        return RequestOutput(request_id=rid, prompt=s0.prompt, prompt_token_ids=list(s0.prompt_ids), outputs=outs,
                             finished=all(s.finished for s in seqs), metrics=met)

    # ------------------------------------------------------------------ introspection
    def metrics_snapshot(self) -> dict:
        d = self.metrics.snapshot()
        d["num_requests_running"] = len(self.running)
        d["num_requests_waiting"] = len(self.waiting)
        d["kv_cached_pages"] = self.pool.num_cached
        d["kv_bytes_per_token"] = self.memory["global_kv_bytes_per_token"]
        d["kv_capacity_tokens"] = self.memory["capacity_tokens"]
        d["speculative"] = self.speculative
        d["draft_block"] = self.k
        d["warmup_time_s"] = self.warmup_time
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

    def eplb_rebalance(self):
        """Force an EPLB rebalance now (between steps): the policy runs on the current window and every
        layer's new placement (weights + tables) is installed at once. Returns the ``RebalancePlan``."""
        if self.eplb is None:
            raise ValueError("eplb: the engine was built without eplb=True")
        self.runner.params, plan = self.eplb.rebalance_now(self.runner.params)
        return plan
