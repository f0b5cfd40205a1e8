"""Test-wide setup. Eight faked CPU devices so sharding tests can build dep=8 meshes; everything else
runs on device 0. Must run before jax is imported anywhere."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
