"""Helpers of the DP / EPLB engine tests, several of which need (faked) CPU devices.

tests/conftest.py fakes 8 CPU devices for the whole session; when something initialised JAX with fewer
first, a test re-runs itself in a child process with the flag set (the flag only works before JAX starts)."""
import os
import subprocess
import sys

import jax
import numpy as np

#: engine options of the tiny-model DP / EPLB tests (small pools; fp32 so sharded == single device)
TINY_ENGINE = dict(max_num_seqs=4, max_model_len=128, page_size=16, max_num_batched_tokens=64, precision="fp32",
                   decode_steps=2)


def rerun_in_child(test_file: str, test_name: str, devices: int = 8) -> bool:
    """Run ``test_file::test_name`` in a child pytest with ``devices`` faked CPU devices when this process
    sees fewer than 2; True when it did (and the child passed)."""
    if jax.device_count() >= 2:
        return False
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        f"{os.path.abspath(test_file)}::{test_name}"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return True


def prompts(n, seed=0, lo=3, hi=60, vocab=64):
    """``n`` random prompts (token ids in ``[2, vocab)``, lengths in ``[lo, hi)``)."""
    r = np.random.default_rng(seed)
    return [[int(x) for x in r.integers(2, vocab, size=int(r.integers(lo, hi)))] for _ in range(n)]


def run_all(eng, items, check=None):
    """items: (rid, prompt, params, dp_rank); all added at once, run to the end (``check(eng)`` after every
    step). Returns {rid: token ids}; no compiles in steps, every slot free again."""
    for rid, p, sp, rank in items:
        eng.add_request(rid, p, sp, dp_rank=rank)
    res = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                res[o.request_id] = o.outputs[0].token_ids
        if check is not None:
            check(eng)
    assert eng.compiles_after_warmup == 0
    assert not eng.running and eng.slots.num_free == eng.max_num_seqs
    return res
