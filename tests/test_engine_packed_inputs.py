"""packed.py: a step's host inputs as one buffer, unpacked inside the program to the same arrays bit for bit."""
import jax
import numpy as np

from dsflash.serve.engine.packed import Packed, pack, unpacked


def _inputs():
    r = np.random.default_rng(0)
    return {"page_table": r.integers(0, 1 << 20, (4, 3)).astype(np.int32),
            "floor": np.array([-5, 0, 7, 2**31 - 1], np.int32),
            "max_iters": np.int32(4),
            "guided": np.array([True, False, True, False]),
            "sp": {"temp": np.array([0.0, -0.0, np.inf, 1e-38], np.float32),
                   "seed_lo": np.array([0, 1, 2**32 - 1, 2**31], np.uint32),
                   "stop_ids": np.full((4, 2), -1, np.int32)},
            "mask": np.zeros((4, 0), np.int32)}


def test_pack_round_trips_through_a_program():
    inp = _inputs()
    p = pack(inp)
    assert isinstance(p, Packed) and len(jax.tree.leaves(p)) == 1 and p.buf.dtype == np.uint32
    got = jax.jit(unpacked)(p)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(inp)[0], jax.tree.leaves(got)):
        b = np.asarray(b)
        assert b.dtype == np.asarray(a).dtype and b.shape == np.shape(a), path
        assert np.array_equal(b.reshape(-1).view(np.uint8), np.asarray(a).reshape(-1).view(np.uint8)), path  # bits


def test_one_compile_per_layout_and_fallbacks():
    fn = jax.jit(lambda x: jax.tree.map(lambda a: a.sum(), unpacked(x)))
    inp = _inputs()
    fn(pack(inp))
    inp["floor"] = inp["floor"] + 1                   # same layout, other values: no retrace
    fn(pack(inp))
    assert fn._cache_size() == 1
    inp["floor"] = inp["floor"][:2]                   # another layout: another program
    fn(pack(inp))
    assert fn._cache_size() == 2
    odd = {"a": np.zeros(3, np.int8)}                 # not 32-bit: passed as it is
    assert pack(odd) is odd
    on_device = {"a": jax.numpy.zeros(3)}
    assert pack(on_device) is on_device
    p = pack(_inputs())
    assert pack(p) is p


def test_results_come_back_in_one_buffer_bit_for_bit():
    from dsflash.serve.engine.packed import pack_traced, to_host
    res = {"tok": np.array([[3, -1], [7, 2**31 - 1]], np.int32), "stop": np.array([True, False]),
           "lp": np.array([[-0.0, -np.inf], [1.5, np.nan]], np.float32), "iters": np.int32(3),
           "seed": np.array([2**32 - 1], np.uint32)}
    out = jax.jit(pack_traced)(res)
    assert isinstance(out, Packed) and len(jax.tree.leaves(out)) == 1
    host = to_host(out)
    assert set(host) == set(res)
    for k, a in res.items():
        b = host[k]
        assert b.dtype == a.dtype and b.shape == a.shape, k
        assert np.array_equal(np.asarray(b).reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8)), k
    odd = {"x": jax.numpy.zeros(2, jax.numpy.bfloat16)}          # not 32-bit: left as it is
    assert not isinstance(jax.jit(pack_traced)(odd), Packed)


def test_an_entry_kept_on_the_device_is_outside_the_buffer_and_keeps_the_layout():
    """``pack(inp, on_device={key: device array})``: that entry is not in the buffer, the program sees it as if it
    had been packed, and a call whose entry is another device array of the same shape reuses the program; a
    replacement of another shape or dtype is refused naming the key."""
    import jax.numpy as jnp
    import pytest
    inp = dict(_inputs(), mask=np.arange(12, dtype=np.int32).reshape(4, 3))
    fn = jax.jit(lambda p: unpacked(p))              # a program of its own (jit caches per function)
    plain = pack(inp)
    kept = pack(inp, on_device={"mask": jax.device_put(np.zeros((4, 3), np.int32))})
    assert kept.buf.size == plain.buf.size - 12 and set(kept.device) == {"mask"}
    got = fn(kept)
    assert np.array_equal(np.asarray(got["mask"]), np.zeros((4, 3))) and np.array_equal(got["floor"], inp["floor"])
    got = fn(pack(inp, on_device={"mask": jax.device_put(inp["mask"])}))
    assert np.array_equal(np.asarray(got["mask"]), inp["mask"]) and fn._cache_size() == 1
    with pytest.raises(ValueError, match="on_device\\['mask'\\]"):
        pack(inp, on_device={"mask": jnp.zeros((4, 2), jnp.int32)})
    with pytest.raises(ValueError, match="on_device\\['mask'\\]"):
        pack(inp, on_device={"mask": jnp.zeros((4, 3), jnp.float32)})
