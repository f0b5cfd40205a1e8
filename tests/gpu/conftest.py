"""GPU tests: skipped unless jax sees a CUDA GPU and jax-triton imports.

The root conftest defaults JAX_PLATFORMS to cpu, so on the GPU machine run
``JAX_PLATFORMS=cuda python -m pytest tests/gpu``."""
import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason():
    try:
        import jax
        if not any(d.platform == "gpu" for d in jax.devices()):
            return "no CUDA GPU visible to jax (set JAX_PLATFORMS=cuda on a GPU machine)"
    except Exception as e:  # noqa: BLE001
        return f"jax has no GPU backend: {e}"
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"jax-triton / triton not importable: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if "tests/gpu/" in str(it.fspath).replace("\\", "/")]
    if not mine:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for it in mine:
        it.add_marker(skip)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Trace-time calls of the Triton entry points (jit caches dropped first, so this test's traces count)."""
    from dsflash.kernels import (fp8_linear_triton, indexer_topk_triton, mhc_fused_triton, moe_gemm_triton,
                                 sparse_attention_triton)
    calls = {"moe": 0, "indexer": 0, "attention": 0, "mhc": 0, "fp8_linear": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(moe_gemm_triton, "routed_moe_triton", counting("moe", moe_gemm_triton.routed_moe_triton))
    monkeypatch.setattr(indexer_topk_triton, "indexer_scores_triton",
                        counting("indexer", indexer_topk_triton.indexer_scores_triton))
    monkeypatch.setattr(sparse_attention_triton, "sparse_sink_attention_triton",
                        counting("attention", sparse_attention_triton.sparse_sink_attention_triton))
    monkeypatch.setattr(mhc_fused_triton, "mhc_fused_triton", counting("mhc", mhc_fused_triton.mhc_fused_triton))
    monkeypatch.setattr(fp8_linear_triton, "fp8_linear_triton",
                        counting("fp8_linear", fp8_linear_triton.fp8_linear_triton))
    import jax
    jax.clear_caches()
    return calls
