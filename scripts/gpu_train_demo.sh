#!/usr/bin/env bash
# Train the demo model on the GPU machine (issue 8) and, on the same GPU in parallel, run the GPU kernel tests
# (correctness only: their timings do not matter here). From the repo root, wheels in .whl (README of the device):
#
#   bash scripts/gpu_train_demo.sh [extra python -m dsflash.train args]
#
# Returns (<= 8 files): demo_checkpoint.tgz (the exported checkpoint), metrics.json, log.jsonl, loss.png,
# train.log, gpu_tests.log.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
RUN=/tmp/demo_run
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -rA -p no:cacheprovider \
    tests/gpu > "$OUT/gpu_tests.log" 2>&1 ) &
TESTS=$!
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout "${TRAIN_TIMEOUT:-540}" python3 -m dsflash.train --out "$RUN" \
  --steps 2500 --draft-steps 1200 --batch-size 64 --eval-every 100 --anchors 8 \
  --max-target-seconds 200 --max-draft-seconds 160 "$@" 2>&1 | tr '\r' '\n' | tee "$OUT/train.log" | tail -60
wait $TESTS
tail -5 "$OUT/gpu_tests.log"
cp "$RUN/metrics.json" "$RUN/log.jsonl" "$RUN/loss.png" "$OUT/" 2>/dev/null
tar czf "$OUT/demo_checkpoint.tgz" -C "$RUN" checkpoint 2>/dev/null && ls -la "$OUT"
