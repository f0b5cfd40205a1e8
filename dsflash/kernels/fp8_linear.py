"""Dense FP8-stored linears (E4M3 weights [N, K] with UE8M0 32x32 block scales [N/32, K/32]).

``fp8_linear(x, w, scale, *, precision, backend, act_quant=True, force=False)``
  x      [..., K] activations (bf16, or anything the reference casts)
  w      [N, K] float8_e4m3fn (or its bytes as uint8)
  scale  [N/32, K/32] uint8 UE8M0 (2^(b - 127)), or None (float master weights: the reference)
  -> [..., N] bf16 (fp32 in "fp32" precision): ``x @ dequant(w).T``

Numerics: exactly ``dsflash.model.layers.linear_fp8`` (tests/test_kernels_fp8_linear.py checks it bit for bit on
CPU). "reference": x -> bf16 -> FP8 E4M3 round trip per 32 along K (pow2 scales; the values are exact in bf16),
weights dequantised exactly (E4M3 x 2^k), fp32 accumulation, bf16 output. "bf16": the same without the activation
round trip. "fp32": the reference only (the kernel has no fp32 mode).

The Triton kernel (``fp8_linear_triton``) reads each FP8 weight byte once and dequantises it in registers, instead
of XLA's dequantised bf16 copy of the weight per call. Where it runs is ``dispatch.GATES["fp8_linear"]`` (rows M,
measured in the whole step on an H200: kernels/NOTES.md "FP8 dense linears"); ``layers.linear_fp8`` calls it with
the model's ``backend`` run option.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsflash.kernels import dispatch
from dsflash import quant

# Weights smaller than this (N K elements) stay on XLA even inside the gate's rows (``layers.linear_fp8`` passes the
# shape). 0: run 21 had the kernel ahead in the step for every dense linear of V4.1 ("fp8lin" beat "fp8big").
MIN_WEIGHT_ELEMENTS = 0
# The grouped launch (V4.1's wo_a: ``layers.linear_fp8_grouped``), on since H200 run 24 (2026-12-02; its GPU tests
# passed in run 23): o_proj 0.390 -> 0.191 ms at 1 x 6 rows, 0.694 -> 0.605 at 32 x 6 (bench-4l-96e, 4 layers; JSON
# benchmarks/results/step_profile_20261202_h200_run24.json). False: wo_a through XLA's dequantised copy.
GROUPED = True
PRECISIONS = ("reference", "bf16")      # what the kernel implements
HIGHEST = jax.lax.Precision.HIGHEST

def _act_dtype(precision):
    return jnp.float32 if precision == "fp32" else jnp.bfloat16


def _dot(x, w_t):
    """``layers._dot``: x [..., K] @ w_t [K, N], fp32 accumulation; bf16 operands go to the tensor cores as they are
    on a GPU (``layers.tensor_cores``), everything else is widened (HIGHEST)."""
    if x.dtype == jnp.bfloat16 and w_t.dtype == jnp.bfloat16 and dispatch.on_gpu():
        return jnp.einsum("...k,kn->...n", x, w_t, preferred_element_type=jnp.float32)
    return jnp.einsum("...k,kn->...n", x, w_t, preferred_element_type=jnp.float32, precision=HIGHEST)


def fp8_linear_reference(x, w_fp8, scale_u8, *, precision="reference", act_quant=True):
    """``layers.linear_fp8``'s numerics on arrays: the same ops in the same order (so the same bits as the model's
    linear; pinned on CPU by tests/test_kernels_fp8_linear.py, on the GPU by tests/gpu/test_fp8_linear.py's gate
    test). Written out here, not imported, so kernels/ imports nothing of model/ but quant (as moe_gemm);
    ``layers.linear_fp8`` keeps its own XLA path and calls only the kernel (where ``use_triton`` says so)."""
    if w_fp8.dtype == jnp.uint8:
        w_fp8 = jax.lax.bitcast_convert_type(w_fp8, jnp.float8_e4m3fn)
    dt = _act_dtype(precision)
    if precision == "reference":
        wdt = jnp.bfloat16 if dispatch.on_gpu() and scale_u8 is not None else jnp.float32
        w = quant.dequant_fp8_weight(w_fp8, scale_u8, wdt)
        xa = quant.fp8_roundtrip(x.astype(jnp.bfloat16), 32).astype(wdt) if act_quant \
            else x.astype(jnp.bfloat16).astype(wdt)
    else:
        w = quant.dequant_fp8_weight(w_fp8, scale_u8, dt)
        xa = x.astype(dt)
    return _dot(xa, w.T).astype(dt)


def rows_of(x) -> int:
    return math.prod(x.shape[:-1])


def use_triton(backend, rows: int, precision: str, *, force: bool = False, scale=True, weight_shape=None,
               grouped: bool = False) -> bool:
    """``dispatch.use_triton("fp8_linear", ...)`` at M = ``rows``, and ``MIN_WEIGHT_ELEMENTS`` when the weight's shape
    is given (``GROUPED`` for a grouped launch). Float master weights (``scale`` None) always take the reference."""
    if scale is None or (grouped and not (GROUPED or force)):
        return False
    if not force and weight_shape is not None and math.prod(weight_shape) < MIN_WEIGHT_ELEMENTS:
        return False
    return dispatch.use_triton("fp8_linear", backend, rows, precision=precision, force=force)


def fp8_linear(x, w, scale, *, precision="reference", backend="auto", act_quant=True, force=False, config=None):
    """The reference or the Triton kernel, as ``use_triton`` decides at M = rows of x."""
    if not use_triton(backend, rows_of(x), precision, force=force, scale=scale):
        return fp8_linear_reference(x, w, scale, precision=precision, act_quant=act_quant)
    from dsflash.kernels import fp8_linear_triton  # lazy: needs a CUDA GPU and jax-triton
    return fp8_linear_triton.fp8_linear_triton(x, w, scale, precision=precision, act_quant=act_quant, config=config)
