"""jax-triton launches lowered to jaxlib's FFI target (``dsflash.kernels.triton_call``) on the GPU: the same result as
the legacy lowering, and XLA records the launches into its command buffers (the legacy target splits them)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dsflash.bench.step_profile import command_buffer_census  # noqa: E402
from dsflash.kernels import triton_call  # noqa: E402

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _axpb_kernel(x_ptr, o_ptr, a, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, tl.load(x_ptr + i) * a + 1.0)


def _chain(x, n=6):
    """n launches with XLA fusions between them (a command buffer needs >= 5 commands in a row by default)."""
    jt = triton_call.jax_triton()
    for k in range(n):
        x = jt.triton_call(x, kernel=_axpb_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                           grid=(x.size // 256,), a=0.5 + k, BLOCK=256)
        x = jnp.sin(x) * 0.5
    return x


def _run(x):
    f = jax.jit(lambda v: _chain(v))           # a new function each time: no lowering shared across the A/B
    lowered = f.lower(x)
    compiled = lowered.compile()
    return np.asarray(compiled(x)), lowered.as_text(), compiled.as_text()


def test_ffi_lowering_matches_the_legacy_one_and_is_recorded_into_command_buffers(monkeypatch):
    assert triton_call.ffi_target_available(), "this jaxlib has no triton_kernel_call_ffi"
    x = jnp.linspace(-3.0, 3.0, 4096, dtype=jnp.float32)
    monkeypatch.setattr(triton_call, "USE_FFI", True)
    out_ffi, low_ffi, hlo_ffi = _run(x)
    monkeypatch.setattr(triton_call, "USE_FFI", False)
    out_old, low_old, hlo_old = _run(x)
    assert "triton_kernel_call_ffi" in low_ffi and "triton_kernel_call_ffi" not in low_old
    np.testing.assert_array_equal(out_ffi, out_old)              # the same kernel, launched the same way
    census_ffi, census_old = command_buffer_census(hlo_ffi), command_buffer_census(hlo_old)
    print("census ffi", census_ffi, "legacy", census_old)
    assert census_ffi["triton_in"] == 6 and census_ffi["triton_out"] == 0, census_ffi
    assert census_old["triton_out"] == 6, census_old                # why the change: the legacy calls stay out
