"""One transfer each way per call: a step's host inputs packed into a single uint32 buffer, and its results too.

A decode call's inputs are ~23 small arrays (page tables, sampling rows, masks ...); handing them to a compiled
program one by one costs a transfer each (on the 2-core CPU 0.8-1.4 ms for 23 arrays against 0.05-0.1 ms for the
same bytes as one array, ``scripts/gpu_engine_steps.py --call-overhead``). ``pack`` concatenates every leaf as 32-bit
words (bools as 0 / 1) into one buffer; the layout (tree structure, shapes, dtypes) travels as the pytree's static
part, so each program compiles for its one layout, and ``unpack`` slices the words back inside the program. The
results go back the same way (``pack_traced`` in the program, ``to_host`` on the host: ~13 arrays, 0.4-0.6 ms on the
CPU as separate transfers).
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax

_WORD = {np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32)}


@jax.tree_util.register_pytree_node_class
class PackedInputs:
    """``buf`` (uint32 words, host or device) and ``layout``: (treedef, ((shape, dtype str), ...))."""

    def __init__(self, buf, layout):
        self.buf, self.layout = buf, layout

    def tree_flatten(self):
        return (self.buf,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def unpack(self):
        """The original dict of arrays (inside a traced program: slices and bitcasts of the one buffer)."""
        treedef, spec = self.layout
        out, off = [], 0
        for shape, dt in spec:
            n = int(np.prod(shape, dtype=np.int64))
            w = lax.slice_in_dim(self.buf, off, off + n)
            off += n
            dt = np.dtype(dt)
            a = (w != 0) if dt == np.bool_ else w if dt == np.uint32 else lax.bitcast_convert_type(w, dt)
            out.append(a.reshape(shape))
        return jax.tree.unflatten(treedef, out)


def pack(inp):
    """Host inputs -> ``PackedInputs``; ``inp`` itself when a leaf is neither a 32-bit number nor a bool (or is
    already on a device, or already packed)."""
    if isinstance(inp, PackedInputs):
        return inp
    leaves, treedef = jax.tree.flatten(inp)
    arrs = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            return inp
        a = np.asarray(leaf)
        if a.dtype == np.bool_:
            a = a.astype(np.uint32)
        elif a.dtype not in _WORD:
            return inp
        arrs.append(a)
    spec = tuple((np.shape(leaf), np.asarray(leaf).dtype.str) for leaf in leaves)
    buf = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint32) for a in arrs]) if arrs \
        else np.zeros((0,), np.uint32)
    return PackedInputs(buf, (treedef, spec))


def unpacked(inp):
    """Inside a program: the dict of a ``PackedInputs``, any other input as it is."""
    return inp.unpack() if isinstance(inp, PackedInputs) else inp


def pack_traced(tree):
    """Inside a program: its results as one ``PackedInputs`` (one device-to-host transfer), unpacked on the host by
    ``to_host``; the tree itself when a leaf is neither 32-bit nor bool."""
    import jax.numpy as jnp
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or any(jnp.dtype(x.dtype) not in _WORD | {np.dtype(np.bool_)} for x in leaves):
        return tree
    words = [(x.astype(jnp.uint32) if x.dtype == jnp.bool_ else
              x if x.dtype == jnp.uint32 else lax.bitcast_convert_type(x, jnp.uint32)).reshape(-1) for x in leaves]
    spec = tuple((tuple(x.shape), np.dtype(x.dtype).str) for x in leaves)
    return PackedInputs(jnp.concatenate(words), (treedef, spec))


def to_host(x):
    """``jax.device_get`` of a program's results, unpacking a ``PackedInputs`` into numpy arrays (views of one
    buffer; bools copied)."""
    x = jax.device_get(x)
    if not isinstance(x, PackedInputs):
        return x
    treedef, spec = x.layout
    buf, out, off = np.asarray(x.buf), [], 0
    for shape, dt in spec:
        n = int(np.prod(shape, dtype=np.int64))
        w = buf[off:off + n]
        off += n
        dt = np.dtype(dt)
        out.append((w != 0 if dt == np.bool_ else w.view(dt)).reshape(shape))
    return jax.tree.unflatten(treedef, out)
