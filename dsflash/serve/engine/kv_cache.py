"""Host-side bookkeeping of the engine's caches: global-KV pages with a prefix cache, and per-sequence slots.

The device arrays live in the model state (``dsflash.model.state.init_state``); this module only decides
*which* page / slot a sequence uses. Global KV (main KV + index K of every KV source) is paged: one page
holds ``page_size`` consecutive token positions of every source. Everything bounded per sequence (window
rings, compressor ring, Engram history, DSpark rings) lives in a slot.

Prefix cache (vLLM-style block hashing over global KV): a *full* page whose tokens are known is
registered under ``hash((parent_hash, tokens of the page))``. A new sequence walks its prompt's full
pages and reuses every page whose chain hash is registered. Pages carry reference counts; a page whose
count drops to zero stays cached (evictable, least recently freed first) until its memory is needed.
Only global KV is in pages: the per-slot window state of a hit is restored from a snapshot (``snapshots.py``,
exact mode) or rebuilt by encoder replay (SPEC §6.1).

Data parallelism: with D DP ranks each rank owns a contiguous range of page ids and of slots (the state's
``pages`` / ``slots`` axes are split that way over the DP devices). :class:`PagePoolGroup` and
:class:`SlotPoolGroup` hold one pool per rank over its range (global ids) plus the aggregate accounting;
a sequence's pages and slot always come from its rank's pool, so prefix-cache hits happen only within a
rank.
"""
from __future__ import annotations

from collections import OrderedDict


class OutOfPages(Exception):
    pass


def block_hashes(tokens, page_size: int, max_blocks: int | None = None, parent: int | None = None) -> list[int]:
    """Chain hashes of the full ``page_size`` blocks of ``tokens`` (at most ``max_blocks``)."""
    n = len(tokens) // page_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out, h = [], parent
    for i in range(n):
        h = hash((h, tuple(tokens[i * page_size:(i + 1) * page_size])))
        out.append(h)
    return out


class PagePool:
    """Reference-counted pages with a hash -> page prefix cache and LRU eviction of free cached pages."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True, first_page: int = 0):
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self.first_page = b = first_page      # this pool hands out the global ids [first_page, first_page + num_pages)
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_pages             # indexed by id - first_page
        self.page_hash: list[int | None] = [None] * num_pages
        self.free_plain: list[int] = list(range(b + num_pages - 1, b - 1, -1))  # pop() gives low ids first
        self.free_cached: "OrderedDict[int, None]" = OrderedDict()        # LRU order: oldest first
        self.hash_to_page: dict[int, int] = {}
        # counters
        self.query_blocks = 0
        self.hit_blocks = 0
        self.evictions = 0

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_page)

    def usage(self) -> float:
        return self.num_used / self.num_pages

    def owns(self, page: int) -> bool:
        return self.first_page <= page < self.first_page + self.num_pages

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        out, b = [], self.first_page
        for _ in range(n):
            if self.free_plain:
                p = self.free_plain.pop()
            else:  # evict the least recently freed cached page
                p, _ = self.free_cached.popitem(last=False)
                h = self.page_hash[p - b]
                if h is not None and self.hash_to_page.get(h) == p:
                    del self.hash_to_page[h]
                self.page_hash[p - b] = None
                self.evictions += 1
            self.ref[p - b] = 1
            out.append(p)
        return out

    def free(self, pages) -> None:
        """Drop one reference to each page (a sequence's pages, freed in order)."""
        b = self.first_page
        for p in pages:
            self.ref[p - b] -= 1
            assert self.ref[p - b] >= 0, f"page {p} freed twice"
            if self.ref[p - b] == 0:
                if self.page_hash[p - b] is not None:
                    self.free_cached[p] = None
                else:
                    self.free_plain.append(p)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: list[int], count: bool = True) -> list[int]:
        """Longest run of cached pages for ``hashes``; takes a reference to each page returned."""
        hit = []
        if self.enable_prefix_cache:
            for h in hashes:
                p = self.hash_to_page.get(h)
                if p is None:
                    break
                hit.append(p)
        if count:
            self.query_blocks += len(hashes)
            self.hit_blocks += len(hit)
        b = self.first_page
        for p in hit:
            if self.ref[p - b] == 0:
                del self.free_cached[p]
            self.ref[p - b] += 1
        return hit

    def register(self, page: int, h: int) -> None:
        """Publish a full page (held by a sequence) under its chain hash."""
        if not self.enable_prefix_cache or self.page_hash[page - self.first_page] is not None:
            return
        if h in self.hash_to_page:  # an identical block is cached already: keep this page private
            return
        self.page_hash[page - self.first_page] = h
        self.hash_to_page[h] = page

    def reset_prefix_cache(self) -> None:
        b = self.first_page
        for i, h in enumerate(self.page_hash):
            if h is not None:
                self.page_hash[i] = None
                if self.ref[i] == 0:
                    del self.free_cached[i + b]
                    self.free_plain.append(i + b)
        self.hash_to_page.clear()


class SlotPool:
    """Per-sequence state slots (window rings etc.): a free list, lowest id first."""

    def __init__(self, num_slots: int, first_slot: int = 0):
        self.num_slots, self.first_slot = num_slots, first_slot
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert slot not in self._free
        self._free.append(slot)
        self._free.sort(reverse=True)

    @property
    def num_free(self) -> int:
        return len(self._free)


class PagePoolGroup:
    """One :class:`PagePool` per DP rank over contiguous global page ranges, with the aggregate accounting
    the engine reports (``num_used``, ``usage()``, ...). Allocation always goes through ``ranks[r]``."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool, num_ranks: int):
        if num_pages % num_ranks:
            raise ValueError(f"num_pages={num_pages} must divide by the DP size {num_ranks}")
        per = num_pages // num_ranks
        self.num_pages, self.page_size = num_pages, page_size
        self.ranks = [PagePool(per, page_size, enable_prefix_cache, first_page=r * per) for r in range(num_ranks)]

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.ranks)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return sum(p.num_cached for p in self.ranks)

    def usage(self) -> float:
        return self.num_used / self.num_pages

    @property
    def query_blocks(self) -> int:
        return sum(p.query_blocks for p in self.ranks)

    @property
    def hit_blocks(self) -> int:
        return sum(p.hit_blocks for p in self.ranks)

    @property
    def evictions(self) -> int:
        return sum(p.evictions for p in self.ranks)

    def reset_prefix_cache(self) -> None:
        for p in self.ranks:
            p.reset_prefix_cache()


class SlotPoolGroup:
    """One :class:`SlotPool` per DP rank over contiguous global slot ranges."""

    def __init__(self, num_slots: int, num_ranks: int):
        if num_slots % num_ranks:
            raise ValueError(f"max_num_seqs={num_slots} (slots) must divide by the DP size {num_ranks}")
        per = num_slots // num_ranks
        self.num_slots = num_slots
        self.ranks = [SlotPool(per, first_slot=r * per) for r in range(num_ranks)]

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.ranks)
