#!/usr/bin/env bash
# The GPU queue of dsflash/kernels/NOTES.md ("Queued for the next GPU session", items 1, 1b, 2 and 4) as two device
# calls of < 10 minutes, so a session with a machine spends its first minutes measuring, not assembling commands.
# Predictions are in NOTES; write the outcome next to them. From the repo root, wheels in .whl (jax_triton):
#
#   run(command="bash scripts/gpu_queue.sh engine", carry=[".whl"])    # items 1 and 1b, ~6 min
#   run(command="bash scripts/gpu_queue.sh kernels", carry=[".whl"])   # items 2 and 4, ~5 min
#
# engine: the engine's decode program per op (gpu_engine_steps --trace) at decode_steps 4, then decode_steps 1 with
#   XLA's command buffers on and off (is the ~4 ms fixed per device call graph re-recording?). Files: steps_*.json,
#   steps_*.log.
# kernels: the chunk-invariance test on the GPU, the x-dequantised-once MoE tiles' bit identity, and their timing
#   against the in-loop twins at prefill sizes. Files: pytest_*.log, kernels_moe_xb.json (bench kernels' own file).
# CPU check of the plumbing: MODEL=tiny STEPS_ARGS="--prompt-len 96 --budget 64 --decoding 4 --max-model-len 256"
# JAX_PLATFORMS=cpu bash scripts/gpu_queue.sh engine
set -u
MODEL=${MODEL:-bench-4l-96e}
PART=${1:?usage: gpu_queue.sh engine|kernels}
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
git log -1 --format='commit %H' 2>/dev/null || true

steps() {   # name, timeout, then gpu_engine_steps arguments
  local name=$1 t=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$t" python3 scripts/gpu_engine_steps.py --model "$MODEL" --out "$OUT/$name" "$@" ${STEPS_ARGS:-} > "$OUT/steps_$name.log" 2>&1
  echo "== $name (rc $?)"; grep -v '^{' "$OUT/steps_$name.log" | tail -12
  cp "$OUT/$name/engine_steps.json" "$OUT/steps_$name.json" 2>/dev/null; rm -rf "${OUT:?}/$name"
}

case $PART in
  engine)
    steps trace_ds4 220 --buckets default --decode-steps 4 --trace 3 --lone 2
    steps ds1 150 --buckets default --decode-steps 1 --lone 1
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" steps ds1_nocb 150 --buckets default --decode-steps 1 --lone 1
    ;;
  kernels)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_model_prefill_chunking.py > "$OUT/pytest_chunking.log" 2>&1
    echo "== chunking (rc $?)"; tail -3 "$OUT/pytest_chunking.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_layout.py -k x_dequantised > "$OUT/pytest_xb.log" 2>&1
    echo "== xb bit identity (rc $?)"; tail -3 "$OUT/pytest_xb.log"
    timeout 240 python3 -m dsflash.bench kernels --ops moe --tokens 1024,2048,4096 --quick --out "$OUT" \
      --prefill-configs sw_il_bm32,sw_il_bm32_xb,sw_il_bm64,sw_il_bm64_xb,sw_il_bm128,sw_il_bm128_xb > "$OUT/bench_xb.log" 2>&1
    echo "== bench kernels (rc $?)"; tail -25 "$OUT/bench_xb.log"
    ;;
  *) echo "usage: $0 engine|kernels"; exit 2 ;;
esac
ls -la "$OUT"
