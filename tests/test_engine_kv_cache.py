"""Page pool: allocation, reference counts, prefix hits, LRU eviction of free cached pages."""
import pytest

from dsflash.serve.engine.kv_cache import OutOfPages, PagePool, SlotPool, block_hashes


def test_alloc_free_and_exhaustion():
    pool = PagePool(4, 2)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.usage() == 0.75
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4


def test_prefix_hit_refcount_and_lru_eviction():
    pool = PagePool(4, 2)
    toks = [1, 2, 3, 4, 5]
    hs = block_hashes(toks, 2)
    assert len(hs) == 2
    pages = pool.allocate(3)
    for p, h in zip(pages, hs):
        pool.register(p, h)
    hit = pool.lookup(block_hashes([1, 2, 3, 4, 9, 9], 2))
    assert hit == pages[:2] and pool.ref[pages[0]] == 2
    assert pool.lookup(block_hashes([1, 2, 7, 7], 2)) == pages[:1]
    pool.free(pages[:1])
    pool.free(hit)
    pool.free(pages)                      # page 0 now free-cached, pages 1 cached, page 2 plain free
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.lookup(block_hashes(toks, 2)) == pages[:2]     # still cached after the owners left
    pool.free(pages[:2])
    got = pool.allocate(3)                # 2 plain + 1 evicted: the least recently freed (block 0)
    assert pool.evictions == 1 and pool.num_cached == 1 and pages[0] in got
    assert pool.lookup(block_hashes(toks, 2)) == []             # the chain now misses at block 0


def test_chain_hash_depends_on_prefix():
    a = block_hashes([1, 2, 3, 4], 2)
    b = block_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]


def test_slots():
    s = SlotPool(2)
    x, y = s.allocate(), s.allocate()
    assert {x, y} == {0, 1} and s.allocate() is None
    s.free(x)
    assert s.allocate() == x
