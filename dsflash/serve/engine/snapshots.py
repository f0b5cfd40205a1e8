"""Exact prefix caching: snapshots of a sequence's per-slot state at cached block boundaries.

The paged global KV of a prefix is shared through the prefix cache (``kv_cache.py``), but the per-slot state
(window rings of every block and of the DSpark stages, the ratio-2 compressor rings, the Engram history ring)
is not in pages. Without it a hit must rebuild it by the approximate one-window replay (SPEC §6.1). Here we
keep, per cached block boundary ``C`` (the chain hash of the blocks below ``C``), the ring rows a call that
starts at ``C`` can read: positions ``[C - min(X, W), C)`` of every per-slot ring of length ``X`` (``W`` the
sliding window). Restoring them into a fresh slot and starting the prefill at ``C`` runs exactly the
computation a miss runs from ``C`` (same inputs, same global KV), so hits give the miss's tokens.

Two parts:

* :class:`SnapshotCache` (host): hash -> pool entry, LRU over unpinned entries, pins for restores not yet
  launched, counters. The scheduler owns it.
* :class:`StatePool` (device): the snapshot arrays ``[entries, rows, ...]`` per per-slot state leaf and two
  jitted programs, ``save`` (slots -> entries) and ``restore`` (entries -> slots), padded to a fixed number
  of rows so they compile once. The runner owns it and runs them around the prefill of a step, in order.

The per-slot leaves are every state leaf that is not paged global KV (``backend.global_kv_arrays``); each is
``[slots, X, ...]`` with position ``q`` at ring row ``q % X`` (the model's state layout, ``model/state.py``).

**Tail.** A snapshot at ``C`` need not be taken by a call that ends at ``C``. The engine makes every ring ``tail``
rows longer than it needs (``ring_slack``), and a snapshot keeps the rows the ring needed before
(``rows_kept(X - tail, W)``). So a call that ends at most ``tail`` positions past ``C`` has not yet overwritten
them. Values at positions below ``C`` do not depend on later tokens (causal), so the saved rows equal those of a
call that stopped at ``C``. The engine sets ``tail`` to the block size. A prompt's last chunk then runs to the
prompt's end, and it is snapshotted at its last full block boundary (where a repeat of the prompt hits). Before,
the chunk was cut at that boundary and the tail ran as one more prefill call.
"""
from __future__ import annotations

from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np


# ------------------------------------------------------------------ which leaves, how many rows
def slot_leaf_mask(backend, state) -> list[bool]:
    """Per flattened state leaf: True for per-slot ring leaves (everything that is not paged global KV)."""
    paged = {id(a) for a in backend.global_kv_arrays(state)}
    return [id(a) not in paged for a in jax.tree.leaves(state)]


def rows_kept(ring_len: int, window: int) -> int:
    """Ring rows a snapshot keeps: the window (a call at C reads at most W positions before C; the DSpark
    context reads exactly W), or the whole ring when it is shorter (compressor / Engram rings)."""
    return min(ring_len, window)


def snapshot_nbytes(state, mask, window: int, tail: int = 0) -> int:
    """Bytes of one snapshot for this state layout (works on ``jax.eval_shape`` results too)."""
    total = 0
    for a, m in zip(jax.tree.leaves(state), mask):
        if m:
            row = int(np.prod(a.shape[2:], dtype=np.int64)) * jnp.dtype(a.dtype).itemsize
            total += rows_kept(a.shape[1] - tail, window) * row
    return total


def pool_capacity(one_bytes: int, budget: int, max_entries: int, mesh) -> int:
    """Snapshots the pool holds: none on a DP mesh (the pool would have to follow the slots' sharding) or under a
    budget below one snapshot; else as many as the budget holds, at most ``max_entries``. The engine asks it before
    building the state (whether the rings get the tail) and the runner after (the pool itself)."""
    return 0 if mesh is not None else min(budget // max(1, one_bytes), max_entries)


# ------------------------------------------------------------------ host side: LRU + pins
class SnapshotCache:
    """hash -> entry of a pool of ``capacity`` snapshots. Entries are taken least recently used first, never
    while pinned (a restore admitted but not launched yet)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.by_hash: "OrderedDict[int, int]" = OrderedDict()     # LRU order: oldest first
        self.hash_of: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.pins: dict[int, int] = {}
        self.saves = self.restores = self.evictions = 0

    def __len__(self):
        return len(self.by_hash)

    def get(self, h: int) -> int | None:
        e = self.by_hash.get(h)
        if e is not None:
            self.by_hash.move_to_end(h)
        return e

    def pin(self, e: int):
        self.pins[e] = self.pins.get(e, 0) + 1

    def unpin(self, e: int):
        n = self.pins[e] - 1
        if n:
            self.pins[e] = n
        else:
            del self.pins[e]

    def put(self, h: int) -> int | None:
        """An entry to save the snapshot of ``h`` into (registered now: the save launches before any later
        restore), or None when ``h`` is cached already or every entry is pinned."""
        if h in self.by_hash or self.capacity == 0:
            return None
        if self.free:
            e = self.free.pop()
        else:
            victim = next((v for v, e in self.by_hash.items() if e not in self.pins), None)
            if victim is None:
                return None
            e = self.by_hash.pop(victim)
            del self.hash_of[e]
            self.evictions += 1
        self.by_hash[h] = e
        self.hash_of[e] = h
        self.saves += 1
        return e

    def clear(self):
        """Forget every unpinned snapshot (``LLMEngine.evict_prefix_snapshots``, the prefix-cache reset)."""
        for h, e in list(self.by_hash.items()):
            if e not in self.pins:
                del self.by_hash[h]
                del self.hash_of[e]
                self.free.append(e)
                self.evictions += 1


# ------------------------------------------------------------------ device side: arrays + programs
class StatePool:
    """Snapshot arrays for the per-slot leaves of ``state`` and the save / restore programs (state and pool
    donated). ``rows``: fixed length of the (slot, entry, position) vectors of one call; ``tail``: ring rows
    beyond what a snapshot keeps (a save may come up to ``tail`` positions after its boundary: module docstring)."""

    def __init__(self, state, mask, *, capacity: int, window: int, num_slots: int, rows: int, tail: int = 0):
        self.mask, self.window, self.capacity, self.S, self.rows = mask, window, capacity, num_slots, rows
        self.tail = tail
        self.treedef = jax.tree.structure(state)
        leaves = jax.tree.leaves(state)
        self.pool = [jnp.zeros((capacity, rows_kept(a.shape[1] - tail, window)) + a.shape[2:], a.dtype)
                     for a, m in zip(leaves, mask) if m]
        self._save = jax.jit(self._save_impl, donate_argnums=(1,))
        self._restore = jax.jit(self._restore_impl, donate_argnums=(0,))
        self._compiled = {}

    def _ring_idx(self, a, pos):
        n = rows_kept(a.shape[1] - self.tail, self.window)
        return jnp.mod(pos[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None], a.shape[1])   # [K, n]

    def _save_impl(self, state, pool, slot, entry, pos):
        leaves = [a for a, m in zip(jax.tree.leaves(state), self.mask) if m]
        sl = jnp.clip(slot, 0, self.S - 1)
        out = []
        for a, p in zip(leaves, pool):
            rows = a[sl[:, None], self._ring_idx(a, pos)]
            out.append(p.at[entry].set(rows.astype(p.dtype), mode="drop"))       # entry == capacity: padding
        return out

    def _restore_impl(self, state, pool, slot, entry, pos):
        leaves = jax.tree.leaves(state)
        it = iter(pool)
        new = []
        for a, m in zip(leaves, self.mask):
            if m:
                p = next(it)
                rows = p[jnp.clip(entry, 0, self.capacity - 1)]
                idx = self._ring_idx(a, pos)
                a = a.at[slot[:, None], idx].set(rows.astype(a.dtype), mode="drop")   # slot == S: padding
            new.append(a)
        return jax.tree.unflatten(self.treedef, new)

    def _vectors(self, ops, pad_slot, pad_entry):
        sl = np.full((self.rows,), pad_slot, np.int32)
        en = np.full((self.rows,), pad_entry, np.int32)
        po = np.zeros((self.rows,), np.int32)
        for i, (s, e, p) in enumerate(ops):
            sl[i], en[i], po[i] = s, e, p
        return sl, en, po

    def save(self, state, ops):
        """``ops`` [(slot, entry, position)]: snapshot the slot's state at ``position`` into ``entry``."""
        for i in range(0, len(ops), self.rows):
            v = self._vectors(ops[i:i + self.rows], 0, self.capacity)
            fn = self._compiled.get("save") or self._save
            self.pool = fn(state, self.pool, *v)
        return state

    def restore(self, state, ops):
        """``ops`` [(slot, entry, position)]: write ``entry`` into the slot's rings below ``position``."""
        for i in range(0, len(ops), self.rows):
            v = self._vectors(ops[i:i + self.rows], self.S, 0)
            fn = self._compiled.get("restore") or self._restore
            state = fn(state, self.pool, *v)
        return state

    def warmup(self, state):
        """Compile both programs ahead of time (serving must not compile) and run each once with padding."""
        v = self._vectors([], 0, self.capacity)
        self._compiled["save"] = self._save.lower(state, self.pool, *v).compile()
        v = self._vectors([], self.S, 0)
        self._compiled["restore"] = self._restore.lower(state, self.pool, *v).compile()
        state = self.restore(state, [])
        return self.save(state, [])

    @property
    def nbytes(self) -> int:
        return int(sum(p.nbytes for p in self.pool))
