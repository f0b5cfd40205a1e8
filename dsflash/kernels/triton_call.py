"""The kernels' one way to jax-triton: ``jt = triton_call.jax_triton()`` instead of ``import jax_triton as jt``.

While ``USE_FFI`` is on, it makes every jax-triton launch lower to jaxlib's FFI target ``triton_kernel_call_ffi``
instead of the legacy ``triton_kernel_call``. It is the same compiled kernel and the same launch; only the custom
call's form differs.

Why: XLA records a custom call into its command buffers (CUDA graphs) only if the handler declares itself
command-buffer compatible. The legacy target does not, so every Triton launch split the step's graphs and was
launched from the host on its own.

jax-triton 0.4 lowers to the FFI target itself, but it needs triton >= 3.7. The GPU image has triton 3.6 with
jax-triton 0.3.1, whose lowering we keep: it compiles the kernel and builds the call's proto. We change only the last
step, so the proto becomes the FFI call's ``opaque`` attribute (the form jax-triton 0.4 and Pallas use).

``USE_FFI`` (read at lowering time) chooses the form, so one process can run an A/B. It is **off by default until it
has been measured on a GPU**: written in session 14 (2026-12-05), when no GPU could be started after the change. The
form is the one jax-triton 0.4 and Pallas (jax 0.11) emit, and ``tests/gpu/test_triton_call.py`` checks it against the
legacy form. The queued measurement is `bash scripts/gpu_queue.sh ffi`; switch the default on after it. jaxlib <=
0.10.2 has no FFI target, so the legacy form always stays there.
"""
from __future__ import annotations

import types

FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
USE_FFI = False     # see the module docstring: on once measured

_installed = False


def ffi_target_available() -> bool:
    """jaxlib registers ``triton_kernel_call_ffi`` from 0.10.3 on (the version Pallas switches at); jax and jaxlib are
    released together, so jax's version stands for it."""
    import jax
    ver = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
    return ver > (0, 10, 2)


def ffi_lowering_shim(ffi_lowering):
    """A stand-in for ``jax.ffi.ffi_lowering`` as jax-triton 0.3.1 calls it (legacy ``api_version=2``, the proto as
    ``backend_config``): for the FFI target it returns the typed-FFI rule with the proto as ``opaque``. Any
    other target is passed through unchanged."""
    def shim(name, **kw):
        if name != FFI_TARGET:
            return ffi_lowering(name, **kw)
        kw.pop("api_version", None)
        opaque = kw.pop("backend_config")
        rule = ffi_lowering(FFI_TARGET, api_version=4, **kw)
        return lambda ctx, *args: rule(ctx, *args, opaque=opaque)
    return shim


def _install(jt) -> None:
    global _installed
    triton_lib = getattr(jt, "triton_lib", None)
    if _installed or not USE_FFI or not hasattr(triton_lib, "triton_kernel_call_p"):
        return      # done; the legacy form wanted (jax-triton untouched); or a stand-in (interpreter, sm_90 scripts)
    _installed = True
    if not ffi_target_available():
        return
    import functools

    import jax
    from jax.interpreters import mlir

    # jax-triton's module sees a jax whose ffi.ffi_lowering is the shim; every other name is the real one.
    ffi = types.SimpleNamespace(**{k: getattr(jax.ffi, k) for k in dir(jax.ffi) if not k.startswith("__")})
    ffi.ffi_lowering = ffi_lowering_shim(jax.ffi.ffi_lowering)
    proxy = types.ModuleType("jax")
    proxy.__getattr__ = lambda name: getattr(jax, name)      # module __getattr__: names not set on the proxy
    proxy.ffi = ffi
    triton_lib.jax = proxy

    legacy = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)

    def lowering(ctx, *args, custom_call_target_name, **params):
        if USE_FFI and custom_call_target_name == LEGACY_TARGET:
            custom_call_target_name = FFI_TARGET
        return legacy(ctx, *args, custom_call_target_name=custom_call_target_name, **params)

    mlir.register_lowering(triton_lib.triton_kernel_call_p, lowering, platform="cuda")


def jax_triton():
    """``jax_triton``; while ``USE_FFI`` is on, its launches lowered to the FFI target from then on (the lowering is
    installed once per process and reads ``USE_FFI`` at each lowering)."""
    import jax_triton as jt
    _install(jt)
    return jt
