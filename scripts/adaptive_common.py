"""What the adaptive-speculation study scripts (adaptive_*.py) share: decode inputs that keep every row running, a
timer of one decode program's calls per iteration, and drafting forced off through the policy."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def endless_decode_inputs(eng):
    """The runner's decode inputs with every sequence's pages mapped (wrapping the pool), each row's full iteration
    budget and no generation limit: a decode call then runs ``max_iters`` iterations for every row, as in the
    decode-only phase of a long batch."""
    r = eng.runner
    inp = r.empty_decode_inputs()
    inp["page_table"] = np.arange(r.S * r.P, dtype=np.int32).reshape(r.S, r.P) % eng.geo.num_pages
    inp["row_steps"][:] = r.max_iters
    inp["sp"] = {k: v.copy() for k, v in inp["sp"].items()}
    inp["sp"]["max_gen"][:] = 10**6
    return inp


def iteration_timer(eng, fn, pos0):
    """A function that runs the compiled decode program ``fn`` once on ``eng``'s runner -- every row active at
    position ``pos0``, fresh rows each call -- and returns its wall seconds per decode iteration."""
    from dsflash.serve.engine.packed import to_host
    r = eng.runner
    inp = endless_decode_inputs(eng)

    def call():
        rows = {k: jnp.array(v) for k, v in jax.device_get(r.rows).items()}
        rows.update(active=jnp.ones((r.S,), bool), pos=jnp.full((r.S,), pos0, jnp.int32),
                    y=jnp.full((r.S,), 7, jnp.int32), n_gen=jnp.zeros((r.S,), jnp.int32))
        if "ctx_pos" in rows:
            rows["ctx_pos"] = jnp.full((r.S,), pos0, jnp.int32)
        jax.block_until_ready((rows, r.state))
        t = time.perf_counter()
        r.state, r.rows, res = fn(r.params, r.state, rows, r.place(inp))
        res = to_host(res)        # (inputs and results travel packed: packed.py)
        return (time.perf_counter() - t) / int(res["iters"])
    return call


def force_plain(pol):
    """Drafting forced off through the policy's own path (every call still runs ``choose`` -- estimates, the cost
    comparison, with the sequential verify the expected verify rows -- and ``observe``): the drafting program
    measured at 100x plain, never re-measured, no engine-wide reprobe."""
    pol.reprobe_every = 10**9
    pol.remeasure[pol.block] = 10**9
    ck = pol.costs[pol.block]
    ck.seconds, ck.samples, ck.ratio = 1.0, pol.probe_calls, 100.0
