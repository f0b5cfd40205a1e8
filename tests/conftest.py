"""Test-wide setup. Eight faked CPU devices so sharding tests can build dep=8 meshes; everything else
runs on device 0. Must run before jax is imported anywhere."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent XLA compilation cache in tests: on 2026-11-30 two full runs on the 2-core CPU segfaulted inside
# jax's cache read (compilation_cache.get_executable_and_time) while an engine warmed up in
# test_train_loop.py, the second time with a fresh cache directory; the files alone pass. Cause not found.
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
