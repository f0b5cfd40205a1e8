"""One transfer each way per call: a step's host inputs packed into a single uint32 buffer, and its results too.

A decode call's inputs are ~23 small arrays (page tables, sampling rows, masks ...); handing them to a compiled
program one by one costs a transfer each (on the 2-core CPU 0.8-1.4 ms for 23 arrays against 0.05-0.1 ms for the
same bytes as one array, ``scripts/gpu_engine_steps.py --call-overhead``). ``pack`` concatenates every leaf as 32-bit
words (bools as 0 / 1) into one buffer; the layout (tree structure, shapes, dtypes) travels as the pytree's static
part, so each program compiles for its one layout, and ``unpack`` slices the words back inside the program. The
results go back the same way (``pack_traced`` in the program, ``to_host`` on the host: ~13 arrays, 0.4-0.6 ms on the
CPU as separate transfers).

A leaf the host would send unchanged call after call can stay on the device instead (``pack(inp, on_device=...)``):
the guided-decoding token mask of a call without guided rows is all zeros and 94 % of a decode call's input bytes at
the real vocabulary (516 of 530 KB; run 46: inputs 0.59 ms a call on one H200).
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax

_WORD = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32)}


@jax.tree_util.register_pytree_node_class
class Packed:
    """A call's inputs or results as one array: ``buf`` (uint32 words, host or device) and ``layout``: (treedef,
    ((shape, dtype str), ...)), the pytree's static part; ``device``: top-level entries passed as device arrays of
    their own (a dict, possibly empty)."""

    def __init__(self, buf, layout, device=None):
        self.buf, self.layout, self.device = buf, layout, {} if device is None else device

    def tree_flatten(self):
        return (self.buf, self.device), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout, children[1])

    def unpack(self):
        """The original dict of arrays (inside a traced program: slices and bitcasts of the one buffer)."""
        def word_view(w, dt):
            return (w != 0) if dt == np.bool_ else w if dt == np.uint32 else lax.bitcast_convert_type(w, dt)
        out = _split(self, lambda off, n: lax.slice_in_dim(self.buf, off, off + n), word_view)
        return {**out, **self.device} if self.device else out


def _split(p, take, view):
    """``p``'s leaves again: ``take(offset, n)`` words of the buffer per leaf, ``view(words, dtype)`` as that dtype."""
    treedef, spec = p.layout
    out, off = [], 0
    for shape, dt in spec:
        n = int(np.prod(shape, dtype=np.int64))
        out.append(view(take(off, n), np.dtype(dt)).reshape(shape))
        off += n
    return jax.tree.unflatten(treedef, out)


def pack(inp, on_device=None):
    """Host inputs -> ``Packed``; ``inp`` itself when a leaf is neither a 32-bit number nor a bool (or is
    already on a device, or already packed). ``on_device``: ``{key: device array}`` sent in place of ``inp[key]``
    (same shape and dtype, so the program's layout does not change), outside the buffer."""
    if isinstance(inp, Packed):
        return inp
    on_device = on_device or {}
    for k, v in on_device.items():
        if np.shape(inp[k]) != v.shape or np.asarray(inp[k]).dtype != v.dtype:
            raise ValueError(f"pack: on_device[{k!r}] is {v.dtype}{list(v.shape)}, the input "
                             f"{np.asarray(inp[k]).dtype}{list(np.shape(inp[k]))}")
    rest = {k: v for k, v in inp.items() if k not in on_device} if on_device else inp
    leaves, treedef = jax.tree.flatten(rest)
    arrs, spec = [], []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            return inp
        a = np.asarray(leaf)
        spec.append((a.shape, a.dtype.str))
        if a.dtype == np.bool_:
            a = a.astype(np.uint32)
        elif a.dtype not in _WORD:
            return inp
        arrs.append(a)
    buf = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint32) for a in arrs]) if arrs \
        else np.zeros((0,), np.uint32)
    return Packed(buf, (treedef, tuple(spec)), dict(on_device))


def unpacked(inp):
    """Inside a program: the dict of a ``Packed``, any other input as it is."""
    return inp.unpack() if isinstance(inp, Packed) else inp


def pack_traced(tree):
    """Inside a program: its results as one ``Packed`` (one device-to-host transfer), unpacked on the host by
    ``to_host``; the tree itself when a leaf is neither 32-bit nor bool."""
    import jax.numpy as jnp
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or any(jnp.dtype(x.dtype) not in _WORD | {np.dtype(np.bool_)} for x in leaves):
        return tree
    words = [(x.astype(jnp.uint32) if x.dtype == jnp.bool_ else
              x if x.dtype == jnp.uint32 else lax.bitcast_convert_type(x, jnp.uint32)).reshape(-1) for x in leaves]
    spec = tuple((tuple(x.shape), np.dtype(x.dtype).str) for x in leaves)
    return Packed(jnp.concatenate(words), (treedef, spec))


def to_host(x):
    """``jax.device_get`` of a program's results, unpacking a ``Packed`` into numpy arrays (views of one
    buffer; bools copied)."""
    x = jax.device_get(x)
    if not isinstance(x, Packed):
        return x
    buf = np.asarray(x.buf)
    return _split(x, lambda off, n: buf[off:off + n], lambda w, dt: w != 0 if dt == np.bool_ else w.view(dt))
