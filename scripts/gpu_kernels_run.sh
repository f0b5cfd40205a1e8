#!/usr/bin/env bash
# One device-machine call: GPU kernel tests, then `bench kernels`. Usage (from the repo root, on the GPU machine,
# after installing jax-triton onto PYTHONPATH):  DSFLASH_COMMIT=<sha> bash scripts/gpu_kernels_run.sh [bench args]
# Logs and the JSON go to $OUT (or ./out).
OUT=${OUT:-out}; mkdir -p "$OUT"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import jax, jaxlib, triton, jax_triton, torch; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__, 'torch', torch.__version__, jax.devices())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q -rA -s --maxfail=4 -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|ERROR|passed|failed|error|Error|rel err|codes equal" | tail -40
fi
timeout "${BENCH_TIMEOUT:-300}" python3 -m dsflash.bench kernels --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
