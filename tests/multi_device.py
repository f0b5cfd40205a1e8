"""Helpers for engine tests that need several (faked) CPU devices.

tests/conftest.py fakes 8 CPU devices for the whole session; when something initialised JAX with fewer
first, a test re-runs itself in a child process with the flag set (the flag only works before JAX starts)."""
import os
import subprocess
import sys

import jax

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
