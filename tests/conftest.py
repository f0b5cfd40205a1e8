"""Test-wide setup. Eight faked CPU devices so sharding tests can build dep=8 meshes; everything else
runs on device 0. Must run before jax is imported anywhere."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent XLA compilation cache in tests (it does not help a one-off CI run and was where the first
# map-count crash below surfaced).
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

SERVER_CACHE = "DSFLASH_TEST_SERVER_CACHE"


def pytest_configure(config):
    """One persistent compilation cache folder for the run's default-model servers (test_server_util.start_server:
    test_server_openai, _structured, _fuzz and test_bench_serve_dsflash each start the same server): made by the
    first pytest process, before pytest-xdist starts its workers, so they inherit it through the environment. The
    first of those servers compiles, the later ones load its programs. Only server processes use it, never this
    process (the map-count note below)."""
    if SERVER_CACHE not in os.environ:
        os.environ[SERVER_CACHE] = config._dsflash_server_cache = tempfile.mkdtemp(prefix="dsflash-test-xla-")


def pytest_unconfigure(config):
    path = getattr(config, "_dsflash_server_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _memory_map_count() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:                                    # not Linux
        return None


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """XLA's CPU backend JIT-compiles every kernel of an executable into its own small memory mappings, and jax's
    jit caches keep every executable alive. Over the whole suite that reached Linux's default limit of 65,530
    mappings per process (measured: ~1,000 at the start, 35,000 by test_server_dp.py, growing by up to 5,000 per
    module) and the next compile or cache read died with SIGSEGV when its mmap failed (CI exit 139 in
    test_train_loop.py, twice locally). Dropping the caches after each module frees them; a module's own fixtures
    (warm LLMs) are torn down before this runs."""
    yield
    import jax
    jax.clear_caches()
    gc.collect()
    n = _memory_map_count()
    if n is not None and n > 50_000:
        raise RuntimeError(f"{n} memory mappings after this module (limit vm.max_map_count, usually 65,530): a "
                           "module keeps compiled programs alive; the next compile may segfault")


@pytest.fixture
def interpreter_script():
    """Run scripts/<name> in Triton's interpreter in a fresh process (TRITON_INTERPRET must be set before triton is
    imported) and assert it printed "all ok" and exited 0; returns its stdout."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(name: str, *args: str, timeout: int = 900) -> str:
        env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
        r = subprocess.run([sys.executable, os.path.join(root, "scripts", name), *args], env=env, cwd=root,
                           capture_output=True, text=True, timeout=timeout)
        print(r.stdout)
        assert r.returncode == 0 and "all ok" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
        return r.stdout
    return run
