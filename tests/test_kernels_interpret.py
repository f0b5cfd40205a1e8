"""The Triton kernels' logic in Triton's interpreter (CPU, no GPU): runs the checking scripts as subprocesses
(TRITON_INTERPRET must be set before triton is imported). Skipped when triton is not installed (CI's venv)."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.mark.parametrize("script", ["triton_interpret_moe.py", "triton_interpret_sparse_attention.py",
                                    "triton_interpret_indexer.py", "triton_interpret_mhc.py"])
def test_interpreter_script(script):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
