"""CPU check of the in-place RoPE tail kernel (``kernels/rope_triton.py``) in Triton's interpreter (TRITON_INTERPRET=1).

The kernel runs with x and o the same buffer (as under the launch's ``input_output_aliases``) on bf16 values held in
fp32 (the interpreter has no bf16 buffers; ROUND = 1 rounds as the bf16 cast does), and is checked bit for bit against
``rope.rotate_tail`` on the bf16 array: forward and inverse, the V4.1 shape (64 heads x 512, a 64-channel tail) and a
small one, the head channels untouched. ``mutant.*`` checks feed a wrong table (sin negated: the other direction) and
PASS only when the bits differ (the check is not vacuous). Each check runs in its own process
(``interpret_isolation``).
Usage: python scripts/triton_interpret_rope.py [--list | --check NAME]   (needs `pip install triton`)"""
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
import interpret_isolation  # noqa: E402
from dsflash.kernels import rope as rp, rope_triton as rt  # noqa: E402


def run(inverse, B, S, H, D, rd, seed, mutate=False):
    """(ok, message): the kernel in place on x against ``rotate_tail`` (``mutate``: the kernel gets -sin)."""
    x = (jax.random.normal(jax.random.PRNGKey(seed), (B, S, H, D), jnp.float32) * 3).astype(jnp.bfloat16)
    pos = jax.random.randint(jax.random.PRNGKey(seed + 1), (B, S), 0, 20000, jnp.int32)
    omega = (10000.0 ** (-2.0 * np.arange(rd // 2) / rd)).astype(np.float32)
    c, s = rp.rope_table(pos, omega)
    want = np.asarray(rp.rotate_tail(x, c[:, :, None], s[:, :, None], inverse=inverse).astype(jnp.float32))
    buf = np.array(x.astype(jnp.float32), copy=True)                  # x and o: one buffer
    sk = -np.asarray(s) if mutate else np.asarray(s)
    kw = rt.launch_args(x, (c, s), inverse=inverse, round_int=1)
    f = Fake(buf)
    rt._rope_tail_inplace_kernel[(B * S,)](f, Fake(np.array(c, copy=True).reshape(B * S, -1)),
                                           Fake(np.array(sk, copy=True).reshape(B * S, -1)), f, **kw)
    diff = int((buf.view(np.uint32) != want.view(np.uint32)).sum())
    head = np.array_equal(buf[..., :-rd].view(np.uint32), np.asarray(x.astype(jnp.float32))[..., :-rd].view(np.uint32))
    return diff == 0 and head, (f"{'inverse' if inverse else 'forward'} B{B} S{S} H{H} D{D} rd{rd}: {diff} of "
                                f"{buf.size} elements differ from rotate_tail, head channels "
                                f"{'untouched' if head else 'CHANGED'}")


def check(inverse, expect_ok=True, **kw):
    def f():
        ok, msg = run(inverse, **kw)
        print(msg + ("" if expect_ok else f"  -> {'passed (BAD: vacuous)' if ok else 'caught, as it must be'}"))
        assert ok == expect_ok, msg
    return f


def checks():
    small = dict(B=2, S=3, H=16, D=128, rd=32, seed=1)
    prod = dict(B=1, S=2, H=64, D=512, rd=64, seed=2)
    return {"small.fwd": check(False, **small), "small.inv": check(True, **small),
            "prod.fwd": check(False, **prod), "prod.inv": check(True, **prod),
            "mutant.sin": check(False, expect_ok=False, mutate=True, **small)}


if __name__ == "__main__":
    interpret_isolation.main(__file__, checks())
    if len(sys.argv) == 1:
        print("all ok")
