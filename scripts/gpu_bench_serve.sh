#!/usr/bin/env bash
# `bench serve` against a real `python -m dsflash.serve` on the GPU machine (issue 19 queue item 3), one device
# call. The GPU image lacks fastapi / uvicorn / pydantic: download their wheels here first and carry `.whl`:
#
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       fastapi uvicorn pydantic -d .whl
#   run(command="DSFLASH_COMMIT=<sha> bash scripts/gpu_bench_serve.sh", carry=[".whl"])
#
# Settings as arguments: MODEL (default bench-4l-96e: real widths, 4 layers, 96 experts, random weights),
# SWEEP (concurrencies), IN / OUTLEN (tokens), SEQS (--max-num-seqs), LEN (--max-model-len), SPEC (adaptive |
# always | off), NREQ (requests per point), VOCAB (token-id prompts
# drawn below it; needed for small-vocabulary models, e.g. 512 for tiny), SERVER_ARGS (more server flags, e.g.
# "--moe-weight-layout il"), BATCHED (--max-num-batched-tokens, default 256). No plot: the device call returns only a
# few files, so keep several runs' results to ~8 files in all. Results: $OUT/serve_*.json (bench serve's own file) + server.log + bench.log.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=${MODEL:-bench-4l-96e}; SWEEP=${SWEEP:-1,8,32}; IN=${IN:-1024}; OUTLEN=${OUTLEN:-128}
SEQS=${SEQS:-32}; LEN=${LEN:-4096}; SPEC=${SPEC:-off}; NREQ=${NREQ:-64}; T=${BENCH_TIMEOUT:-540}
BATCHED=${BATCHED:-256}    # --max-num-batched-tokens: the prefill chunk
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1
python3 -c "import fastapi, uvicorn, pydantic" || { echo "fastapi/uvicorn/pydantic missing: carry .whl"; exit 2; }
PORT=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python3 -m dsflash.serve --model "$MODEL" --port "$PORT" --max-num-seqs "$SEQS" --max-model-len "$LEN" \
    --max-num-batched-tokens "$BATCHED" --speculative-mode "$SPEC" --backend auto ${SERVER_ARGS:-} \
    > "$OUT/server.log" 2>&1 &
SRV=$!
trap 'kill $SRV 2>/dev/null; wait $SRV 2>/dev/null' EXIT
for _ in $(seq 1 300); do      # start-up compiles the engine's programs: minutes at bench width
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SRV 2>/dev/null || { echo "server exited"; tail -40 "$OUT/server.log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server not healthy"; tail -40 "$OUT/server.log"; exit 1; }
timeout "$T" python3 -m dsflash.bench serve --base-url "http://127.0.0.1:$PORT/v1" --endpoint completions \
    --prompt-format token-ids --input-len "$IN" --output-len "$OUTLEN" --sweep "$SWEEP" --num-requests "$NREQ" \
    --num-gpus 1 ${VOCAB:+--vocab-size "$VOCAB"} --no-plot --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log"
curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt" || true
tail -20 "$OUT/server.log"
