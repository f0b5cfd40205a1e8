"""The kernels' one way to jax-triton: ``jt = triton_call.jax_triton()`` instead of ``import jax_triton as jt``.

Every launch through it gets the kernel's defaults for the constexprs it leaves out (``with_constexpr_defaults``:
jax-triton 0.3.1 would send None).

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


def with_constexpr_defaults(kernel, kw: dict) -> dict:
    """A launch's keyword arguments with every constexpr it leaves out set to the kernel's default.

    jax-triton 0.3.1 compiles with the launch's keywords as the only constants, so a constexpr left out reaches the
    kernel as None, not as its default (session 21's one-split flash launch: ``if RD > 0`` failed to compile on the
    GPU only -- Triton's interpreter applies defaults). A constexpr with no default that the launch leaves out is a
    ``TypeError`` here, naming it, instead of a compile error deep inside the lowering."""
    params = getattr(kernel, "params", None)
    if params is None:                  # not a triton JITFunction (a test stand-in): nothing to complete
        return kw
    out = dict(kw)
    missing = []
    for p in params:
        if p.is_constexpr and p.name not in out:
            if p.has_default:
                out[p.name] = p.default
            else:
                missing.append(p.name)
    if missing:
        name = getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
        raise TypeError(f"Triton kernel {name} launched without its constexpr argument(s) {missing}")
    return out


class _Launcher:
    """jax-triton as the kernels use it: ``triton_call`` with the constexpr defaults completed
    (``with_constexpr_defaults``); every other name is jax-triton's own."""

    def __init__(self, jt):
        self._jt = jt

    def __getattr__(self, name):
        return getattr(self._jt, name)

    def triton_call(self, *args, kernel, **kw):
        return self._jt.triton_call(*args, kernel=kernel, **with_constexpr_defaults(kernel, kw))


def jax_triton():
    """``jax_triton`` whose ``triton_call`` fills in the constexpr defaults a launch leaves out and launches Gluon
    kernels too (``gluon_launch``); while ``USE_FFI``
    is on, its launches lowered to the FFI target from then on (the lowering is installed once per process and reads
    ``USE_FFI`` at each lowering)."""
    import jax_triton as jt

    from dsflash.kernels import gluon_launch
    _install(jt)
    gluon_launch.install(jt)        # Gluon kernels compiled as TTGIR; every other kernel as before
    return _Launcher(jt)
