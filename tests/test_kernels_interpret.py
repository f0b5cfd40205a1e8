"""The Triton kernels' logic in Triton's interpreter (CPU, no GPU): runs the checking scripts as subprocesses
(TRITON_INTERPRET must be set before triton is imported). Opt-in: ``DSFLASH_INTERPRET_TESTS=1`` (see below);
skipped when triton is not installed.
Each script runs every check in a fresh process and re-runs a failed one once (interpreter flake, NOTES.md); the
scripts fail if a re-run fails or more than one check needed one. A retry that passed is surfaced here as a
warning (shown in pytest's summary even with -q) and the script's output is printed (-s / -rP, or on failure)."""
import importlib.util
import os
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Opt-in (DSFLASH_INTERPRET_TESTS=1), not part of the default suite: the four scripts take ~5 min of the 15-min CI
# budget on 2 cores, and under load a check sometimes returns a wholly wrong result twice in a row (2026-11-30:
# MoE "--sk 6" failed in 1 of 6 fresh-process runs with two busy cores, 0 of 15 without; cause not found --
# dsflash/kernels/NOTES.md "Known flake"). The kernels are checked on the GPU by tests/gpu; run these by hand
# (or with the variable set) after changing a kernel.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.skipif(os.environ.get("DSFLASH_INTERPRET_TESTS") != "1",
                       reason="interpreter checks are opt-in: set DSFLASH_INTERPRET_TESTS=1 (slow; see the module)"),
]


@pytest.mark.parametrize("script", ["triton_interpret_moe.py", "triton_interpret_sparse_attention.py",
                                    "triton_interpret_sparse_attention_paged.py",
                                    "triton_interpret_indexer.py", "triton_interpret_mhc.py",
                                    "triton_interpret_topk.py --only split", "triton_interpret_rope.py"])
def test_interpreter_script(script):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    name, *args = script.split()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout)
    retries = [ln for ln in r.stdout.splitlines()
               if ("retr" in ln.lower() or "attempt" in ln) and "retried: none" not in ln.lower()]
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    if retries:
        warnings.warn(f"{script}: a check needed a re-run (interpreter flake?):\n" + "\n".join(retries))
