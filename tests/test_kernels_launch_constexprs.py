"""Every Triton launch names all of its kernel's constexpr parameters, defaults included (CPU, no GPU).

jax-triton 0.3.1 sends a constexpr the launch leaves out as None, not as the kernel's default: ``if RD > 0`` then
fails to compile. Session 21's RoPE refactor left ``RD`` / ``ROUND_O`` out of the one-split flash launch when RoPE
runs around the kernel, and the GPU prefill path did not compile until session 22's H200 call found it. Triton's
interpreter (the CPU checks) applies the defaults, so only a check of the launch arguments catches this on CPU."""
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")
from dsflash.kernels import triton_call  # noqa: E402


class _CheckingJt:
    """A jax-triton stand-in that refuses a launch without every constexpr of its kernel, then returns zeros."""

    def __init__(self):
        self.kernels = []

    def triton_call(self, *args, kernel, out_shape, grid, num_warps, num_stages, **kw):
        name = kernel.fn.__name__
        missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in kw]
        assert not missing, f"{name} launched without constexpr(s) {missing} (jax-triton would send None)"
        self.kernels.append(name)
        shapes = out_shape if isinstance(out_shape, (tuple, list)) else (out_shape,)
        outs = tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
        return outs if isinstance(out_shape, (tuple, list)) else outs[0]


@pytest.fixture
def jt(monkeypatch):
    j = _CheckingJt()
    monkeypatch.setattr(triton_call, "jax_triton", lambda: j)
    return j


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("rope,in_kernel", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows", [1, 256])          # split launch (decode) / one-split (prefill)
def test_sparse_attention_launches(jt, rope, in_kernel, rows):
    from dsflash.kernels import sparse_attention_triton as sat
    H, D, N, K = 64, 512, 700, 640
    args = [_sds((1, rows, H, D), jnp.bfloat16), _sds((1, N, D), jnp.bfloat16), _sds((1, rows, K), jnp.int32),
            _sds((H,), jnp.float32)]
    if rope:
        args += [_sds((1, rows, 32), jnp.float32), _sds((1, rows, 32), jnp.float32)]

    def f(q, kv, idx, sink, *cs):
        return sat.sparse_sink_attention_triton(q, kv, idx, sink, D ** -0.5, rope=tuple(cs) or None,
                                                rope_in_kernel=in_kernel)
    jax.eval_shape(f, *args)
    assert jt.kernels


@pytest.mark.parametrize("S", [6, 4096])
@pytest.mark.parametrize("hw_round", [None, False, 2])
def test_indexer_scorer_launches(jt, S, hw_round):
    from dsflash.kernels import indexer_topk_triton as it
    jax.eval_shape(lambda q, w, k, v, m: it.indexer_scores_triton(q, w, k, v, m, hw_round=hw_round),
                   _sds((1, S, 32, 128), jnp.bfloat16), _sds((1, S, 32), jnp.bfloat16), _sds((1, 4096, 128), jnp.bfloat16),
                   _sds((1, S), jnp.int32), _sds((1, S), bool))
    assert jt.kernels


@pytest.mark.parametrize("masked", [False, True])
def test_topk_launches(jt, masked):
    from dsflash.kernels import topk_triton as tt
    jax.eval_shape(lambda s, v: tt.select_topk_triton(s, v, 512, key_bits=16, masked=masked),
                   _sds((2, 3, 8192), jnp.float32), _sds((2, 3), jnp.int32))
    jax.eval_shape(lambda s: tt.topk_mask_triton(s, 512), _sds((2, 3, 8192), jnp.float32))
    assert jt.kernels == ["_topk_kernel", "_topk_kernel"]
