"""What the adaptive-speculation study scripts (adaptive_*.py) share: decode inputs that keep every row running."""
from __future__ import annotations

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
