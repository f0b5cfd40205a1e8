"""Multi-controller serving: one engine per process over one global mesh (``jax.distributed``).

Process 0 (the *leader*) owns the scheduler, the output processor and (in the server) HTTP. Every device call it
makes is first *broadcast* to the other processes (the *followers*), which run the same compiled program on the
same inputs, so all processes enter every collective of the global mesh in the same order.

What crosses is the runner's host inputs of one step (``Runner.step_inputs``: token ids, positions, page tables,
slots, sampling rows, stop ids, row horizons, guided masks) plus the decode program's draft length: everything a
compiled call reads that is not already device state. Per step:

1. a fixed ``HEADER`` of ``int32`` words -- command (step / stop), sequence number, the prefill bucket's index
   (-1: no prefill), whether a decode call follows, its draft length, whether each call carries a guided mask --
   through the ``jax.distributed`` coordination service's key-value store (key ``dsflash/plan/<seq>``). A
   follower blocks on the next key for as long as the leader idles, off the devices (no collective held open
   on them for hours); the leader deletes key ``seq - 1`` when it writes ``seq`` (every follower read it before
   it joined step ``seq - 1``'s broadcast, which completed);
2. the payload through JAX's own collective, ``multihost_utils.broadcast_one_to_all`` over the global devices:
   the raw bytes of every input array, in the pytree order of the runner's own empty inputs
   (``empty_prefill_inputs(bucket)`` / ``empty_decode_inputs()``), as ``int32`` words. The header fixes its
   length, so a follower builds the same template, receives exactly that many words and reads the arrays back
   out of them (no pickling, no shapes on the wire). A call without guided rows leaves its mask out (the
   follower uses the runner's shared zero mask).

Each payload length (padded to a power of two: ``padded_words``) compiles one tiny broadcast program;
``PlanLink.warmup`` compiles every length the buckets allow (with and without masks) at start-up, on all processes in the same order, so serving compiles
nothing. The broadcast is issued on the thread that then launches the step (the runner's dispatch thread with
async scheduling), so it is ordered with the step's own collectives. ``barrier`` (the coordination service's)
lines the processes up before the first run of each compiled program (their compile times differ; a gloo
context waits only 30 s for its peers).

Shutdown: the leader's ``close()`` writes a stop header; a follower's ``follow()`` returns on it. A follower
that dies makes the leader's next collective fail (or stall): ``lead`` turns a failure into
``FollowerLostError``, and ``Watchdog`` a stall past ``step_timeout`` seconds (docs/multihost.md).
"""
from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np

log = logging.getLogger("dsflash.serve.multihost")

HEADER = 8
STEP, STOP = 1, 2


class FollowerLostError(RuntimeError):
    """A process of the multi-controller job stopped answering: the global mesh cannot run any more steps."""


def is_multi_controller() -> bool:
    """True when this process is one of several of a ``jax.distributed`` job."""
    return jax.process_count() > 1


def _leaves(tree):
    return jax.tree_util.tree_flatten(tree)


def _encode(tree, guided: bool) -> np.ndarray:
    leaves, _ = _leaves(_without_mask(tree, guided))
    raw = b"".join(np.ascontiguousarray(np.asarray(a)).tobytes() for a in leaves)
    raw += b"\0" * (-len(raw) % 4)
    return np.frombuffer(raw, np.int32)


def _nwords(tree, guided: bool) -> int:
    leaves, _ = _leaves(_without_mask(tree, guided))
    n = sum(np.asarray(a).nbytes for a in leaves)
    return (n + 3) // 4


def _without_mask(tree, guided: bool):
    return tree if guided else {k: v for k, v in tree.items() if k != "mask"}


def _decode(words: np.ndarray, template, guided: bool):
    """The arrays of ``template``'s structure, read back from ``words`` (``_encode``'s output)."""
    part = _without_mask(template, guided)
    leaves, treedef = _leaves(part)
    raw = np.ascontiguousarray(words, np.int32).tobytes()
    out, off = [], 0
    for a in leaves:
        a = np.asarray(a)
        v = np.frombuffer(raw, a.dtype, count=a.size, offset=off).reshape(a.shape).copy()
        off += a.nbytes
        out.append(v)
    tree = jax.tree_util.tree_unflatten(treedef, out)
    if not guided:
        tree["mask"] = template["mask"]
    return tree


def _client():
    """The ``jax.distributed`` coordination-service client of this process."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multihost: jax.distributed is not initialised in this process")
    return client


KEY = "dsflash/plan/{}"


def padded_words(n: int) -> int:
    """The broadcast length of an ``n``-word payload: the next power of two (at least 1024 words), so a handful of
    compiled broadcasts cover every bucket / decode / mask combination (at most 2x the bytes)."""
    return max(1024, 1 << (int(n) - 1).bit_length())


def _padded(words: np.ndarray) -> np.ndarray:
    out = np.zeros((padded_words(words.size),), np.int32)
    out[:words.size] = words
    return out


class PlanLink:
    """The leader's and the followers' end of the per-step broadcast (one per process, bound to its Runner).
    ``poll_s``: how long a follower's key-value wait lasts before it waits again (an idle leader is no error);
    ``barrier_timeout_s``: how long ``barrier`` waits for the slowest process."""

    def __init__(self, runner, poll_s: float = 10.0, barrier_timeout_s: float = 1800.0):
        self.runner = runner
        self.leader = jax.process_index() == 0
        self.client = _client()
        self.poll_ms = int(poll_s * 1000)
        self.barrier_ms = int(barrier_timeout_s * 1000)
        self._barriers = 0
        self.seq = 0
        self.broadcasts = 0          # payload collectives issued (one per step)
        self.watchdog = None         # the leader's Watchdog (set by the server / LLM), None: none

    # ------------------------------------------------------------------ the collective
    def _bcast(self, words: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils
        self.broadcasts += 1
        return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(words, np.int32), is_source=self.leader))

    def barrier(self, name: str = "sync") -> None:
        """Every process of the job waits here for the others (the coordination service's barrier, no device)."""
        self._barriers += 1
        self.client.wait_at_barrier(f"dsflash/{name}/{self._barriers}", self.barrier_ms)

    def _put_header(self, header) -> None:
        self.client.key_value_set_bytes(KEY.format(int(header[1])), np.asarray(header, np.int32).tobytes())
        if header[1] > 1:
            self.client.key_value_delete(KEY.format(int(header[1]) - 1))

    def _get_header(self, seq: int) -> np.ndarray:
        while True:
            try:
                raw = self.client.blocking_key_value_get_bytes(KEY.format(seq), self.poll_ms)
            except Exception as e:  # noqa: BLE001 - the leader idles (deadline) or is gone (anything else)
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue
                raise
            return np.frombuffer(raw, np.int32).copy()

    def _bucket_index(self, pf_inp) -> int:
        if pf_inp is None:
            return -1
        return self.runner.prefill_buckets.index(tuple(pf_inp["tokens"].shape))

    def _templates(self, header):
        _, _, b, has_dc, _, pg, dg, _ = (int(x) for x in header)
        run = self.runner
        pf = run.empty_prefill_inputs(run.prefill_buckets[b]) if b >= 0 else None
        dc = run.empty_decode_inputs() if has_dc else None
        return pf, dc, bool(pg), bool(dg)

    def _payload_words(self, header) -> int:
        pf, dc, pg, dg = self._templates(header)
        return (_nwords(pf, pg) if pf is not None else 0) + (_nwords(dc, dg) if dc is not None else 0)

    # ------------------------------------------------------------------ leader
    def send(self, pf_inp, dc_inp, draft_len) -> None:
        """Broadcast one step's inputs (leader only; called right before the step's device calls)."""
        self.seq += 1
        pg = bool(pf_inp is not None and pf_inp["guided"].any())
        dg = bool(dc_inp is not None and dc_inp["guided"].any())
        d = self.runner.k if draft_len is None else int(draft_len)
        header = np.array([STEP, self.seq, self._bucket_index(pf_inp), dc_inp is not None, d, pg, dg, 0], np.int32)
        parts = ([_encode(pf_inp, pg)] if pf_inp is not None else []) + \
                ([_encode(dc_inp, dg)] if dc_inp is not None else [])
        payload = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
        want = self._payload_words(header)
        if payload.size != want:      # the leader's inputs must have the layout the followers rebuild
            raise RuntimeError(f"multihost: step inputs encode to {payload.size} words, the template to {want}")
        self._put_header(header)
        if payload.size:
            self._bcast(_padded(payload))

    def lead(self, step, pf_inp, dc_inp, draft_len):
        """The leader's step: broadcast its inputs, then ``step()`` (the device calls). Any failure is the job's
        end: it becomes ``FollowerLostError`` (a process gone makes the collectives fail); ``watchdog`` (a
        ``Watchdog``, if set) times the whole of it."""
        w = self.watchdog
        if w is not None:
            w.step_started()
        try:
            self.send(pf_inp, dc_inp, draft_len)
            return step()
        except Exception as e:  # noqa: BLE001 - every device failure ends a multi-controller job
            raise FollowerLostError(f"multi-controller step {self.seq} failed: {type(e).__name__}: {e} "
                                    "(a process of the job is gone or failed; the job cannot continue)") from e
        finally:
            if w is not None:
                w.step_finished()

    def stop(self) -> None:
        """Tell the followers to leave ``follow()`` (leader only)."""
        self.seq += 1
        self._put_header(np.array([STOP, self.seq, -1, 0, 0, 0, 0, 0], np.int32))

    # ------------------------------------------------------------------ follower
    def receive(self):
        """The next step's ``(pf_inp, dc_inp, draft_len)``, or None when the leader stopped (followers only)."""
        header = self._get_header(self.seq + 1)
        if int(header[0]) == STOP:
            return None
        if int(header[0]) != STEP:
            raise RuntimeError(f"multihost: unknown command {int(header[0])} in the plan header")
        self.seq = int(header[1])
        pf_t, dc_t, pg, dg = self._templates(header)
        n = self._payload_words(header)
        words = self._bcast(np.zeros((padded_words(n),), np.int32)) if n else np.zeros((0,), np.int32)
        npf = _nwords(pf_t, pg) if pf_t is not None else 0
        pf = _decode(words[:npf], pf_t, pg) if pf_t is not None else None
        dc = _decode(words[npf:], dc_t, dg) if dc_t is not None else None
        return pf, dc, int(header[4])

    # ------------------------------------------------------------------ start-up
    def warmup(self) -> int:
        """Compile the broadcast of every (padded) payload length the buckets allow, on all processes in the same
        order, so serving compiles nothing; returns how many."""
        run = self.runner
        sizes = set()
        for b in [-1] + list(range(len(run.prefill_buckets))):
            for has_dc in (0, 1):
                for pg in ((0, 1) if b >= 0 else (0,)):
                    for dg in ((0, 1) if has_dc else (0,)):
                        sizes.add(self._payload_words([STEP, 0, b, has_dc, 0, pg, dg, 0]))
        self.barrier("broadcast-warmup")
        for n in sorted({padded_words(n) for n in sizes - {0}}):
            self._bcast(np.zeros((n,), np.int32))
        return len({padded_words(n) for n in sizes - {0}})


def follow(engine) -> int:
    """A follower's serving loop: run every step the leader broadcasts until it stops. Returns the steps run."""
    run, link = engine.runner, engine.runner.link
    if link is None or link.leader:
        raise RuntimeError("follow(): only a follower process (jax.process_index() > 0) follows the leader")
    steps = 0
    while True:
        msg = link.receive()
        if msg is None:
            log.info("follower %d: the leader stopped after %d steps", jax.process_index(), steps)
            return steps
        pf_inp, dc_inp, draft_len = msg
        pf, dc = run.run_step(pf_inp, dc_inp, draft_len=draft_len)
        run.after_step(pf, dc)
        steps += 1


class Watchdog:
    """The leader's guard against a lost follower: a step (broadcast + device calls) that has not returned
    ``step_timeout`` seconds after it started means a process stopped answering (a collective waits for it
    forever, or until the distributed runtime's heartbeat timeout kills this process without a word).
    ``on_lost(error)`` is called once, from the watchdog thread; it must fail the requests and end the process
    (the engine thread may be stuck inside the collective)."""

    def __init__(self, step_timeout: float, on_lost, poll_s: float = 0.2):
        self.step_timeout = float(step_timeout)
        self.on_lost = on_lost
        self._started = None            # monotonic time the running step began (None: between steps)
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="dsflash-watchdog", daemon=True)
        self._thread.start()

    def step_started(self):
        self._started = time.monotonic()

    def step_finished(self):
        self._started = None

    def close(self):
        self._stop.set()

    def _watch(self, poll_s):
        while not self._stop.wait(poll_s):
            t = self._started
            if t is not None and time.monotonic() - t > self.step_timeout and not self._fired:
                self._fired = True
                self.on_lost(FollowerLostError(
                    f"a step of the multi-controller job did not finish within {self.step_timeout:g}s "
                    f"(--step-timeout): a follower process is gone or stuck"))
