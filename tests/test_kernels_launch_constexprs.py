"""Every Triton launch names all of its kernel's constexpr parameters, defaults included (CPU, no GPU): sparse
attention (split, one-split with RoPE around / in it / in place around it), paged attention, indexer scorer, radix
top-k, fused mHC and the routed-expert GEMM at decode and prefill sizes (the FP8 linear has its own check in
test_kernels_fp8_linear.py).

jax-triton 0.3.1 sends a constexpr the launch leaves out as None, not as the kernel's default: ``if RD > 0`` then
fails to compile. Session 21's RoPE refactor left ``RD`` / ``ROUND_O`` out of the one-split flash launch when RoPE
runs around the kernel, and the GPU prefill path did not compile until session 22's H200 call found it. Triton's
interpreter (the CPU checks) applies the defaults, so only a check of the launch arguments catches this on CPU.
Since session 23 ``triton_call.jax_triton()`` fills in the defaults itself (tests/test_triton_call_shim.py); this
test keeps every launch site explicit all the same (its stand-in replaces that launcher)."""
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")
from dsflash.kernels import triton_call  # noqa: E402


class _CheckingJt:
    """A jax-triton stand-in that refuses a launch without every constexpr of its kernel, then returns zeros."""

    def __init__(self):
        self.kernels = []

    def triton_call(self, *args, kernel, out_shape, grid, num_warps=None, num_stages=None, **kw):
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


def test_inplace_rope_launches(jt, monkeypatch):
    from dsflash.kernels import sparse_attention_triton as sat
    monkeypatch.setattr(sat, "ROPE_INPLACE", True)
    H, D, N, K, rows = 64, 512, 700, 640, 256
    args = [_sds((1, rows, H, D), jnp.bfloat16), _sds((1, N, D), jnp.bfloat16), _sds((1, rows, K), jnp.int32),
            _sds((H,), jnp.float32), _sds((1, rows, 32), jnp.float32), _sds((1, rows, 32), jnp.float32)]
    jax.eval_shape(lambda q, kv, i, s, c, n: sat.sparse_sink_attention_triton(q, kv, i, s, D ** -0.5, rope=(c, n),
                                                                              rope_in_kernel=False), *args)
    assert jt.kernels == ["_rope_tail_inplace_kernel", "_flash_kernel", "_rope_tail_inplace_kernel"]


@pytest.mark.parametrize("gluon_from,rows,flash", [(None, 512, "_flash_kernel"), (257, 256, "_flash_kernel"),
                                                   (257, 512, "flash_gluon_kernel"),
                                                   ("default", 2048, "_flash_kernel"),
                                                   ("default", 4096, "flash_gluon_kernel"),
                                                   ("no gluon", 4096, "_flash_kernel")])
def test_gluon_flash_kernel_takes_the_rows_it_is_gated_to(jt, monkeypatch, gluon_from, rows, flash):
    """``GLUON_FROM_ROWS`` sends one-split bf16 launches of the picked config from that many rows to the Gluon kernel,
    between the in-place RoPE launches as the Triton kernel is; below it, or off, or without Gluon in the installed
    Triton, the Triton kernel. The default (4,096 since session 26) is where the H100 probe measured it faster. (Its
    first form tested ``config is None``, which the RoPE-around recursion never passes.)"""
    pytest.importorskip("triton.experimental.gluon")
    from dsflash.kernels import sparse_attention_triton as sat
    monkeypatch.setattr(sat, "ROPE_INPLACE", True)
    if gluon_from == "no gluon":
        monkeypatch.setattr(sat, "_gluon_available", lambda: False)
    elif gluon_from != "default":
        monkeypatch.setattr(sat, "GLUON_FROM_ROWS", gluon_from)
    H, D, N, K = 64, 512, 700, 640
    args = [_sds((1, rows, H, D), jnp.bfloat16), _sds((1, N, D), jnp.bfloat16), _sds((1, rows, K), jnp.int32),
            _sds((H,), jnp.float32), _sds((1, rows, 32), jnp.float32), _sds((1, rows, 32), jnp.float32)]
    jax.eval_shape(lambda q, kv, i, s, c, n: sat.sparse_sink_attention_triton(q, kv, i, s, D ** -0.5, rope=(c, n),
                                                                              rope_in_kernel=False), *args)
    assert jt.kernels == ["_rope_tail_inplace_kernel", flash, "_rope_tail_inplace_kernel"]


@pytest.mark.parametrize("S", [6, 4096])
@pytest.mark.parametrize("hw_round", [None, False, 2])
def test_indexer_scorer_launches(jt, S, hw_round):
    from dsflash.kernels import indexer_topk_triton as it
    jax.eval_shape(lambda q, w, k, v, m: it.indexer_scores_triton(q, w, k, v, m, hw_round=hw_round),
                   _sds((1, S, 32, 128), jnp.bfloat16), _sds((1, S, 32), jnp.bfloat16),
                   _sds((1, 4096, 128), jnp.bfloat16),
                   _sds((1, S), jnp.int32), _sds((1, S), bool))
    assert jt.kernels


@pytest.mark.parametrize("masked", [False, True])
def test_topk_launches(jt, masked):
    from dsflash.kernels import topk_triton as tt
    jax.eval_shape(lambda s, v: tt.select_topk_triton(s, v, 512, key_bits=16, masked=masked),
                   _sds((2, 3, 8192), jnp.float32), _sds((2, 3), jnp.int32))
    jax.eval_shape(lambda s: tt.topk_mask_triton(s, 512), _sds((2, 3, 8192), jnp.float32))
    assert jt.kernels == ["_topk_kernel", "_topk_kernel"]


@pytest.mark.parametrize("tokens", [6, 4096])      # the decode plan / the narrow prefill tile (hw_round)
@pytest.mark.parametrize("expand", [False, True])
def test_mhc_launches(jt, tokens, expand):
    from dsflash.config import preset
    from dsflash.kernels import mhc_fused_triton as mft
    cfg = preset("bench-4l-96e")
    n, d = cfg.hc_mult, cfg.hidden_size
    nc = 2 * n + n * n
    args = [_sds((tokens, n, d), jnp.bfloat16), _sds((tokens, n), jnp.float32), _sds((nc, n * d), jnp.float32),
            _sds((nc,), jnp.float32), _sds((3,), jnp.float32)]
    ex = [_sds((tokens, d), jnp.bfloat16), _sds((tokens, n), jnp.float32), _sds((tokens, n, n), jnp.float32)]

    def f(X, a, fn, base, scale, *e):
        return mft.mhc_fused_triton(X, a, fn, base, scale, tuple(e) or None, eps=cfg.hc_eps, rms_eps=cfg.rms_norm_eps,
                                    iters=cfg.hc_sinkhorn_iters, out_dtype=jnp.bfloat16)
    jax.eval_shape(f, *args, *(ex if expand else []))
    assert jt.kernels


def test_paged_attention_launch(jt):
    from dsflash.kernels import sparse_attention_paged_triton as spt
    B, S, H, D, NW, KW, KP, P = 2, 6, 64, 512, 150, 128, 512, 4096
    jax.eval_shape(lambda *a: spt.sparse_sink_attention_paged_triton(*a, D ** -0.5),
                   _sds((B, S, H, D), jnp.bfloat16), _sds((B, NW, D), jnp.bfloat16), _sds((B, S, KW), jnp.int32),
                   _sds((P, D // 2), jnp.uint8), _sds((P, D // 16), jnp.uint8), _sds((B, S, KP), jnp.int32),
                   _sds((B, S, KP), bool), _sds((H,), jnp.float32))
    assert jt.kernels


@pytest.mark.parametrize("T", [32, 4096])          # the il decode band / the wide prefill tile
def test_routed_moe_launches(jt, T):
    from dsflash.kernels import moe_gemm_triton as mgt
    E, d, I, k = 96, 4096, 2048, 6
    jax.eval_shape(lambda *a: mgt.routed_moe_triton(*a, limit=10.0),
                   _sds((T, d), jnp.bfloat16), _sds((T, k), jnp.int32), _sds((T, k), jnp.float32),
                   _sds((E, I, d // 4), jnp.uint16), _sds((E, I, d // 128), jnp.uint32),
                   _sds((E, I, d // 4), jnp.uint16), _sds((E, I, d // 128), jnp.uint32),
                   _sds((E, d, I // 4), jnp.uint16), _sds((E, d, I // 128), jnp.uint32))
    assert jt.kernels
