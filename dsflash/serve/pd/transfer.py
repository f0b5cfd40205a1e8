"""What moves between a prefill and a decode instance, and how it is cut out of / put into the state.

The model state (``dsflash.model.state``) has two kinds of leaves:

* **global KV** (``main_kv[src]``, ``index_k[src]``): paged pools ``[pages * P/r, ...]``; entry ``j`` of a
  ratio-``r`` source covers tokens ``j*r .. j*r+r-1`` and lives at ``pt[j // (P/r)] * (P/r) + j % (P/r)``.
  A prompt of ``n`` tokens needs entries ``0 .. ceil(n/r)-1`` of every source. These move (minus the pages
  the decode side already holds in its prefix cache).
* **per-slot rings** (``swa[block]`` incl. DSpark ``mtp.s``, ``comp[src]``, ``engram_hist``): ``[slots, R, ...]``,
  position ``q`` at row ``q % R``. Decoding from position ``n`` reads only the last rows: the window
  (``n - W .. n - 1``: SWA keys ``q - W + 1 .. q`` for queries ``q >= n``, DSpark context ``pos - W .. pos - 1``),
  the ratio-2 compressor's pending token (``n - 2 .. n - 1``) and the Engram n-gram history
  (``n - (N - 1) .. n - 1``). Only those rows move, by absolute position, so the two sides may use
  different ring lengths (``ring_slack``) and page sizes.

Host-staged wire format (one HTTP body): ``b"DSKV"`` + u32 version + u64 header length + JSON header +
the raw bytes of every array, concatenated in header order. Arrays keep their stored dtypes (FP4 nibbles,
E4M3/UE8M0 bytes, fp32 compressor rows): the bytes on the wire are the bytes of the caches.

The transfer-server path (``device_transfer.py``) moves the same arrays device to device instead
(``Layout.extract_device``; ``install`` takes device arrays as well as host ones).

Device work (gather on the prefill side, scatter on the decode side) is jitted with the entry count padded
to a power of two, so a server compiles a handful of shapes, never one per prompt length.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

MAGIC = b"DSKV"
VERSION = 1
GLOBAL_KINDS = ("main_kv", "index_k")


def prompt_digest(ids) -> str:
    """SHA-256 of a prompt's token ids (little-endian int64), hex: both sides check they hold the same prompt
    (the ids do not travel); the router signs it and the prefill side's KV-body MAC binds the body to it."""
    import hashlib
    return hashlib.sha256(np.asarray(list(ids), "<i8").tobytes()).hexdigest()


def _bucket(n: int) -> int:
    return 8 if n <= 8 else 1 << (n - 1).bit_length()


def _np_dtype(name: str):
    return np.dtype(jnp.dtype(name))


def _leaves(tree, prefix=()):
    """Flatten nested dicts to ``[(path tuple, array)]`` in sorted key order."""
    out = []
    for k in sorted(tree):
        v = tree[k]
        if isinstance(v, dict):
            out.extend(_leaves(v, prefix + (k,)))
        else:
            out.append((prefix + (k,), v))
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    """Functional set of a nested-dict leaf."""
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


class Layout:
    """The transfer-relevant view of one engine's state: which leaf is global (and its ratio) or a ring
    (and how many trailing positions decode needs). Built from the engine's real state arrays."""

    def __init__(self, engine):
        be = engine.backend
        cfg = getattr(be, "cfg", None)
        if cfg is None or not isinstance(engine.runner.state, dict) or "main_kv" not in engine.runner.state:
            raise ValueError("P/D disaggregation needs the dsflash model state layout (ModelBackend)")
        st = engine.runner.state
        self.page_size = engine.page_size
        self.window = int(cfg.sliding_window)
        self.ngram = int(getattr(cfg, "engram_max_ngram_size", 1) or 1)
        self.num_pages = engine.geo.num_pages
        self.global_paths, self.slot_paths = [], []
        self.ratio, self.need, self.fill = {}, {}, {}
        for path, a in _leaves(st):
            if path[0] in GLOBAL_KINDS:
                r = int(cfg.ratio(int(path[1])))
                self.global_paths.append(path)
                self.ratio[path] = r
            else:
                self.slot_paths.append(path)
                if path[0] == "swa":
                    self.need[path] = self.window
                elif path[0] == "comp":
                    self.need[path] = 2
                elif path[0] == "engram_hist":
                    self.need[path] = max(1, self.ngram - 1)
                else:                       # unknown per-slot leaf: move all of it
                    self.need[path] = a.shape[1]
                self.fill[path] = -1 if path[0] == "engram_hist" else 0
        self.shapes = {"/".join(p): [list(_get(st, p).shape[1:]), str(_get(st, p).dtype)]
                       for p in self.global_paths}
        self.shapes.update({"/".join(p): [list(_get(st, p).shape[2:]), str(_get(st, p).dtype)]
                            for p in self.slot_paths})
        self._gather = jax.jit(self._gather_impl, static_argnums=(2,))
        self._offer = jax.jit(self._offer_impl)
        self._ring = jax.jit(self._ring_impl, static_argnums=(3,))
        self._slot_rows = jax.jit(self._slot_rows_impl)
        self._scatter = jax.jit(self._scatter_impl, donate_argnums=(0,))
        self._put_slot = jax.jit(self._put_slot_impl, donate_argnums=(0,))
        self._set_row = jax.jit(self._set_row_impl, donate_argnums=(0,))

    def signature(self) -> dict:
        """What both sides must agree on (compared in the one-time handshake)."""
        return {"window": self.window, "ngram": self.ngram, "leaves": self.shapes,
                "ratios": {"/".join(p): r for p, r in self.ratio.items()}}

    def check_payload(self, arrays, n: int):
        """Every array of a received body against this instance's layout for a prompt of ``n`` tokens: known
        and unique names, none missing, this side's dtype and trailing shape, the right kind and ratio, global
        entries within ``[0, ceil(n/r))``, ring rows ending at ``n`` and no more than needed. Raises
        ``ValueError`` (run before anything is installed). ``a`` may be an array or a shape/dtype spec (the
        transfer path checks the offered specs before it pulls)."""
        kinds = {"/".join(p): ("global", r) for p, r in self.ratio.items()}
        kinds.update({"/".join(p): ("ring", self.need[p]) for p in self.slot_paths})
        seen = set()
        for name, a, info in arrays:
            if name not in kinds:
                raise ValueError(f"KV payload has an array {name!r} this instance's layout does not have")
            if name in seen:
                raise ValueError(f"KV payload has {name!r} twice")
            seen.add(name)
            shape, dtype = self.shapes[name]
            if list(a.shape[1:]) != list(shape) or str(a.dtype) != dtype:
                raise ValueError(f"KV payload {name}: {a.dtype}{list(a.shape[1:])} per row, this instance "
                                 f"stores {dtype}{list(shape)}")
            kind, x = kinds[name]
            first = info.get("first")
            if info.get("kind") != kind or type(first) is not int or first < 0:
                raise ValueError(f"KV payload {name}: kind {info.get('kind')!r} first {first!r}, expected a "
                                 f"{kind} array")
            if kind == "global":
                if info.get("ratio") != x or first + a.shape[0] > math.ceil(n / x):
                    raise ValueError(f"KV payload {name}: entries [{first}, {first + a.shape[0]}) at ratio "
                                     f"{info.get('ratio')}, a {n}-token prompt has {math.ceil(n / x)} at ratio {x}")
            elif first + a.shape[0] != n or a.shape[0] > x:
                raise ValueError(f"KV payload {name}: positions [{first}, {first + a.shape[0]}), expected at most "
                                 f"the last {x} of {n}")
        if seen != set(kinds):
            raise ValueError(f"KV payload lacks {sorted(set(kinds) - seen)}")

    # ------------------------------------------------------------------ sizes
    def global_bytes_per_token(self, state) -> float:
        return sum(_get(state, p).nbytes for p in self.global_paths) / (self.num_pages * self.page_size)

    def window_bytes(self, state) -> int:
        """Bytes of the in-window per-slot rows one transfer carries at most."""
        tot = 0
        for p in self.slot_paths:
            a = _get(state, p)
            tot += min(self.need[p], a.shape[1]) * (a.nbytes // (a.shape[0] * a.shape[1]))
        return tot

    def entry_bytes(self, state) -> int:
        """Bytes of one entry of every global leaf (the rounding of a partial ratio-r group)."""
        return sum(_get(state, p).nbytes // _get(state, p).shape[0] for p in self.global_paths)

    # ------------------------------------------------------------------ device programs
    def _gather_impl(self, state, idx, paths):
        return {p: jnp.take(_get(state, p), idx[self.ratio[p]], axis=0) for p in paths}

    def _slot_rows_impl(self, state, slot):
        return {p: _get(state, p)[slot] for p in self.slot_paths}

    def _scatter_impl(self, state, idx, vals):
        for p, v in vals.items():
            a = _get(state, p)
            state = _set(state, p, a.at[idx[self.ratio[p]]].set(v.astype(a.dtype), mode="drop"))
        return state

    def _put_slot_impl(self, state, slot, rows):
        for p, v in rows.items():
            a = _get(state, p)
            state = _set(state, p, a.at[slot].set(v.astype(a.dtype)))
        return state

    @staticmethod
    def _ring_impl(a, ix, fill, R):
        return jnp.full((R,) + a.shape[1:], fill, fill.dtype).at[ix].set(a.astype(fill.dtype), mode="drop")

    @staticmethod
    def _set_row_impl(rows, slot, vals):
        return {k: (rows[k].at[slot].set(vals[k].astype(rows[k].dtype)) if k in vals else rows[k]) for k in rows}

    # ------------------------------------------------------------------ prefill side
    def _entry_index(self, pages, r, first, last, P, pad_to, oob):
        epp = P // r
        j = np.arange(first, last)
        idx = np.full((pad_to,), oob, np.int32)
        if len(j):
            idx[:len(j)] = np.asarray(pages, np.int64)[j // epp] * epp + j % epp
        return idx

    def extract(self, state, pages, slot, n, skip_tokens=0):
        """Host copies of what decode needs for a prompt of ``n`` tokens held in ``pages`` / ``slot``:
        returns ``(meta, arrays)`` with ``arrays`` a list of ``(name, np.ndarray, info)``."""
        P = self.page_size
        ratios = sorted(set(self.ratio.values()))
        rng = {r: (min(skip_tokens // r, math.ceil(n / r)), math.ceil(n / r)) for r in ratios}
        pad = _bucket(max(hi - lo for lo, hi in rng.values()) or 1)
        idx = {r: jnp.asarray(self._entry_index(pages, r, lo, hi, P, pad, 0)) for r, (lo, hi) in rng.items()}
        g = jax.device_get(self._gather(state, idx, tuple(self.global_paths)))
        rows = jax.device_get(self._slot_rows(state, jnp.int32(slot)))
        out = []
        for p in self.global_paths:
            lo, hi = rng[self.ratio[p]]
            out.append(("/".join(p), np.ascontiguousarray(g[p][:hi - lo]),
                        {"kind": "global", "ratio": self.ratio[p], "first": lo}))
        for p in self.slot_paths:
            R = rows[p].shape[0]
            q0 = max(0, n - self.need[p])
            q = np.arange(q0, n)
            out.append(("/".join(p), np.ascontiguousarray(rows[p][q % R]), {"kind": "ring", "first": int(q0)}))
        return out

    def extract_device(self, state, pages, slot, n, skip_tokens=0):
        """As :meth:`extract`, but the arrays stay on the device (the transfer-server path offers them as
        they are) and global arrays keep the gather's power-of-two padding (``info["rows"]`` are valid), so
        the programs here and on the decode side compile per bucket, not per prompt length."""
        P = self.page_size
        ratios = sorted(set(self.ratio.values()))
        rng = {r: (min(skip_tokens // r, math.ceil(n / r)), math.ceil(n / r)) for r in ratios}
        pad = _bucket(max(hi - lo for lo, hi in rng.values()) or 1)
        idx = {r: jnp.asarray(self._entry_index(pages, r, lo, hi, P, pad, 0)) for r, (lo, hi) in rng.items()}
        ring = {p: jnp.asarray(np.arange(max(0, n - self.need[p]), n) % _get(state, p).shape[1], np.int32)
                for p in self.slot_paths}
        g, rows = self._offer(state, idx, jnp.int32(slot), ring)
        out = []
        for p in self.global_paths:
            lo, hi = rng[self.ratio[p]]
            out.append(("/".join(p), g[p], {"kind": "global", "ratio": self.ratio[p], "first": lo, "rows": hi - lo}))
        for p in self.slot_paths:
            out.append(("/".join(p), rows[p], {"kind": "ring", "first": max(0, n - self.need[p])}))
        return out

    def _offer_impl(self, state, idx, slot, ring):
        return (self._gather_impl(state, idx, tuple(self.global_paths)),
                {p: jnp.take(_get(state, p)[slot], q, axis=0) for p, q in ring.items()})

    def unpadded_specs(self, arrays):
        """The transfer path's ``[(name, spec, info)]`` as :meth:`check_payload` sees them: global arrays cut
        to their valid ``rows``; all are padded to one power-of-two bucket of the longest, as the prefill side
        pads (so an offer cannot make this side allocate more)."""
        rows_of = [info.get("rows") for _, _, info in arrays if info.get("kind") == "global"]
        if not all(type(r) is int and r >= 0 for r in rows_of):
            raise ValueError(f"KV offer: global arrays need integer 'rows', got {rows_of}")
        pad = _bucket(max(rows_of, default=1) or 1)
        out = []
        for name, a, info in arrays:
            if info.get("kind") == "global":
                rows = info["rows"]
                if a.shape[0] != pad:
                    raise ValueError(f"KV offer {name}: {a.shape[0]} rows for {rows} valid ones (expected the "
                                     f"bucket {pad})")
                a = jax.ShapeDtypeStruct((rows,) + tuple(a.shape[1:]), a.dtype)
            out.append((name, a, {k: v for k, v in info.items() if k != "rows"}))
        return out

    # ------------------------------------------------------------------ decode side
    def install(self, engine, arrays, pages, slot, n, hit_pages):
        """Write received arrays into ``engine.runner.state`` for a sequence holding ``pages`` / ``slot``.
        Global entries of the first ``hit_pages`` pages (already in this side's prefix cache) are not
        rewritten. Raises ``ValueError`` if something needed is missing."""
        P = self.page_size
        by = {name: (a, info) for name, a, info in arrays}
        state = engine.runner.state
        oob = 1 << 30
        gvals, idx = {}, {}
        spans, dev = {}, {}
        for p in self.global_paths:
            name = "/".join(p)
            if name not in by:
                raise ValueError(f"KV payload lacks {name}")
            a, info = by[name]
            r, first = self.ratio[p], int(info["first"])
            need_lo = hit_pages * P // r
            hi = math.ceil(n / r)
            count = int(info.get("rows", len(a)))
            if first > need_lo or first + count < hi or count > len(a):
                raise ValueError(f"KV payload for {name} covers entries [{first}, {first + len(a)}) but this "
                                 f"instance needs [{need_lo}, {hi})")
            lo = max(first, need_lo)
            spans[r] = (lo, hi)
            if not isinstance(a, np.ndarray):     # device array (padded rows): masked by the index, not sliced
                dev[r] = (first, a.shape[0])
                gvals[p] = a
                continue
            gvals[p] = a[lo - first:hi - first]
        pad = _bucket(max((hi - lo for lo, hi in spans.values()), default=1) or 1)
        for r, (lo, hi) in spans.items():
            if r in dev:                # row i of the pulled array is entry first + i; the rest drops
                first, rows = dev[r]
                ix = np.full((rows,), oob, np.int32)
                ix[lo - first:hi - first] = self._entry_index(pages, r, lo, hi, P, hi - lo, oob)
                idx[r] = jnp.asarray(ix)
            else:
                idx[r] = jnp.asarray(self._entry_index(pages, r, lo, hi, P, pad, oob))
        vals = {}
        for p, v in gvals.items():
            if isinstance(v, np.ndarray):
                buf = np.zeros((pad,) + v.shape[1:], v.dtype)
                buf[:len(v)] = v
                vals[p] = jnp.asarray(buf)
            else:
                vals[p] = v
        if vals:
            state = self._scatter(state, idx, vals)
        rows = {}
        for p in self.slot_paths:
            name = "/".join(p)
            if name not in by:
                raise ValueError(f"KV payload lacks {name}")
            a, info = by[name]
            full = _get(state, p)
            R = full.shape[1]
            q0 = int(info["first"])
            if q0 > max(0, n - self.need[p]) or q0 + len(a) != n:
                raise ValueError(f"KV payload for {name} holds positions [{q0}, {q0 + len(a)}), needs the last "
                                 f"{self.need[p]} of {n}")
            q = np.arange(q0, n)
            keep = q >= n - R
            if isinstance(a, np.ndarray):
                buf = np.full((R,) + tuple(full.shape[2:]), self.fill[p], np.dtype(full.dtype))
                buf[q[keep] % R] = a[keep]
                rows[p] = jnp.asarray(buf)
            else:                       # device array: build the ring on the device
                ix = np.where(keep, q % R, R).astype(np.int32)     # R: dropped (a ring shorter than the rows)
                rows[p] = self._ring(a, jnp.asarray(ix), jnp.asarray(self.fill[p], full.dtype), R)
        state = self._put_slot(state, jnp.int32(slot), rows)
        engine.runner.state = state

    def set_row(self, engine, slot, vals):
        engine.runner.rows = self._set_row(engine.runner.rows, jnp.int32(slot),
                                           {k: jnp.asarray(v) for k, v in vals.items()})


# ---------------------------------------------------------------------- wire format
def pack(meta: dict, arrays) -> bytes:
    """``meta`` (JSON-able) + arrays -> one bytes object."""
    specs, blobs = [], []
    for name, a, info in arrays:
        b = a.tobytes()
        specs.append({"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "nbytes": len(b), **info})
        blobs.append(b)
    head = json.dumps({**meta, "arrays": specs}, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<IQ", VERSION, len(head)), head, *blobs])


def unpack(data: bytes):
    """Inverse of :func:`pack`: ``(meta, arrays)``; raises ``ValueError`` on a truncated/corrupt body."""
    if len(data) < 16 or data[:4] != MAGIC:
        raise ValueError("not a dsflash KV payload (bad magic)")
    ver, hl = struct.unpack("<IQ", data[4:16])
    if ver != VERSION:
        raise ValueError(f"KV payload version {ver}, expected {VERSION}")
    if len(data) < 16 + hl:
        raise ValueError("KV payload truncated (header)")
    meta = json.loads(data[16:16 + hl])
    off = 16 + hl
    arrays = []
    for s in meta.pop("arrays"):
        nb = s["nbytes"]
        dt = _np_dtype(s["dtype"])
        if type(nb) is not int or nb != int(np.prod(s["shape"], dtype=np.int64)) * dt.itemsize:
            raise ValueError(f"KV payload array {s['name']}: {nb!r} bytes for {s['dtype']}{s['shape']}")
        if off + nb > len(data):
            raise ValueError(f"KV payload truncated: {len(data)} bytes, array {s['name']} needs up to {off + nb}")
        a = np.frombuffer(data, dt, count=int(np.prod(s["shape"], dtype=np.int64)),
                          offset=off).reshape(s["shape"])
        info = {k: v for k, v in s.items() if k not in ("name", "dtype", "shape", "nbytes")}
        arrays.append((s["name"], a, info))
        off += nb
    if off != len(data):
        raise ValueError(f"KV payload has {len(data) - off} trailing bytes")
    return meta, arrays


@dataclass
class TransferSize:
    """Bytes of one transfer, split as the bound is stated."""
    prompt_tokens: int
    global_bytes: int = 0
    window_bytes: int = 0
    wire_bytes: int = 0
    skipped_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @staticmethod
    def of(meta, arrays, wire_bytes) -> "TransferSize":
        t = TransferSize(int(meta["num_tokens"]), wire_bytes=wire_bytes, skipped_tokens=int(meta.get("skip_tokens", 0)))
        for _, a, info in arrays:
            if info["kind"] == "global":        # padded device arrays (transfer path) count their valid rows
                t.global_bytes += int(a.nbytes) // max(1, a.shape[0]) * int(info.get("rows", a.shape[0]))
            else:
                t.window_bytes += a.nbytes
        return t
