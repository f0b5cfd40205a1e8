"""CPU check of the Triton sparse sink attention kernel's logic in Triton's interpreter (TRITON_INTERPRET=1).

Runs ``_sparse_sink_attn_kernel`` on numpy buffers at small shapes and compares with
``sparse_sink_attention_reference``. The interpreter's bf16 dot is wrong, so the kernel's IEEE flag (fp32 dots of
the same bf16 values: products are exact, so it is the same math) is set.
Usage: python scripts/triton_interpret_sparse_attention.py   (needs `pip install triton`)"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from triton_interpret_moe import Fake  # noqa: E402
from dsflash.kernels import sparse_attention as sa, sparse_attention_triton as sat  # noqa: E402


def run(B=2, S=3, H=16, D=64, N=50, K=40, precision="reference", dtype=jnp.bfloat16, seed=0, sink_shift=0.0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(dtype)
    kv = jax.random.normal(ks[1], (B, N, D), jnp.float32).astype(dtype)
    idx = jax.random.randint(ks[2], (B, S, K), 0, N, jnp.int32)
    idx = jnp.where(jax.random.uniform(ks[3], (B, S, K)) < 0.3, -1, idx)
    if B * S > 1:
        idx = idx.at[B - 1, S - 1].set(-1)               # a row with no valid entry
    sink = jax.random.normal(ks[4], (H,), jnp.float32) + sink_shift
    scale = D ** -0.5
    ref = sa.sparse_sink_attention_reference(q, kv, idx, sink, scale, out_dtype=jnp.float32, precision=precision)
    prm = sat.launch_params(H, D, K, precision)
    out = np.zeros((B, S, H, D), np.float32)
    sat._sparse_sink_attn_kernel[(B * S, D // prm["DV"])](
        Fake(np.asarray(q)), Fake(np.asarray(kv)), Fake(np.asarray(idx)), Fake(np.asarray(sink)), Fake(out),
        S=S, N=N, H=H, D=D, K=K, SCALE=float(scale), IEEE=1, **prm)
    ref = np.asarray(ref)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"B{B} S{S} H{H} D{D} K{K} {precision} {jnp.dtype(dtype).name}: rel err {rel:.2e}, "
          f"max abs {np.abs(out - ref).max():.2e}, empty row max {np.abs(out[B - 1, S - 1]).max():.1e}")
    return rel


if __name__ == "__main__":
    errs = [run(), run(precision="fp32", dtype=jnp.float32, seed=1), run(K=64, D=128, seed=2, sink_shift=3.0),
            run(B=1, S=1, H=32, D=256, N=700, K=640, seed=3)]
    assert max(errs) < 1e-5, errs
    print("ok")
