"""CPU check of the Triton MoE kernels' logic in Triton's interpreter (TRITON_INTERPRET=1), no GPU needed.

Runs the two @triton.jit kernels on numpy buffers (through a minimal tensor shim) at a tiny shape and compares
with ``routed_moe_reference``. The inline-PTX nibble decoder cannot run here, so DECODE="tl" is used.
Usage: python scripts/triton_interpret_moe.py   (needs `pip install triton`)"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dsflash.kernels import moe_gemm, moe_gemm_triton as mt  # noqa: E402
from dsflash.model import quant  # noqa: E402


class _Storage:
    def __init__(self, t):
        self.t = t

    def data_ptr(self):
        return self.t.a.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):
        return self


class Fake:
    """Just enough of a torch tensor for triton's interpreter: the memory is the numpy array's own."""

    def __init__(self, a, ptr=None):
        self.a = np.ascontiguousarray(a)
        self.dtype = _Dt(self.a.dtype)
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr if self._ptr is not None else self.a.ctypes.data

    def untyped_storage(self):
        return _Storage(self)

    def storage_offset(self):
        return 0

    def size(self):
        return self.a.shape

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def new_empty(self, *_, **__):
        return Fake(np.zeros(0, self.a.dtype))

    def set_(self, storage, offset, size, stride):
        self._ptr = storage.data_ptr() + offset * storage.t.a.itemsize
        self.a = storage.t.a
        self.dtype = storage.t.dtype
        return self

    def copy_(self, other):
        return self


class _Dt:
    def __init__(self, dt):
        self.name = {"float8_e4m3fn": "float8_e4m3fn"}.get(str(dt), str(dt))
        self.itemsize = dt.itemsize

    def __str__(self):
        return self.name

    __repr__ = __str__


def main(precision="reference", T=5, k=2, E=4, d=256, I=128, BM=16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    x = jax.random.normal(keys[0], (T, d), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(keys[1], (T, k), 0, E, jnp.int32)
    weight = jax.random.uniform(keys[2], (T, k), jnp.float32)
    def wq(key, shape):
        return quant.quantize_mxfp4_weight(jax.random.normal(key, shape, jnp.float32) * 0.05)
    w1, s1 = wq(keys[3], (E, I, d))
    w3, s3 = wq(keys[4], (E, I, d))
    w2, s2 = wq(keys[5], (E, d, I))
    limit = 10.0
    ref = moe_gemm.routed_moe_reference(x, idx, weight, w1, s1, w3, s3, w2, s2, limit=limit, precision=precision)
    act_fp8 = precision == "reference"
    cfg = mt.MoeConfig(BM=BM, BN_UP=64, BN_DOWN=64, KSUB=2, decode="tl")
    S = T * k
    p = {kk: np.asarray(v) for kk, v in mt.prepare(x, idx, weight, E=E, BM=BM, act_fp8=act_fp8).items()}
    TM = mt.num_tiles(S, E, BM)
    u8 = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
    hq = np.zeros((S, I), np.asarray(p["xq"]).dtype)
    hs = np.zeros((S, I // 32), np.float32)
    F = Fake
    fhq, fhs = F(hq), F(hs)
    mt._moe_up_kernel[(TM, I // cfg.BN_UP)](
        F(p["xq"]), F(p["xs"]), F(p["tok"]), F(p["rw"]), F(p["tile_e"]), F(p["tile_s"]), F(p["tile_end"]),
        F(u8(w1)), F(np.asarray(s1)), F(u8(w3)), F(np.asarray(s3)), fhq, fhs,
        D=d, I=I, LIMIT=limit, BM=BM, BN=cfg.BN_UP, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8), DECODE=0)
    o = np.zeros((S, d), jnp.bfloat16)
    fo = F(o)
    mt._moe_down_kernel[(TM, d // cfg.BN_DOWN)](
        fhq, fhs, F(p["order"]), F(p["tile_e"]), F(p["tile_s"]), F(p["tile_end"]),
        F(u8(w2)), F(np.asarray(s2)), fo,
        D=d, I=I, BM=BM, BN=cfg.BN_DOWN, KSUB=cfg.KSUB, ACT_FP8=int(act_fp8), DECODE=0)
    out = fo.a.astype(np.float32).reshape(T, k, d).sum(1)
    ref = np.asarray(ref)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"{precision}: rel err {rel:.3e}, max abs {np.abs(out - ref).max():.3e}, ref norm {np.linalg.norm(ref):.3e}")
    return rel


if __name__ == "__main__":
    r1 = main("reference")
    r2 = main("bf16")
    r3 = main("reference", T=40, k=3, E=3, BM=16, seed=1)
    assert max(r1, r2, r3) < 1e-2
