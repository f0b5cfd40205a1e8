#!/usr/bin/env bash
# Nsight Compute on the MoE decode kernels (issue 6, NOTES.md "Known problems" 2): why sk_fp8 reaches only
# 24-43 % of the copy bandwidth. One call on the GPU machine (Firecracker: ncu reads the counters; clocks left
# alone per METHOD.md), from the repo root with jax-triton on PYTHONPATH:
#
#   CONFIGS="sk_fp8 fp8mma_decode" TOKENS="1 16" bash scripts/gpu_ncu_moe.sh
#
# Returns in $OUT: one .ncu-rep per (config, tokens) and ncu_summary.txt (per kernel: duration, DRAM throughput,
# achieved occupancy, registers, shared memory, the top warp-stall reasons).
OUT=${OUT:-out}; mkdir -p "$OUT"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 PYTHONPATH=$PWD:${PYTHONPATH:-}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
for c in ${CONFIGS:-sk_fp8 fp8mma_decode}; do
  for t in ${TOKENS:-1 16}; do
    # the last --reps launch: skip the compile launch and the earlier reps (each launch is >= 2 kernels)
    timeout "${NCU_TIMEOUT:-150}" "$NCU" --clock-control none --target-processes all --kernel-name regex:_moe_ \
      --launch-skip "${SKIP:-4}" --launch-count "${COUNT:-4}" --set full -f -o "$OUT/moe_${c}_T$t" \
      python3 scripts/moe_profile_target.py --config "$c" --tokens "$t" --reps 3 > "$OUT/ncu_${c}_T$t.log" 2>&1
    echo "== $c T=$t (rc $?)"; tail -3 "$OUT/ncu_${c}_T$t.log"
  done
done
{
  for r in "$OUT"/moe_*.ncu-rep; do
    echo "=== $r"
    "$NCU" --import "$r" --page details --csv 2>/dev/null | grep -E '"(Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread|Dynamic Shared Memory Per Block|Theoretical Occupancy|Block Limit Registers|L2 Hit Rate|Mem Busy|Compute \(SM\) Throughput)"' \
      | awk -F'","' '{print $5, "|", $(NF-2), $(NF-1), $NF}' | tr -d '"'
    "$NCU" --import "$r" --page raw --csv --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_selected 2>/dev/null | head -8
  done
} > "$OUT/ncu_summary.txt" 2>&1
tail -60 "$OUT/ncu_summary.txt"
