"""AsyncEngine: the synchronous :class:`LLMEngine` driven by one background thread, fed from asyncio.

The engine is not thread-safe, so exactly one thread (``dsflash-engine``) ever touches it: it builds
the engine, adds and aborts requests, calls ``step()`` and reads ``metrics_snapshot()``. Everything
else talks to that thread through a condition-protected inbox:

* ``await add_request(...)`` puts the request in the inbox and waits until the engine thread has
  called ``engine.add_request`` (so a ``ValueError`` naming a bad field surfaces to the caller
  *before* an HTTP response starts), then returns a :class:`RequestStream`;
* ``abort(request_id)`` (thread-safe, never blocks) queues an abort; the engine thread calls
  ``engine.abort_request`` on its next turn, which frees the request's pages;
* after every ``step()`` the engine thread hands the outputs to the event loop with one
  ``call_soon_threadsafe`` per step, which puts each into its request's ``asyncio.Queue``. Engine
  outputs are cumulative, so a slow consumer only ever reads the newest one (no backlog).

Requests submitted concurrently are all in the engine at once and batched by its scheduler; nothing
here serialises them. ``begin_drain()`` stops accepting new requests (they get
:class:`EngineDrainingError`) while in-flight ones finish; ``shutdown()`` aborts what is left and
joins the thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dsflash.serve.types import EngineRequest, RequestOutput, SamplingParams

log = logging.getLogger("dsflash.serve.async_engine")


class EngineDeadError(RuntimeError):
    """The engine thread failed (startup or ``step()`` raised); no request can be served."""


class EngineDrainingError(RuntimeError):
    """The server is draining (SIGTERM): in-flight requests finish, new ones are refused."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished (server shutdown)."""


def as_requests(items, arrival_time: Optional[float] = None) -> list[EngineRequest]:
    """``EngineRequest``s, or ``(request_id, prompt, params)`` tuples, -> envelopes with an arrival time."""
    now = time.time() if arrival_time is None else arrival_time
    out = []
    for it in items:
        req = it if isinstance(it, EngineRequest) else EngineRequest(*it)
        out.append(dataclasses.replace(req, arrival_time=req.arrival_time if req.arrival_time is not None else now))
    return out


@dataclass
class _Submit:
    req: EngineRequest
    stream: "RequestStream"
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    @property
    def request_id(self) -> str:
        return self.req.request_id


class RequestStream:
    """Outputs of one engine request, newest-wins. Iterate with ``async for``; the iteration ends
    after the finished output. ``abort()`` (or leaving the iteration early, or cancellation)
    frees the engine request."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self._owner = owner
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.last: Optional[RequestOutput] = None
        self.arrival: float = time.time()

    # called on the event loop by the engine thread's dispatch
    def _put(self, item) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        """The newest output (waits for one). Raises on engine failure or abort."""
        item = await self._queue.get()
        # cumulative outputs: keep only the newest (an exception is always the last item)
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        try:
            while not self.finished:
                yield await self.get()
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine_factory()`` and the step loop in one daemon thread.

    ``engine_factory`` is called inside the engine thread (JAX compilation and device placement
    happen there too). Call :meth:`start` (blocking until the engine is built) before serving.
    """

    def __init__(self, engine_factory: Callable[[], Any], *, idle_wait_s: float = 0.25,
                 snapshot_interval_s: float = 0.5):
        self._factory = engine_factory
        self._idle_wait_s = idle_wait_s
        self._snapshot_interval_s = snapshot_interval_s
        self._cv = threading.Condition()
        self._inbox_add: list[_Submit] = []
        self._inbox_abort: list[str] = []
        self._stop = False
        self._fail_with: Optional[BaseException] = None     # fail_in_flight(): abort and fail what is live
        self._draining = False
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self.engine: Any = None
        self.error: Optional[BaseException] = None
        # engine-thread state; other threads read only len(self._live) (the in-flight count, atomic) and snapshots.
        # A request enters _live before its caller hears it was added and leaves before its final output is handed
        # over, so a caller never sees a count that contradicts what it was told.
        self._live: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        self._snapshot: dict = {}
        self._snapshot_time = 0.0
        self.num_steps = 0
        self.step_time_s = 0.0
        # attributes of the engine the HTTP layer needs (read once after construction)
        self.tokenizer = None
        self.model_name = ""
        self.max_model_len = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: Optional[float] = None) -> None:
        """Start the engine thread and wait until the engine is built; re-raise a build error."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dsflash-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("engine did not start in time")
        if self.error is not None:
            raise self.error

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        """Requests the engine currently holds (added, not finished, not yet aborted)."""
        return len(self._live)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; in-flight requests keep running. Thread/signal-safe."""
        self._draining = True
        with self._cv:
            self._cv.notify_all()

    def fail_in_flight(self, exc: BaseException) -> int:
        """Abort every request in flight and end its stream with ``exc`` (the drain deadline), on the engine
        thread's next turn; new requests are refused. Thread/signal-safe; returns how many were in flight."""
        self._draining = True
        with self._cv:
            self._fail_with = exc
            self._cv.notify_all()
        return len(self._live)

    def fail_now(self, exc: BaseException) -> int:
        """Fail every in-flight request with ``exc`` at once, from any thread, without the engine thread (which
        may be stuck in a collective of a broken multi-controller job); new requests are refused. Returns how
        many were in flight."""
        n = len(self._live)
        self.error = self.error or exc
        self._fail_all(exc)
        with self._cv:
            adds, self._inbox_add = self._inbox_add, []
        for s in adds:
            s.loop.call_soon_threadsafe(_set_exc, s.future, EngineDeadError(f"engine failed: {exc}"))
        return n

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything still in flight and stop the engine thread."""
        self._draining = True
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    async def wait_idle(self, timeout: Optional[float] = None, poll_s: float = 0.05) -> bool:
        """Wait until no request is in flight; True if that happened within ``timeout``."""
        t_end = None if timeout is None else time.monotonic() + timeout
        while self._live or self._inbox_add:
            if t_end is not None and time.monotonic() > t_end:
                return False
            await asyncio.sleep(poll_s)
        return True

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: Optional[float] = None) -> RequestStream:
        """Submit one request; returns once the engine accepted it. Raises ``ValueError`` for bad
        input (from ``engine.add_request``), :class:`EngineDrainingError`, :class:`EngineDeadError`."""
        return (await self.add_requests([(request_id, prompt, params)], arrival_time))[0]

    async def add_requests(self, items, arrival_time: Optional[float] = None) -> list[RequestStream]:
        """Submit several requests at once (``EngineRequest`` envelopes, or ``(request_id, prompt, params)``);
        they reach the engine between the same two steps. All or nothing: if one is refused, the accepted
        ones are aborted and the first error is raised."""
        if self.error is not None or not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        if self._draining:
            raise EngineDrainingError("server is shutting down; not accepting new requests")
        loop = asyncio.get_running_loop()
        subs = [_Submit(r, RequestStream(self, r.request_id), loop, loop.create_future())
                for r in as_requests(items, arrival_time)]
        for s in subs:
            s.stream.arrival = s.req.arrival_time
        with self._cv:
            self._inbox_add.extend(subs)
            self._cv.notify_all()
        try:
            results = await asyncio.gather(*(s.future for s in subs), return_exceptions=True)
        except asyncio.CancelledError:
            # the caller went away while we waited: make sure nothing lingers
            for s in subs:
                self.abort(s.request_id)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for s, r in zip(subs, results):
                if not isinstance(r, BaseException):
                    s.stream.abort()
            raise errors[0]
        return [s.stream for s in subs]

    def abort(self, request_id: str) -> None:
        """Free ``request_id`` in the engine (no-op if it already finished). Never blocks."""
        with self._cv:
            self._inbox_abort.append(request_id)
            self._cv.notify_all()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """The newest ``engine.metrics_snapshot()`` (refreshed by the engine thread at most every
        ``snapshot_interval_s`` while it steps; at once when idle and after new requests' first step) plus this
        wrapper's own counters."""
        snap = dict(self._snapshot)
        snap.setdefault("num_requests_in_flight", len(self._live))
        snap["async_engine_in_flight"] = len(self._live)
        snap["async_engine_pending_adds"] = len(self._inbox_add)
        snap["async_engine_steps"] = self.num_steps
        snap["async_engine_step_time_s"] = self.step_time_s
        return snap

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            eng = self._factory()
            self.engine = eng
            if hasattr(eng, "first_token_hook"):     # first tokens leave before the rest of their step's work
                eng.first_token_hook = self._dispatch
            self.tokenizer = getattr(eng, "tokenizer", None)
            self.model_name = str(getattr(eng, "model_name", "") or "")
            self.max_model_len = int(getattr(eng, "max_model_len", 0) or 0)
            self._refresh_snapshot(force=True)
        except BaseException as e:  # noqa: BLE001 - reported to the starter
            log.exception("engine construction failed")
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop_forever(eng)
            close = getattr(eng, "close", None)      # a multi-controller leader releases its followers
            if close is not None:
                close()
        except BaseException as e:  # noqa: BLE001
            log.exception("engine loop failed; failing all in-flight requests")
            self.error = e
            self._fail_all(EngineDeadError(f"engine failed: {type(e).__name__}: {e}"))
            # refuse what arrives later too
            with self._cv:
                adds, self._inbox_add = self._inbox_add, []
            for s in adds:
                s.loop.call_soon_threadsafe(_set_exc, s.future, EngineDeadError(f"engine failed: {e!r}"))

    def _loop_forever(self, eng) -> None:
        has_work = False
        while True:
            with self._cv:
                if not (self._inbox_add or self._inbox_abort or has_work or self._stop or self._fail_with):
                    self._cv.wait(self._idle_wait_s)
                adds, self._inbox_add = self._inbox_add, []
                aborts, self._inbox_abort = self._inbox_abort, []
                stop = self._stop
                fail, self._fail_with = self._fail_with, None
            if fail is not None:
                for rid in list(self._live):
                    try:
                        eng.abort_request(rid)
                    except Exception:  # noqa: BLE001
                        log.exception("abort of %s at the drain deadline failed", rid)
                self._fail_all(fail)
            for rid in aborts:
                if rid in self._live:
                    try:
                        eng.abort_request(rid)
                    finally:
                        self._live.pop(rid, None)
            for s in adds:
                if stop:
                    s.loop.call_soon_threadsafe(_set_exc, s.future, EngineDrainingError("server is shutting down"))
                    continue
                if s.request_id in self._live:
                    s.loop.call_soon_threadsafe(_set_exc, s.future,
                                                ValueError(f"request_id: {s.request_id!r} is already running"))
                    continue
                try:
                    if hasattr(eng, "add"):          # the envelope as it is (dp rank, transfer params)
                        eng.add(s.req)
                    else:                            # a minimal engine (the HTTP layer's DummyEngine)
                        eng.add_request(s.request_id, s.req.prompt, s.req.params, arrival_time=s.req.arrival_time)
                except Exception as e:  # noqa: BLE001 - a bad request, reported to its caller
                    s.loop.call_soon_threadsafe(_set_exc, s.future, e)
                    continue
                self._live[s.request_id] = (s.stream, s.loop)
                s.loop.call_soon_threadsafe(_set_result, s.future)
            if stop:
                for rid in list(self._live):
                    try:
                        eng.abort_request(rid)
                    except Exception:  # noqa: BLE001
                        log.exception("abort of %s during shutdown failed", rid)
                self._fail_all(RequestAbortedError("server shut down before the request finished"))
                self._refresh_snapshot(force=True)
                return
            has_work = bool(eng.has_unfinished_requests())
            outs = []
            if has_work:
                t0 = time.perf_counter()
                outs = eng.step()
                self.step_time_s += time.perf_counter() - t0
                self.num_steps += 1
                has_work = bool(eng.has_unfinished_requests())
            # forced when idle, and after the first step of newly added requests: the step after it may be long (a
            # compile, a large prefill), and /metrics would show the state from before they were admitted meanwhile.
            # Before the outputs go out: a client that has seen this step's tokens then reads this step's metrics.
            self._refresh_snapshot(force=bool(adds) or not (has_work or aborts))
            if outs:
                self._dispatch(outs)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            ent = self._live.get(out.request_id)
            if ent is None:            # aborted meanwhile, or not ours
                continue
            stream, loop = ent
            if out.finished:
                self._live.pop(out.request_id, None)
            by_loop.setdefault(loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:       # loop closed: the server is gone
                pass

    def _fail_all(self, exc: BaseException) -> None:
        live, self._live = self._live, {}
        by_loop: dict = {}
        for stream, loop in live.values():
            by_loop.setdefault(loop, []).append((stream, exc))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass

    def _refresh_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._snapshot_time < self._snapshot_interval_s:
            return
        fn = getattr(self.engine, "metrics_snapshot", None)
        if fn is None:
            return
        try:
            snap = fn()
            self._snapshot = dict(snap) if snap else {}
        except Exception:  # noqa: BLE001 - metrics must never take serving down
            log.exception("metrics_snapshot failed")
        self._snapshot_time = now


def _deliver(items) -> None:
    for stream, out in items:
        stream._put(out)


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exc(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
