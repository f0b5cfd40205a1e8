"""The engine side of P/D: ``PDEngine`` (a subclass of ``LLMEngine``) and ``PDAsyncEngine``.

Prefill side: a request marked ``hold`` (``kv_transfer_params.do_remote_decode``) runs as usual with one
output token; when it finishes, its pages and slot are *kept* (``held``) instead of freed, until the decode
side notifies (``release``) or the TTL runs out. ``extract`` copies the held KV to the host.

Decode side: a request whose KV was pulled gets ``pd_remote[rid] = (meta, arrays)`` before it is added;
its admission (``_admit``) allocates the slot and pages as usual (prefix-cache hits included), writes the
received global KV into the pages that are not hits and the in-window rows into the slot, sets the device
row state (last token, position, penalty counts) and enters the request straight into DECODE with the
prefill side's first token. No prompt token is recomputed.

Both sides are a policy of the engine's scheduler (``PDPolicy``: ``keep`` before a finished sequence's pages
are freed, ``after_admit`` after an ordinary admission), not overrides of its private methods.

Everything that touches the engine runs on the engine thread: other threads queue a callable with
``call`` (executed at the start of the next ``step``). Async scheduling is refused (the state would
be in flight on the dispatch thread).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from dsflash.serve.async_engine import AsyncEngine, as_requests
from dsflash.serve.engine.engine import LLMEngine
from dsflash.serve.engine.kv_cache import block_hashes
from dsflash.serve.engine.sequence import DECODE
from dsflash.serve.pd.transfer import Layout, prompt_digest

log = logging.getLogger("dsflash.serve.pd")


@dataclass
class Held:
    request_id: str
    pages: list
    slot: int
    num_tokens: int
    prompt_ids: list
    first_token: int
    first_logprob: dict | None
    finish_reason: str | None
    floor: int
    deadline: float
    created: float = field(default_factory=time.time)


class PDEngine(LLMEngine):
    def __init__(self, *args, pd_role: str = "prefill", pd_ttl: float = 480.0, **kw):
        super().__init__(*args, **kw)
        if self.async_scheduling:
            raise ValueError("P/D roles need async_scheduling=False (KV is read/written between device calls)")
        self.pd_role = pd_role
        self.pd_ttl = float(pd_ttl)
        self.engine_id = f"{pd_role}-{uuid.uuid4().hex[:12]}"
        self.pd_layout = Layout(self)
        self.pd_hold: set[str] = set()          # prefill: rids to keep after finishing
        self.held: dict[str, Held] = {}         # prefill: kept KV by rid
        self.pd_remote: dict[str, tuple] = {}   # decode: pulled (meta, arrays) by rid, until admitted
        self._tasks: deque = deque()
        self._tlock = threading.Lock()
        st = self.runner.state
        self.pd_sizes = {"global_kv_bytes_per_token": self.pd_layout.global_bytes_per_token(st),
                         "window_bytes": self.pd_layout.window_bytes(st),
                         "entry_bytes": self.pd_layout.entry_bytes(st),
                         "per_slot_bytes": self.memory.get("per_slot_bytes")}
        self.pd_stats = {"held": 0, "released_notify": 0, "released_ttl": 0, "extracts": 0, "installs": 0,
                         "install_fallbacks": 0}
        self.scheduler.policy = PDPolicy(self)

    # ------------------------------------------------------------------ engine-thread calls
    def call(self, fn) -> Future:
        """Run ``fn(self)`` on the engine thread at the start of the next step; returns a Future."""
        fut: Future = Future()
        with self._tlock:
            self._tasks.append((fn, fut))
        return fut

    def _run_tasks(self):
        while True:
            with self._tlock:
                if not self._tasks:
                    return
                fn, fut = self._tasks.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self))
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                fut.set_exception(e)

    def _expire(self):
        if not self.held:
            return
        now = time.time()
        for rid in [r for r, h in self.held.items() if h.deadline <= now]:
            log.warning("P/D: KV of %s not pulled within %.0fs; freeing it", rid, self.pd_ttl)
            self._release(rid)
            self.pd_stats["released_ttl"] += 1

    def has_unfinished_requests(self) -> bool:
        if self._tasks:
            return True
        if self.held and min(h.deadline for h in self.held.values()) <= time.time():
            return True
        return super().has_unfinished_requests()

    def step(self):
        self._run_tasks()
        self._expire()
        if super().has_unfinished_requests():
            return super().step()
        return []

    def abort_request(self, request_id: str) -> None:
        self.pd_remote.pop(request_id, None)
        self.pd_hold.discard(request_id)
        super().abort_request(request_id)

    # ------------------------------------------------------------------ prefill side
    def _release(self, rid) -> bool:
        h = self.held.pop(rid, None)
        if h is None:
            return False
        self.pool.free(h.pages)
        self.slots.free(h.slot)
        self.runner.mirror.reset_pages(h.slot)
        return True

    def release(self, rid) -> bool:
        ok = self._release(rid)
        if ok:
            self.pd_stats["released_notify"] += 1
        return ok

    def extract(self, rid, skip_tokens=0, on_device=False):
        """``(meta, arrays)`` of held KV: host copies (HTTP body), or with ``on_device`` the device arrays the
        transfer server offers."""
        h = self.held.get(rid)
        if h is None:
            raise KeyError(rid)
        skip = max(0, min(int(skip_tokens), h.num_tokens - 1))   # in tokens: the sides' page sizes may differ
        cut = self.pd_layout.extract_device if on_device else self.pd_layout.extract
        arrays = cut(self.runner.state, h.pages, h.slot, h.num_tokens, skip)
        self.pd_stats["extracts"] += 1
        meta = {"engine_id": self.engine_id, "request_id": rid, "num_tokens": h.num_tokens,
                "prompt_digest": prompt_digest(h.prompt_ids), "first_token": h.first_token, "first_logprob": h.first_logprob,
                "floor": h.floor, "skip_tokens": skip, "page_size": self.page_size}
        return meta, arrays

    # ------------------------------------------------------------------ decode side
    def peek_prefix_pages(self, ids, params) -> int:
        """Pages of ``ids`` this instance's prefix cache holds now (a hint; admission re-checks)."""
        if not self.prefix_caching or params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 \
                or params.frequency_penalty != 0.0:
            return 0
        P = self.page_size
        n = 0
        for h in block_hashes(ids, P, max_blocks=(len(ids) - 1) // P):
            if h not in self.pool.hash_to_page:
                break
            n += 1
        return n


class PDPolicy:
    """The scheduler hooks of a P/D engine (``Scheduler.policy``)."""

    def __init__(self, engine: "PDEngine"):
        self.e = engine

    def keep(self, s) -> bool:
        """Prefill side: a finished ``hold`` request keeps its pages and slot (``held``) for the decode side."""
        e, rid = self.e, s.request_id
        if (rid in e.pd_hold and s.finish_reason not in (None, "abort") and s.pages and s.slot is not None
                and s.out_ids):
            e.pd_hold.discard(rid)
            lp = s.logprobs[0] if s.logprobs else None
            e.held[rid] = Held(rid, list(s.pages), s.slot, len(s.prompt_ids), list(s.prompt_ids),
                               int(s.out_ids[0]), lp, s.finish_reason, int(s.floor), time.time() + e.pd_ttl)
            e.pd_stats["held"] += 1
            s.last_slot, s.slot, s.pages, s.hashes = s.slot, None, [], []
            return True
        return False

    def after_admit(self, s) -> None:
        """Decode side: a request whose KV was pulled gets it written into the pages / slot just admitted and
        enters DECODE with the prefill side's first token (on a bad payload it stays an ordinary prefill)."""
        e = self.e
        payload = e.pd_remote.get(s.request_id) if s.index == 0 else None
        if payload is None:
            return
        meta, arrays = e.pd_remote.pop(s.request_id)
        n = len(s.prompt_ids)
        hit_pages = len(s.hashes)
        try:
            if meta["prompt_digest"] != prompt_digest(s.prompt_ids):
                raise ValueError("prompt token ids differ from the prefill side's")
            e.pd_layout.install(e, arrays, s.pages, s.slot, n, hit_pages)
        except Exception as err:  # noqa: BLE001 - a local race (evicted hit) or bad payload: prefill here
            log.warning("P/D: cannot install pulled KV for %s (%s); prefilling locally", s.request_id, err)
            e.pd_stats["install_fallbacks"] += 1
            return           # the ordinary admission left it as a prefill
        # the sequence is now exactly where the prefill side left it: prompt computed, first token sampled
        e.metrics.replay_tokens -= max(0, s.kv_from - s.computed)
        s.computed = n
        s.floor = s.kv_from = int(meta.get("floor", 0))
        e.runner.mirror.floor[s.slot] = s.floor
        s.prefill_start = 0
        s.status = DECODE
        e.scheduler.register(s, n)
        tok = int(meta["first_token"])
        V = e.backend.vocab_size
        counts = np.zeros((V,), np.int32)
        counts[tok] += 1
        seen = np.zeros((V,), bool)
        seen[np.asarray(s.prompt_ids, np.int64)] = True
        seen[tok] = True
        done = tok in s.stop_ids or s.params.max_tokens <= 1
        row = {"y": np.int32(tok), "pos": np.int32(n - 1), "n_gen": np.int32(1), "active": np.bool_(not done),
               "counts": counts, "seen": seen}
        if "ctx_pos" in e.runner.rows:       # the transferred draft context is current through the prompt
            row["ctx_pos"] = np.int32(n - 1)
        e.pd_layout.set_row(e, s.slot, row)
        e.pd_stats["installs"] += 1
        lp = meta.get("first_logprob")
        finished = e.outputs.append(s, [tok], None, time.time())
        if s.logprobs is not None and lp is not None:
            s.logprobs.insert(0, {"token_id": int(lp["token_id"]), "logprob": float(lp["logprob"]),
                                  "top": {int(k): float(v) for k, v in (lp.get("top") or {}).items()}})
        if finished:
            e.outputs.emit_now(s.request_id)


class PDAsyncEngine(AsyncEngine):
    """``AsyncEngine`` that can run a callable on the engine thread (``await run_on_engine(fn)``)."""

    async def run_on_engine(self, fn, timeout: float | None = 60.0):
        import asyncio
        if self.engine is None or not self.is_running:
            raise RuntimeError("engine is not running")
        fut = self.engine.call(fn)
        with self._cv:
            self._cv.notify_all()
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    async def add_requests(self, items, arrival_time=None):
        """As ``AsyncEngine.add_requests``; for a P/D request (its envelope's ``kv_transfer_params`` carry the
        middleware's ticket, ``PDState.request_of``) the prefill side marks the request to keep its KV, the decode
        side first pulls the KV (failure policy per request) and hands it to the engine with the request."""
        import asyncio

        from dsflash.serve.http.errors import APIError
        from dsflash.serve.pd.transfer import TransferSize
        items = as_requests(items, arrival_time)
        pd = getattr(self, "pd", None)
        req = pd.request_of(items[0].kv_transfer_params) if pd is not None and items else None
        if req is None or self.engine is None:
            return await super().add_requests(items, arrival_time)
        rids = [r.request_id for r in items]
        req.rids = rids
        if req.wants_hold:
            for rid in rids:
                self.engine.pd_hold.add(rid)
            req.outcome = "held"
            try:
                return await super().add_requests(items, arrival_time)
            except BaseException:
                for rid in rids:
                    self.engine.pd_hold.discard(rid)
                raise
        if len(items) != 1:
            raise APIError(400, "kv_transfer_params: a request with remote prefill must have n=1 and one prompt",
                           param="kv_transfer_params")
        rid, prompt, params = items[0].request_id, items[0].prompt, items[0].params
        kv = req.params
        where = kv.get("remote_url") or f"http://{kv.get('remote_host')}:{kv.get('remote_port')}"
        try:
            url, rrid, meta, arrays, nbytes, dt = await pd.pull(req, list(prompt), params)
            if meta["prompt_digest"] != prompt_digest(prompt):
                raise RuntimeError("the prefill side's prompt token ids differ from this request's")
        except Exception as e:  # noqa: BLE001 - handled by the request's policy
            pd.counters["pulls_failed"] += 1
            msg = (f"KV transfer from prefill engine {kv.get('remote_engine_id')} at {where} for request "
                   f"{kv.get('remote_request_id')} failed: {type(e).__name__}: {e}")
            req.error = msg
            if req.policy == "fail":
                pd.counters["failed_requests"] += 1
                req.outcome = "failed"
                log.error("P/D: %s (policy fail: request %s errors)", msg, rid)
                raise APIError(502, msg + " [kv_load_failure_policy=fail]", code="kv_transfer_failed",
                               type="kv_transfer_error") from None
            req.outcome = "recomputed"
            pd.counters["recomputed"] += 1
            log.warning("P/D: %s (policy recompute: prefilling %s locally)", msg, rid)
            return await super().add_requests(items, arrival_time)
        size = TransferSize.of(meta, arrays, nbytes)
        req.size, req.outcome, req.pull_s = size, "transferred", dt
        pd.counters["pulls_ok"] += 1
        pd.counters["bytes_received"] += nbytes
        pd.record({"request_id": rid, "remote_request_id": rrid, "remote_engine_id": meta.get("engine_id"),
                   "prompt_tokens": size.prompt_tokens, "global_bytes": size.global_bytes,
                   "window_bytes": size.window_bytes, "wire_bytes": size.wire_bytes,
                   "skipped_tokens": size.skipped_tokens, "pull_s": dt, "transport": pd.transport})
        self.engine.pd_remote[rid] = (meta, arrays)
        asyncio.ensure_future(pd.notify(url, rrid))
        try:
            return await super().add_requests(items, arrival_time)
        except BaseException:
            self.engine.pd_remote.pop(rid, None)
            raise
