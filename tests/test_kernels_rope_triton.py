"""The in-place RoPE tail kernel (``kernels/rope_triton.py``, CPU): its bits against ``rope.rotate_tail`` in Triton's
interpreter, x and o one buffer (scripts/triton_interpret_rope.py: forward / inverse, the V4.1 shape, a mutant that
must be caught; ~20 s), the launch's shape checks, and the attention front-end's launches with ``ROPE_INPLACE`` on:
the tail kernel on q, the flash kernel, the inverse on o, each aliased in place."""
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")
from dsflash.kernels import rope_triton as rt, sparse_attention_triton as sat, triton_call  # noqa: E402


def test_interpreter_script(interpreter_script):
    out = interpreter_script("triton_interpret_rope.py")
    assert "caught, as it must be" in out and out.count("0 of ") == 4


def test_launch_args_refuse_what_the_kernel_cannot_tile():
    x = jax.ShapeDtypeStruct((1, 2, 64, 512), jnp.bfloat16)
    assert rt.launch_args(x, (jnp.zeros((1, 2, 32)),) * 2, inverse=True) == dict(H=64, D=512, RD=64, INVERSE=1,
                                                                                   ROUND=0)
    with pytest.raises(ValueError, match="H=48"):
        rt.launch_args(jax.ShapeDtypeStruct((1, 2, 48, 512), jnp.bfloat16), (jnp.zeros((1, 2, 32)),) * 2,
                       inverse=False)


def test_front_end_rotates_in_place_around_the_kernel(monkeypatch):
    calls = []

    class Jt:
        def triton_call(self, *args, kernel, out_shape, grid, **kw):
            calls.append((kernel.fn.__name__, kw.get("input_output_aliases"), kw.get("enable_fp_fusion"),
                          kw.get("INVERSE")))
            return jnp.zeros(out_shape.shape, out_shape.dtype)
    monkeypatch.setattr(triton_call, "jax_triton", lambda: Jt())
    monkeypatch.setattr(sat, "ROPE_INPLACE", True)
    R, H, D = 256, 64, 512
    args = [jax.ShapeDtypeStruct(s, d) for s, d in (((1, R, H, D), jnp.bfloat16), ((1, 700, D), jnp.bfloat16),
                                                     ((1, R, 640), jnp.int32), ((H,), jnp.float32),
                                                     ((1, R, 32), jnp.float32), ((1, R, 32), jnp.float32))]
    jax.eval_shape(lambda q, kv, i, s, c, n: sat.sparse_sink_attention_triton(q, kv, i, s, D ** -0.5, rope=(c, n),
                                                                              rope_in_kernel=False), *args)
    assert calls == [("_rope_tail_inplace_kernel", {0: 0}, False, 0), ("_flash_kernel", None, None, None),
                     ("_rope_tail_inplace_kernel", {0: 0}, False, 1)]


def test_sm90_compile_rounds_every_product_and_sum():
    """As launched (enable_fp_fusion=False): no FFMA, so x0 c - x1 s rounds each product as jnp does; no spills."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import sm90_compile
    sig = dict(x_ptr="*bf16", c_ptr="*fp32", s_ptr="*fp32", o_ptr="*bf16")
    r = sm90_compile.compile_kernel(rt._rope_tail_inplace_kernel, sig, dict(H=64, D=512, RD=64, INVERSE=0, ROUND=0),
                                    num_warps=4, num_stages=1, enable_fp_fusion=False)
    assert r.ops["FFMA"] == 0 and r.ops["FMUL"] > 0 and r.spill_stores == 0, (r.ops.most_common(8), r.spill_stores)
