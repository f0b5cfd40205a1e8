"""Gluon kernels launched through jax-triton 0.3.1 (``triton_call.jax_triton().triton_call(..., kernel=gluon_fn)``).

Why: warpgroup roles (one warpgroup's softmax overlapping the other's MMA, FlashMLA's split) need Triton 3.6's Gluon
(``triton.experimental.gluon``: explicit layouts, ``warpgroup_mma``, ``mbarrier``, ``warp_specialize``). jax-triton
0.3.1 compiles every kernel as ``ast_to_ttir`` on a ``tc.ASTSource`` followed by Triton's TTIR -> TTGIR passes; a
Gluon kernel is already TTGIR (``GluonASTSource``) and must skip those passes.

What changes: jax-triton's ``get_or_create_triton_kernel`` is wrapped once per process (``install``). For a Gluon
``JITFunction`` it compiles with ``triton.compile(GluonASTSource(...))`` for the device's target and builds jaxlib's
``TritonKernel`` from the result; every other kernel goes to jax-triton's own function unchanged. The rest of the
launch -- the argument specialisation (16-byte divisibility on every array), the call proto, the custom call -- is
jax-triton's.

Two differences from an ordinary Triton kernel, both read from the compile result: the warp count is the compiled
total (``warp_specialize`` adds worker warps to the launch's ``num_warps``), and a kernel that needs global scratch
memory (device-side TMA descriptors) is refused, because jaxlib passes a null scratch pointer.
"""
from __future__ import annotations

import types

_installed = False


def is_gluon(fn) -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:         # a triton without Gluon: nothing is a Gluon kernel
        return False
    return isinstance(fn, GluonJITFunction)


def _signature_and_attrs(fn, backend, arg_dtypes, scalar_args, metaparams):
    """The signature, specialisation attributes and constants jax-triton 0.3.1 compiles a launch with (the same rule
    as its ``get_or_create_triton_kernel``: every array 16-byte aligned, scalars unspecialised but for None / 1)."""
    import triton._C.libtriton as _triton
    signature = {fn.arg_names[i]: v for i, v in enumerate(arg_dtypes)}
    alignments = [16] * len(arg_dtypes)
    for i, _, _ in scalar_args:
        alignments[i] = 0
    specialization = [
        _triton.native_specialize_impl(
            backend, types.SimpleNamespace(data_ptr=lambda a=a: a, dtype=d.removeprefix("*")), False, True, a > 0)
        for d, a in zip(arg_dtypes, alignments)]
    attrs = {(i,): backend.parse_attr(attr) for i, (_, attr) in enumerate(specialization)}
    constants = dict(metaparams)
    constants.update({k: None for _, k, v in scalar_args if v is None})
    constants.update({fn.arg_names[i]: 1 for i, _, v in scalar_args if v == 1})
    for c in constants:
        signature[c] = "constexpr"
    return signature, attrs, constants


def _ensure_cache_dir() -> None:
    """``triton.compile`` keeps its output in ``triton.knobs.cache.dir`` (``TRITON_CACHE_DIR``, default
    ``~/.triton/cache``) and raises "Could not create or locate cache dir" where that is unset -- as on the GPU
    machines here, where the knob is None even with the variable exported (session 25). jax-triton's own compile does
    not use the cache, so only this path needs it: a writable temporary directory when the knob gives none."""
    import os
    import tempfile

    import triton
    cache = triton.knobs.cache
    d = cache.dir
    if d:
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return
        except OSError:
            pass
    cache.dir = os.path.join(tempfile.gettempdir(), "dsflash_triton_cache")


def compile_gluon(fn, signature, constants, attrs=None, *, num_warps: int = 4, num_ctas: int = 1,
                  compute_capability: int = 90):
    """``triton.compile`` of a Gluon kernel for ``sm_<compute_capability>``; returns Triton's compiled kernel
    (``.asm["ptx"]``, ``.metadata``). Raises ``ValueError`` if it needs global scratch memory (jaxlib passes none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    _ensure_cache_dir()
    src = GluonASTSource(fn, signature, constants, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", compute_capability, 32),
                              options={"num_warps": num_warps, "num_ctas": num_ctas})
    if (compiled.metadata.global_scratch_size or 0) > 0:
        raise ValueError(f"Gluon kernel {compiled.metadata.name} needs {compiled.metadata.global_scratch_size} bytes "
                         "of global scratch memory; jax-triton 0.3.1 passes a null scratch pointer")
    return compiled


def _wrap(original, triton_kernel_call_lib):
    cache = {}

    def get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps, num_stages, num_ctas,
                      compute_capability, enable_fp_fusion, metaparams, dump):
        if not is_gluon(fn):
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, num_warps=num_warps,
                            num_stages=num_stages, num_ctas=num_ctas, compute_capability=compute_capability,
                            enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)
        if platform != "cuda":
            raise ValueError(f"Gluon kernels are launched on CUDA only, not {platform}")
        num_warps = 4 if num_warps is None else num_warps
        if compute_capability is None:
            compute_capability = triton_kernel_call_lib.get_compute_capability(0)
        backend = backend_init_func(0, compute_capability)
        signature, attrs, constants = _signature_and_attrs(fn, backend, arg_dtypes, scalar_args, metaparams)
        key = (fn, tuple(signature.items()), tuple(sorted(constants.items())), num_warps, num_ctas,
               compute_capability)
        kernel = cache.get(key)
        if kernel is None:
            compiled = compile_gluon(fn, signature, constants, attrs, num_warps=num_warps, num_ctas=num_ctas,
                                     compute_capability=compute_capability)
            md = compiled.metadata
            kernel = triton_kernel_call_lib.TritonKernel(md.name, md.num_warps, num_ctas, md.shared,
                                                         compiled.asm["ptx"], compiled.asm.get("ttgir", ""),
                                                         compute_capability)
            cache[key] = kernel
        return kernel, attrs

    get_or_create.gluon_wrapped = True
    return get_or_create


def install(jt) -> None:
    """Route jax-triton's kernel compile through ``_wrap`` (once per process; a stand-in module without
    ``triton_lib`` is left alone)."""
    global _installed
    triton_lib = getattr(jt, "triton_lib", None)
    if _installed or not hasattr(triton_lib, "get_or_create_triton_kernel"):
        return
    _installed = True
    if not getattr(triton_lib.get_or_create_triton_kernel, "gluon_wrapped", False):
        triton_lib.get_or_create_triton_kernel = _wrap(triton_lib.get_or_create_triton_kernel,
                                                       triton_lib.triton_kernel_call_lib)
