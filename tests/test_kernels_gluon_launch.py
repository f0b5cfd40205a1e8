"""The Gluon launch path on the CPU host (``dsflash.kernels.gluon_launch``): jax-triton's kernel compile, wrapped,
hands a Gluon kernel to ``triton.compile`` as TTGIR for sm_90 (triton's bundled ptxas, no GPU) and builds the launch
record from the compile result; any other kernel still goes to jax-triton's own compile. jaxlib's ``TritonKernel``
exists only with the CUDA plugin, so a recorder stands in for it here; the GPU launch is
``tests/gpu/test_gluon_launch.py``. Skipped where triton (with Gluon) is not installed."""
import types

import pytest

pytest.importorskip("triton.experimental.gluon")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402

from dsflash.kernels import gluon_launch  # noqa: E402
from dsflash.kernels.experimental import gluon_probe as gp  # noqa: E402


class _Recorder:
    """Stands in for jaxlib's ``triton_kernel_call_lib``: records the ``TritonKernel`` arguments."""
    def __init__(self):
        self.kernels = []

    def TritonKernel(self, *args):     # noqa: N802 - jaxlib's name
        self.kernels.append(args)
        return ("kernel", len(self.kernels))

    @staticmethod
    def get_compute_capability(device):
        return 90


def _wrapped():
    calls = []

    def original(*args, **kw):
        calls.append(args[2])
        return "jax-triton's own", {}

    lib = _Recorder()
    return gluon_launch._wrap(original, lib), lib, calls


def _backend(device, cc):
    return CUDABackend(GPUTarget("cuda", cc, 32))


KW = dict(num_warps=4, num_stages=3, num_ctas=1, compute_capability=90, enable_fp_fusion=True, dump=False)


def test_a_gluon_kernel_compiles_as_ttgir_and_becomes_a_launch_record():
    get, lib, calls = _wrapped()
    dtypes = ["*bf16", "*bf16", "i32", "i32", "i32", "*fp32"]      # jax-triton's order: inputs, then the output
    scalars = [(2, "i32", 256), (3, "i32", 192), (4, "i32", 512)]
    kernel, attrs = get(_backend, "cuda", gp.wgmma_gemm_kernel, dtypes, scalars,
                        metaparams=dict(BM=64, BN=64, BK=64), **KW)
    assert calls == [] and kernel == ("kernel", 1)
    name, warps, ctas, shared, ptx, ttgir, cc = lib.kernels[0]
    assert (name, warps, ctas, cc) == ("wgmma_gemm_kernel", 4, 1, 90)
    assert shared == 2 * 64 * 64 * 2            # the two bf16 operand tiles in shared memory
    assert "wgmma.mma_async" in ptx and ".target sm_90a" in ptx
    assert "ttg.num-warps" in ttgir
    # the arrays are specialised as 16-byte divisible (jax-triton's launch reads this back), the scalars are not
    assert all(["tt.divisibility", 16] in attrs[(i,)] for i in (0, 1, 5))
    assert all(["tt.divisibility", 16] not in attrs[(i,)] for i in (2, 3, 4))
    # a second launch with the same signature reuses the compile
    again, _ = get(_backend, "cuda", gp.wgmma_gemm_kernel, dtypes, scalars, metaparams=dict(BM=64, BN=64, BK=64),
                   **KW)
    assert again is kernel and len(lib.kernels) == 1


def test_other_kernels_go_to_jax_tritons_own_compile():
    import triton
    import triton.language as tl

    @triton.jit
    def _plain(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), 0.0)

    get, lib, calls = _wrapped()
    out = get(_backend, "cuda", _plain, ["*fp32"], [], metaparams=dict(BLOCK=64), **KW)
    assert out == ("jax-triton's own", {}) and calls == [_plain] and lib.kernels == []
    assert gluon_launch.is_gluon(gp.axpb_kernel) and not gluon_launch.is_gluon(_plain)


def test_a_kernel_that_needs_global_scratch_is_refused(monkeypatch):
    import triton
    real = triton.compile

    def with_scratch(*a, **kw):
        out = real(*a, **kw)
        md = out.metadata._replace(global_scratch_size=128) if hasattr(out.metadata, "_replace") else None
        return types.SimpleNamespace(metadata=md, asm=out.asm)

    monkeypatch.setattr(triton, "compile", with_scratch)
    with pytest.raises(ValueError, match="global scratch"):
        gluon_launch.compile_gluon(gp.axpb_kernel, {"x_ptr": "*fp32", "o_ptr": "*fp32", "a": "fp32",
                                                    "BLOCK": "constexpr"}, {"BLOCK": 1024})


def test_install_wraps_once_and_leaves_stand_ins_alone(monkeypatch):
    monkeypatch.setattr(gluon_launch, "_installed", False)
    gluon_launch.install(types.SimpleNamespace())          # no triton_lib (the interpreter's stand-in): untouched
    assert gluon_launch._installed is False

    def original(*a, **kw):
        return None

    lib = types.SimpleNamespace(get_or_create_triton_kernel=original, triton_kernel_call_lib=_Recorder())
    gluon_launch.install(types.SimpleNamespace(triton_lib=lib))
    wrapped = lib.get_or_create_triton_kernel
    assert wrapped is not original and wrapped.gluon_wrapped
    gluon_launch.install(types.SimpleNamespace(triton_lib=lib))
    assert lib.get_or_create_triton_kernel is wrapped


def test_compile_finds_a_cache_dir_where_triton_has_none(monkeypatch, tmp_path):
    """The GPU machines' triton has no cache dir (``knobs.cache.dir`` None): ``triton.compile`` raised "Could not
    create or locate cache dir" there (session 25's first Gluon GPU run)."""
    import triton
    monkeypatch.setattr(triton.knobs.cache, "dir", None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    k = gluon_launch.compile_gluon(gp.axpb_kernel, {"x_ptr": "*fp32", "o_ptr": "*fp32", "a": "fp32",
                                                    "BLOCK": "constexpr"}, {"BLOCK": 1024})
    assert k.metadata.name == "axpb_kernel"
    assert triton.knobs.cache.dir == str(tmp_path / "dsflash_triton_cache")
