"""CPU check of the paged sparse-attention kernel (``sparse_attention_paged_triton``) in Triton's interpreter.

Each check builds a real NVFP4 pool (``state.encode_main_kv`` of random rows, some tiny enough for subnormal E4M3
scales), window rows, window ids (30 % empty, a count that is not a multiple of BK), picks (some not valid) and a
query row with nothing valid, then runs the kernel through its real launcher (a jax_triton stand-in, outputs
NaN-poisoned) and compares:

* **bits** with the v3 flash kernel of ``sparse_attention_triton`` on the materialised buffer (window rows ++ the
  picks decoded by ``state.decode_main_kv``) with the same padded ids: the same blocks, dots and rounding, so equal
  bit for bit (the pool decoding is exact);
* **band** with ``sparse_sink_attention_paged_reference`` (the model's path) under the flash error band.

``mutant.*`` checks feed the kernel a pool with its nibbles swapped or its scale bytes bumped, and PASS only when
the bits check fails (the check is not vacuous). Each check in its own process (``interpret_isolation``).
Usage: python scripts/triton_interpret_sparse_attention_paged.py [--list | --check NAME]"""
import dataclasses
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import interpret_isolation  # noqa: E402
from triton_interpret_sparse_attention import _JtShim  # noqa: E402
from dsflash.kernels import sparse_attention as sa, sparse_attention_triton as sat  # noqa: E402
from dsflash.kernels import sparse_attention_paged_triton as spt  # noqa: E402
from dsflash.model import state as st  # noqa: E402


def _inputs(B, S, H, D, NW, KW, K, P, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = (jax.random.normal(ks[0], (B, S, H, D), jnp.float32) * 2).astype(jnp.bfloat16)
    win = jax.random.normal(ks[1], (B, NW, D), jnp.float32).astype(jnp.bfloat16)
    rows = jax.random.normal(ks[2], (P, D), jnp.float32)
    tiny = jax.random.uniform(ks[3], (P, 1)) < 0.25                  # E4M3 subnormal scales (amax < 6 * 2^-6)
    rows = jnp.where(tiny, rows * 1e-3, rows * 2.0)
    pool = st.encode_main_kv(rows, "reference")
    win_idx = jax.random.randint(ks[4], (B, S, KW), 0, NW, jnp.int32)
    win_idx = jnp.where(jax.random.uniform(ks[5], (B, S, KW)) < 0.3, -1, win_idx)
    addr = jax.random.randint(ks[6], (B, S, K), 0, P, jnp.int32)
    valid = jax.random.uniform(ks[7], (B, S, K)) >= 0.3
    if B * S > 1:                                                    # a row with nothing valid
        win_idx = win_idx.at[B - 1, S - 1].set(-1)
        valid = valid.at[B - 1, S - 1].set(False)
    sink = jax.random.normal(jax.random.PRNGKey(seed + 100), (H,), jnp.float32)
    return q, win, win_idx, pool, addr, valid, sink, D ** -0.5


def run(cfg, B=2, S=3, H=16, D=64, NW=20, KW=12, K=24, P=100, seed=0, mutate=None, label=""):
    sys.modules["jax_triton"] = _JtShim
    q, win, win_idx, pool, addr, valid, sink, scale = _inputs(B, S, H, D, NW, KW, K, P, seed)
    kpool = dict(pool)
    if mutate == "nibbles":
        kpool["q"] = (pool["q"] >> 4) | (pool["q"] << 4)
    elif mutate == "scales":
        kpool["s"] = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(pool["s"], jnp.uint8) + 1,
                                                  pool["s"].dtype)
    with np.errstate(over="ignore"):
        out = np.asarray(spt.sparse_sink_attention_paged_triton(
            q.astype(jnp.float32), win, win_idx, kpool["q"], kpool["s"], addr, valid, sink, scale,
            out_dtype=jnp.float32, config=cfg))
        # the flash kernel's inputs for the same blocks: the padded window ids, the buffer in fp32 (IEEE dots)
        kv, idx = sa.paged_buffer(win.astype(jnp.float32), spt.pad_window_ids(win_idx, cfg.BK), pool, addr, valid,
                                  st.decode_main_kv)
        flash = np.asarray(sat.sparse_sink_attention_triton(q.astype(jnp.float32), kv, idx, sink, scale,
                                                            out_dtype=jnp.float32, config=cfg))
    ref = np.asarray(sa.sparse_sink_attention_paged_reference(
        q, win, win_idx, pool, addr, valid, sink, scale, decode=st.decode_main_kv, out_dtype=jnp.float32,
        backend="xla"))
    A = np.asarray(sat.flash_weights_abs(q, kv, idx, sink, scale))
    band = (np.abs(out - ref) / sat.flash_bound(A, ref, 2)).max()
    same = bool(np.array_equal(out, flash))
    empty = np.abs(out[B - 1, S - 1]).max() if B * S > 1 else 0.0
    hs = sat.flash_heads(cfg, H)
    ns, bps = sat.flash_plan(cfg, B * S, spt.pad_window_ids(win_idx, cfg.BK).shape[-1] + K, hs)
    msg = (f"{label:>14} BK{cfg.BK} NS{ns} BPS{bps} HS{hs} | B{B} S{S} H{H} D{D} NW{NW} KW{KW} K{K} "
           f"{'mutant ' + mutate if mutate else ''}: bits == flash {same}, max |err| / band vs ref {band:.3f}, "
           f"empty row max {empty:.1e}")
    ok = bool(np.all(np.isfinite(out)) and same and band <= 1.0 and empty == 0.0)
    return ok, msg


def small(name, **kw):
    return dataclasses.replace(sat.NAMED_CONFIGS[name], **kw)


def checks():
    out = {}

    def check(cfg_fn, label, kw, expect_ok=True):
        return interpret_isolation.expect(run, cfg_fn, label, kw, expect_ok)
    cases = [dict(), dict(seed=1, KW=16), dict(seed=2, B=1, S=2, K=40, NW=40, KW=33)]
    for label, cfg_fn in [("ns_auto", lambda: small("flash_bk64", BK=16)),
                          ("ns1", lambda: small("flash_bk64_ns1", BK=16)),
                          ("ns3", lambda: small("flash_bk32", BK=16, NS=3)),
                          ("hs4", lambda: small("flash_bk64_hs4", BK=16, NS=2))]:
        for j, c in enumerate(cases):
            c = dict(c, H=64) if label == "hs4" else c
            out[f"{label}.{j}"] = check(cfg_fn, label, c)
    # the V4.1 head count and width at one decode row: 128 window ids, 512 picks
    out["prod.flash_bk32"] = check(lambda: sat.NAMED_CONFIGS["flash_bk32"], "prod_bk32",
                                   dict(B=1, S=1, H=64, D=512, NW=134, KW=128, K=512, P=600, seed=5))
    out["mutant.nibbles"] = check(lambda: small("flash_bk64", BK=16), "ns_auto", dict(seed=3, mutate="nibbles"),
                                  expect_ok=False)
    out["mutant.scales"] = check(lambda: small("flash_bk64", BK=16), "ns_auto", dict(seed=4, mutate="scales"),
                                 expect_ok=False)
    return out


if __name__ == "__main__":
    interpret_isolation.main(__file__, checks())
