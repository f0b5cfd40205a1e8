"""Probe: does ``jax.lax.ragged_all_to_all`` compile and run on this backend, with the offsets semantics
an EP dispatch needs? Exit 0 = yes (prints OK), non-zero = no (prints the XLA error).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 scripts/check_ragged_a2a.py   # CPU
    python3 scripts/check_ragged_a2a.py                                                       # GPUs

jax/jaxlib 0.10.2 on CPU: ``UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
ThunkEmitter`` (jax-ml/jax#34755, open), so the ragged EP collective was not built.

Rank r sends (r + j) % 3 rows to rank j (row value 100r + 10j + i); receiver j must hold the rows of
ranks 0..n-1 in rank order, the rest of its buffer untouched (-1).
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

n = min(4, jax.device_count())
mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
sizes = np.array([[(r + j) % 3 for j in range(n)] for r in range(n)], np.int32)   # [src, dst]
CAP = 2 * n
ops = np.zeros((n, CAP), np.float32)
in_off = np.zeros((n, n), np.int32)
out_off = np.zeros((n, n), np.int32)
for r in range(n):
    o = 0
    for j in range(n):
        in_off[r, j] = o
        ops[r, o:o + sizes[r, j]] = 100 * r + 10 * j + np.arange(sizes[r, j])
        o += sizes[r, j]
        out_off[r, j] = sizes[:r, j].sum()          # where r's chunk lands on receiver j
recv = sizes.T.copy()


def body(op, io, ss, oo, rs):
    out = jnp.full((CAP,), -1.0, jnp.float32)
    return jax.lax.ragged_all_to_all(op[0], out, io[0], ss[0], oo[0], rs[0], axis_name="x")[None]


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x")))
try:
    got = np.asarray(f(ops, in_off, sizes, out_off, recv))
except Exception as e:  # noqa: BLE001 - report whatever the backend says
    print(f"FAIL ragged_all_to_all on {jax.devices()[0].platform}, jax {jax.__version__}: {e}".splitlines()[0])
    sys.exit(1)
for j in range(n):
    want = [100 * r + 10 * j + i for r in range(n) for i in range(sizes[r, j])]
    assert list(got[j, :len(want)]) == want and np.all(got[j, len(want):] == -1), (j, got[j])
print(f"OK ragged_all_to_all on {jax.devices()[0].platform} x{n}, jax {jax.__version__}")
