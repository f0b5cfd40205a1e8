"""Measured hardware ceilings for the rooflines of ``bench forward`` / ``bench engine`` (issue 19, DESIGN §8).

Measured in the same run as the numbers they bound, on large buffers (GB-sized on a GPU, small on CPU, where
the numbers only exercise the code):

* **streaming read**: ``jnp.sum`` of a 1-D bf16 buffer (4 GB on GPU) in fp32, bytes read / time. A 1-D full
  reduction: the earlier column reduction over ``[n/8192, 8192]`` read at 3.48 TB/s on the H200 (2026-12-01)
  where a full sum reads at ~4.5 TB/s;
* **device copy**: an elementwise ``v * 1.5`` over the same buffer, read + write counted;
* **bf16 GEMM**: ``jnp.dot`` of two 8192x8192 bf16 matrices, fp32 accumulation (2 n^3 flops);
* **FP8 GEMM**: the same with float8_e4m3fn operands, ``preferred_element_type=float32`` (an error string when
  the backend cannot run it);
* the torch peers when torch with CUDA is importable: a ``sum`` read, ``dsflash.bench.kernels.measure_ceilings``
  (copy, bf16 ``@``, FP8 ``_scaled_mm``).

Every figure is the median of several timed samples after a warm-up call; a sample is ``inner`` back-to-back
calls ended by one ``block_until_ready`` (divided by ``inner``), so the host's per-call sync latency is not
charged to the device. Data are random normal (not zeros). ``rates()`` picks the best measured figure of each
kind (JAX or torch): a ceiling is what the device can do, whichever library gets there.
"""
from __future__ import annotations

import time

import numpy as np


def _time(f, *args, reps=7, inner=4):
    import jax
    jax.block_until_ready(f(*args))                      # compile + warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / inner)
    return float(np.median(ts))


_CACHE: dict = {}


def measure(read_bytes: int | None = None, gemm_n: int | None = None, torch_peers: bool = True,
            device=None, cache: bool = True) -> dict:
    """The ceilings dict (rates in TB/s and TFLOP/s, plus the sizes used). Defaults: 4 GB / 8192 on a GPU,
    8 MiB / 256 elsewhere. Measured once per process and arguments (``cache``): a second bench in the same
    process (tests) reuses the numbers."""
    import jax

    dev = device or jax.devices()[0]
    key = (read_bytes, gemm_n, torch_peers, dev.id, dev.platform)
    if cache and key in _CACHE:
        return dict(_CACHE[key])
    _CACHE[key] = res = _measure(read_bytes, gemm_n, torch_peers, dev)
    return dict(res)


def _measure(read_bytes, gemm_n, torch_peers, dev) -> dict:
    import jax
    import jax.numpy as jnp

    gpu = dev.platform == "gpu"
    # 4 GB (decimal): 2e9 bf16 elements, under 2^31 so no int32 element index overflows anywhere
    read_bytes = read_bytes or (4_000_000_000 if gpu else (8 << 20))
    gemm_n = gemm_n or (8192 if gpu else 256)
    reps, inner = (7, 4) if gpu else (3, 1)
    res = {"platform": dev.platform, "device": dev.device_kind, "read_buffer_bytes": int(read_bytes),
           "gemm_n": int(gemm_n), "method": "median of %d samples of %d back-to-back calls after a warm-up; random "
                                            "normal data" % (reps, inner)}
    n = read_bytes // 2
    x = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.bfloat16), out_shardings=jax.sharding.SingleDeviceSharding(
        dev))(jax.random.PRNGKey(0))
    jax.block_until_ready(x)
    s = _time(jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32)), x, reps=reps, inner=inner)
    res["read_TBps_jax"] = x.nbytes / s / 1e12
    s = _time(jax.jit(lambda v: v * jnp.bfloat16(1.5)), x, reps=reps, inner=inner)
    res["copy_TBps_jax"] = 2 * x.nbytes / s / 1e12              # read + write
    del x
    m = gemm_n
    mk = jax.jit(lambda k: jax.random.normal(k, (m, m), jnp.bfloat16),
                 out_shardings=jax.sharding.SingleDeviceSharding(dev))
    a, b = mk(jax.random.PRNGKey(1)), mk(jax.random.PRNGKey(2))
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    s = _time(dot, a, b, reps=reps, inner=inner)
    res["bf16_TFLOPs_jax"] = 2 * m ** 3 / s / 1e12
    try:
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
        s = _time(dot, a8, b8, reps=reps, inner=inner)
        res["fp8_TFLOPs_jax"] = 2 * m ** 3 / s / 1e12
        del a8, b8
    except Exception as e:  # noqa: BLE001 - a backend without FP8 dots: say so, keep the rest
        res["fp8_jax_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del a, b
    if torch_peers and gpu:
        res.update(torch_ceilings(read_bytes))
    elif torch_peers:
        res["torch_note"] = "not measured: no GPU"
    return res


def torch_ceilings(read_bytes: int) -> dict:
    """torch peers (CUDA only): a ``sum`` read of the same size, and ``bench.kernels.measure_ceilings`` (copy,
    bf16 GEMM, FP8 ``_scaled_mm``); keys prefixed ``torch_``."""
    out = {}
    try:
        import torch
        if not torch.cuda.is_available():
            return {"torch_note": "torch without CUDA: not measured"}
    except ImportError:
        return {"torch_note": "torch not importable: not measured"}
    try:
        from dsflash.bench.kernels import time_torch
        x = torch.randn(read_bytes // 2, device="cuda", dtype=torch.bfloat16)
        t, how = time_torch(lambda: x.sum(dtype=torch.float32))
        out["read_TBps_torch"] = x.nbytes / t / 1e12
        out["torch_timer"] = how
        del x
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        out["torch_read_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        from dsflash.bench.kernels import measure_ceilings
        out.update({f"torch_{k}": v for k, v in measure_ceilings().items()})
    except Exception as e:  # noqa: BLE001
        out["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def rates(c: dict) -> dict:
    """The ceilings the floors use: read bandwidth (B/s), bf16 and FP8 GEMM rates (flop/s), each the best measured
    figure of its kind, with where it came from. No FP8 figure: the bf16 rate stands in (the floor errs high)."""
    def best(keys):
        vals = [(c[k], k) for k in keys if isinstance(c.get(k), (int, float)) and c[k] > 0]
        return max(vals) if vals else (None, None)

    rd, rk = best(["read_TBps_jax", "read_TBps_torch"])
    bf, bk = best(["bf16_TFLOPs_jax", "torch_bf16_matmul_TFLOPs_torch"])
    f8, fk = best(["fp8_TFLOPs_jax", "torch_fp8_matmul_TFLOPs_torch"])
    out = {"read_Bps": rd * 1e12 if rd else None, "read_from": rk,
           "bf16_flops": bf * 1e12 if bf else None, "bf16_from": bk,
           "fp8_flops": f8 * 1e12 if f8 else (bf * 1e12 if bf else None), "fp8_from": fk or (bk and "bf16 (no FP8)")}
    return out


def fixed(read_TBps: float, bf16_TFLOPs: float, fp8_TFLOPs: float) -> dict:
    """A ceilings dict from given numbers (tests, or floors without a measurement)."""
    return {"read_TBps_jax": read_TBps, "bf16_TFLOPs_jax": bf16_TFLOPs, "fp8_TFLOPs_jax": fp8_TFLOPs,
            "method": "given, not measured"}


def format_ceilings(c: dict) -> str:
    r = rates(c)
    f = lambda v, s: "-" if v is None else f"{v / s:.3g}"  # noqa: E731
    s = (f"ceilings ({c.get('device', '?')}): read {f(r['read_Bps'], 1e12)} TB/s [{r['read_from']}], "
         f"bf16 {f(r['bf16_flops'], 1e12)} TFLOP/s [{r['bf16_from']}], FP8 {f(r['fp8_flops'], 1e12)} TFLOP/s "
         f"[{r['fp8_from']}]")
    if "copy_TBps_jax" in c:
        s += f"; device copy (r+w) {c['copy_TBps_jax']:.3g} TB/s"
    if "fp8_jax_error" in c:
        s += f"; JAX FP8 dot failed: {c['fp8_jax_error'][:80]}"
    return s
