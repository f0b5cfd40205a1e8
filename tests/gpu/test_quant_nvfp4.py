"""NVFP4 main-KV quantiser on the GPU (issue 18): the quotients ``amax / 6`` and ``x / s`` must come out exactly as
IEEE fp32 division rounds them under XLA's CUDA pipeline too. Runs the CPU tests of tests/test_model_numerics.py
(jitted, against numpy's division) on the default device, and checks that the compiled CUDA program of the
quantiser has no division left to be rewritten. Also prints, for the record, whether XLA on CUDA turns a plain
``g / broadcast(s)`` into a product with a reciprocal (what it does on CPU; not asserted)."""
import importlib.util
import os

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dsflash import quant  # noqa: E402

pytestmark = pytest.mark.gpu


def _cpu_tests():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test_model_numerics.py")
    spec = importlib.util.spec_from_file_location("_numerics_cpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["test_nvfp4_e2m1_tie_with_non_pow2_scale_under_jit",
                                  "test_nvfp4_quotient_next_to_every_e2m1_midpoint_every_scale",
                                  "test_nvfp4_scale_next_to_every_e4m3_midpoint",
                                  "test_nvfp4_and_mxfp4_roundtrips_match_numpy"])
def test_nvfp4_cpu_checks_on_the_gpu(name):
    assert jax.default_backend() == "gpu"
    getattr(_cpu_tests(), name)()


def test_compiled_quantiser_has_no_division():
    hlo = jax.jit(quant.nvfp4_quant).lower(jnp.ones((4, 512), jnp.float32)).compile().as_text()
    assert " divide(" not in hlo, [ln for ln in hlo.splitlines() if " divide(" in ln][:4]


def test_report_plain_division_rewrite():
    f = jax.jit(lambda g, s: g / s[..., None])
    hlo = f.lower(jnp.ones((4, 16)), jnp.ones((4,))).compile().as_text()
    g = jnp.zeros((1, 16)).at[0, 0].set(1.171875)
    v = float(f(g, jnp.array([0.46875]))[0, 0])
    print(f"XLA CUDA, g / broadcast(s): 1.171875 / 0.46875 = {v!r} (exact 2.5); the compiled HLO has a multiply "
          f"(the reciprocal rewrite, as on CPU): {' multiply(' in hlo}")
