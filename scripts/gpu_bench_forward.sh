#!/usr/bin/env bash
# `bench forward` / `bench eplb` at bench-size shapes on the GPU machine (one stage per device call: each
# stage stays under the 10-minute command limit and returns <= 8 files). From the repo root:
#
#   DSFLASH_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_bench_forward.sh <stage> [extra bench args]
#
# stages (nvidia-h200 unless noted; preset bench-4l-48e = real layer widths, 4 layers, 48 experts, ~8 GB):
#   decode     decode grid, single device, reference numerics, XLA kernels (B per rank x context)
#   prefill    prefill grid (N new tokens over C cached)
#   breakdown  attention / MoE / routed / other for one decode and one prefill point (5 programs each)
#   triton     the decode grid subset with --backend triton (dsflash GPU kernels)
#   dep2       nvidia-h200-x2: dep=2 (EP over 2 GPUs), real vs uniform routing, --mirror and --lag
#   eplb       CPU-only numbers, any machine: bench eplb on dep=8 / dep=32 (v41_flash synthetic + bench real)
#   dep4 dep8  nvidia-h200-x4 / -x8 (issue 9, NOT RUN YET: those kinds were never lent): the full v41_flash widths
#              and depth, random weights generated on the GPUs tensor by tensor (--init device), Engram tables in
#              host memory;
#              decode B per rank 1-64 at 8K, 32 at 32K / 128K, real + Zipf-1.2 routers (dep8: + EPLB on, 32
#              redundant slots). dep4-prefill / dep8-prefill: 4K-32K new tokens.
#
# Results: $OUT/forward_<date>_h200_<stage>.json + .png + <stage>.log. Copy the JSON/PNG into
# benchmarks/results/ and the headline rows into benchmarks/BENCHMARKS.md. Budget: compile dominates
# (~20-60 s per program at bench width); each stage compiles 6-10 programs.
set -u
STAGE=${1:-decode}; shift || true
OUT=${OUT:-out}; mkdir -p "$OUT"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
PRESET=${PRESET:-bench-4l-48e}
T=${BENCH_TIMEOUT:-560}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
B=(python3 -m dsflash.bench forward --preset "$PRESET" --out "$OUT" --tag "$STAGE" --reps 10 --warmup 3)
case "$STAGE" in
  decode)
    timeout "$T" "${B[@]}" --decode 1,8,32,64@4096 "32@16384,65536" --no-uniform --no-breakdown "$@" ;;
  prefill)
    timeout "$T" "${B[@]}" --prefill 1024,4096@0 "1024@16384" --no-uniform --no-breakdown "$@" ;;
  breakdown)
    timeout "$T" "${B[@]}" --decode 32@4096 --prefill 4096@0 --no-uniform "$@" ;;
  triton)
    timeout "$T" "${B[@]}" --backend triton --decode 1,32@4096 --no-uniform --no-breakdown "$@" ;;
  dep2)
    timeout "$T" "${B[@]}" --mesh dep=2 --decode 8,32@4096 --mirror --lag 0.001 --no-breakdown "$@" ;;
  eplb)
    timeout "$T" python3 -m dsflash.bench eplb --mesh dep=8 --preset tiny --out "$OUT" "$@"
    timeout "$T" python3 -m dsflash.bench eplb --mesh dep=32 --preset v41_flash --redundant 32 --draft-redundant 32 \
      --tokens 5120 --steps 4 --out "$OUT/v41" "$@" ;;
  dep4|dep8)
    # EPLB on needs a second copy of the routed experts: ~70 GB more per GPU at DEP4 (does not fit), ~35 at DEP8
    X=(); [ "$STAGE" = dep8 ] && X=(--eplb 32)
    timeout "$T" "${B[@]}" --preset v41_flash --mesh "dep=${STAGE#dep}" --engram-tables host --init device \
      --decode 1,8,32,64@8192 "32@32768,131072" --no-uniform --zipf 1.2 "${X[@]}" --no-breakdown --reps 5 \
      --warmup 2 "$@" ;;
  dep4-prefill|dep8-prefill)
    N=${STAGE%-prefill}; N=${N#dep}
    timeout "$T" "${B[@]}" --preset v41_flash --mesh "dep=$N" --engram-tables host --init device \
      --prefill 4096,16384,32768@0 --no-uniform --no-breakdown --no-draft --reps 3 --warmup 1 "$@" ;;
  *) echo "unknown stage $STAGE (decode|prefill|breakdown|triton|dep2|eplb|dep4|dep8|dep4-prefill|dep8-prefill)" >&2
     exit 2 ;;
esac 2>&1 | tee "$OUT/$STAGE.log" | tail -40
