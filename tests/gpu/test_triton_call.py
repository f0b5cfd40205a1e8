"""jax-triton launches lowered to jaxlib's FFI target (``dsflash.kernels.triton_call``) on the GPU: the same result as
the legacy lowering, and XLA replays the launches from its command buffers (the legacy target splits them). Which
kernels ran from a graph is read from a profiler trace (``step_profile.graph_census``'s rule): on jax 0.11 XLA forms
command buffers after HLO, so the compiled text shows none (H100, 2026-12-06: 0 in both forms)."""
import tempfile

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dsflash.bench import step_profile  # noqa: E402
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
    """Output, lowered text, and the HLO ops of the ``_axpb_kernel`` launches of one traced call."""
    f = jax.jit(lambda v: _chain(v))           # a new function each time: no lowering shared across the A/B
    lowered = f.lower(x)
    compiled = lowered.compile()
    out = np.asarray(compiled(x))
    log_dir = tempfile.mkdtemp(prefix="dsflash_ffi_")
    with jax.profiler.trace(log_dir):
        jax.block_until_ready(compiled(x))
    kernels, _ = step_profile.gpu_kernels(step_profile._load_trace(log_dir))
    ops = [str(a.get("hlo_op") or "") for name, _, _, a in kernels if "axpb" in name]
    return out, lowered.as_text(), ops


def test_ffi_lowering_matches_the_legacy_one_and_is_replayed_from_command_buffers(monkeypatch):
    assert triton_call.ffi_target_available(), "this jaxlib has no triton_kernel_call_ffi"
    x = jnp.linspace(-3.0, 3.0, 4096, dtype=jnp.float32)
    monkeypatch.setattr(triton_call, "USE_FFI", True)
    out_ffi, low_ffi, ops_ffi = _run(x)
    monkeypatch.setattr(triton_call, "USE_FFI", False)
    out_old, low_old, ops_old = _run(x)
    assert "triton_kernel_call_ffi" in low_ffi and "triton_kernel_call_ffi" not in low_old
    np.testing.assert_array_equal(out_ffi, out_old)              # the same kernel, launched the same way
    print("axpb launches: ffi", ops_ffi, "legacy", ops_old)
    assert len(ops_ffi) == 6 and all(o.startswith("command_buffer") for o in ops_ffi), ops_ffi
    assert len(ops_old) == 6 and not any(o.startswith("command_buffer") for o in ops_old), ops_old
