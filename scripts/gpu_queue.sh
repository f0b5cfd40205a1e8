#!/usr/bin/env bash
# The GPU queue of dsflash/kernels/NOTES.md ("Queued for the next GPU session") as device calls of < 10 minutes, so a
# session with a machine spends its first minutes measuring, not assembling commands. Predictions are in NOTES; write
# the outcome next to them. From the repo root, wheels in .whl (jax_triton):
#
#   run(command="bash scripts/gpu_queue.sh mhc_overhead", carry=[".whl"])  # session-12 queue items 4 and 1, ~6 min
#   run(command="bash scripts/gpu_queue.sh draft", carry=[".whl"])         # session-12 queue item 2, ~9.5 min
#   run(command="bash scripts/gpu_queue.sh moe_decode", carry=[".whl"])    # il decode variants + ncu, ~6 min
#   run(command="bash scripts/gpu_queue.sh step_mhc", carry=[".whl"])      # session-13 queue item 1, ~6 min
#   run(command="bash scripts/gpu_queue.sh moe_gu", carry=[".whl"])        # session-13 queue item 3, ~7 min
#   run(command="bash scripts/gpu_queue.sh ffi", carry=[".whl"])           # Triton FFI form vs legacy, ~5 min
#   run(command="bash scripts/gpu_queue.sh loop_ab", carry=[".whl"])       # engine decode loop: legacy, FFI, FFI + WHILE, ~5 min
#   run(command="bash scripts/gpu_queue.sh paged", carry=[".whl"])         # paged sparse attention: test + step, ~6 min
#   run(command="bash scripts/gpu_queue.sh moe_prefill", carry=[".whl"])   # launch-order bits, il prefill tiles, ncu bytes, ~8 min
#   run(command="bash scripts/gpu_queue.sh indexer_hw", carry=[".whl"])    # indexer hw_round 1 / 2: GPU bits + A/B, ~4 min
#   run(command="bash scripts/gpu_queue.sh adaptive_switch", carry=[".whl"])  # adaptive program-switch cost + batch 32, ~8 min
#   run(command="bash scripts/gpu_queue.sh moe_stalls", carry=[".whl"])    # ncu stall / pipe sections of the il prefill kernels, ~3 min
#   run(command="bash scripts/gpu_queue.sh decode_glue", carry=[".whl"])   # decode step + its HLO's concatenation fusions, ~3 min
#   run(command="bash scripts/gpu_queue.sh spec_long", carry=[".whl"])     # issue 23: batch 32, 256-token outputs, ~8 min
#   run(command="bash scripts/gpu_queue.sh prefill_step", carry=[".whl"])  # the step per op: decode 32x6, prefill 4K / 16K, ~3 min
#   run(command="bash scripts/gpu_queue.sh mhc_prefill", carry=[".whl"])   # fused mHC plans at 4K / 16K tokens, ~3 min
#   run(command="bash scripts/gpu_queue.sh rope_ab", carry=[".whl"])       # RoPE in the flash kernel: test + step A/B, ~5 min
#   run(command="bash scripts/gpu_queue.sh s22_tests", carry=[".whl"])     # session 22's GPU bit checks (RoPE, top-k, indexer), ~4 min
#   run(command="bash scripts/gpu_queue.sh s22_step", carry=[".whl"])      # session 22's step A/B at 16K (4 variants) + 4K, ~8 min
#   run(command="bash scripts/gpu_queue.sh fp8_lastred", carry=[".whl"])   # session 27: last-program split-K reduce, ~8 min
#   run(command="bash scripts/gpu_queue.sh mixed_ab", carry=[".whl"])      # session 27: issue 23's mixed-step A/B, ~8 min
#   run(command="bash scripts/gpu_queue.sh moe_decode_stalls", carry=[".whl"])  # session 28: ncu on the MoE decode kernels, ~1 min
#   run(command="bash scripts/gpu_queue.sh moe_sd3", carry=[".whl"])    # session 28: the bm32 band's down kernel at 3 stages, ~5 min
#   run(command="bash scripts/gpu_queue.sh fp8_planes", carry=[".whl"]) # session 28: the E4M3 bit-placement decode, ~7 min
#   run(command="bash scripts/gpu_queue.sh moe_xbs3", carry=[".whl"])   # session 28: MoE decode with x dequantised once, ~5 min
#   run(command="bash scripts/gpu_queue.sh mhc_rows", carry=[".whl"])   # session 28: mHC kernel B one token a program, ~4 min
#   run(command="bash scripts/gpu_queue.sh indexer_stalls", carry=[".whl"])  # session 28: ncu on the paged indexer at 128K, ~2 min
#   run(command="bash scripts/gpu_queue.sh s28_ncu", carry=[".whl"])    # session 28: the sd3 check + indexer_stalls, ~3 min
#   run(command="bash scripts/gpu_queue.sh moe_ladder", carry=[".whl"]) # session 29: the il decode ladder, ~3-4 min
#   run(command="bash scripts/gpu_queue.sh moe_ladder2", carry=[".whl"]) # session 30: ladder 2 (up kernel's load stream) + ncu, ~6-7 min
#   run(command="bash scripts/gpu_queue.sh moe_tm", carry=[".whl"])      # session 30: tile-major il + blocked scales: bits + ladder rungs 0 / 1, ~4-5 min
#
# mhc_overhead: the mHC epilogue-warps test and `bench kernels --ops mhc` with plan overrides at decode sizes, then the
#   engine's per-call overhead (gpu_engine_steps --call-overhead). Files: pytest_mhc.log, kernels_*.json, steps_*.
# draft: `bench engine --model demo` with the retrained draft, documentation then chat prompts, spec / adaptive /
#   plain at 1, 8, 32 sequences (DRAFT_SETS, DRAFT_BATCHES, DRAFT_TIMEOUT per set, DRAFT_MODES: default "text chat",
#   1,8,32, 280 s, spec,adaptive,plain).
#   Files: eng_text.json, eng_chat.json and their logs.
# moe_decode: il decode configs (MOE_CONFIGS, comma-separated) at 1 / 32 / 64 x 6 rows, and Nsight Compute's stall
#   reasons on the 32 x 6 config. Files: kernels_*.json, bench_moe_decode.log, ncu_*.log, ncu_summary.txt.
# moe_prefill: il prefill tiles at 1024 / 4096 / 16384 tokens -- the three the serving bands use, the same with the
#   column blocks launched fastest (_nf), grouped (_nf_g4 / _g8, session 17) and the split gate / up candidates
#   (experimental/moe_configs.py; PREFILL_CONFIGS overrides the list), after the GPU test that the launch orders are
#   bit-identical to their bases -- then Nsight Compute's DRAM bytes and L2 hit rate of NCU_CONFIGS' kernels at 4096
#   tokens (default sw_il_bm128_nf and _nf_g8; NCU_MOE=0 skips them). Files: pytest_order.log, kernels_*.json,
#   bench_moe_prefill.log, ncu_moe_prefill_*.log.
# indexer_hw: tests/gpu/test_indexer.py -k hw_round, then `bench kernels --ops indexer --indexer-hw-round` at the
#   4K / 16K causal prefill shapes (scripts/gpu_kernels_run.sh). Files: gpu_tests.log, bench.log, kernels_*.json.
# adaptive_switch: scripts/adaptive_switch_cost.py at batch 32 (catch-up and switch costs), then `bench engine` at
#   batch 32, 9 passes, chat then documentation prompts. Files: switch.json / .log, eng32_{chat,text}.json / .log.
# moe_stalls: Nsight Compute's stall reasons per issued instruction, issue activity, registers and active warps of
#   the il prefill kernels at 4096 tokens, as a metric list (the section set segfaulted on the H100 in session 19;
#   NCU_CONFIGS, default the serving sw_il_bm128_nf_g8_hp_xp_dp; NCU_EXTRA appends metrics). Files: ncu_stalls_*.log.
# decode_glue: gpu_step_profile at 32 x 6 @ 4K with --dump-hlo, then the HLO lines of its input_concatenate fusions.
#   Files: step_glue.log, step_profile.json, hlo_*.txt.
# spec_long: `bench engine --model demo` at batch 32 with 256-token outputs, 5 passes, chat then documentation
#   prompts. Files: eng32long_{chat,text}.json / .log.
# guided: `bench guided --model demo` (issue 22 item 4): mask cost, then free / json / mixed tokens/s with speculation
#   off and always, 2 passes (needs the llguidance wheel in .whl). Files: guided.json, guided.log.
# s23_all: prefill_step (with ceilings), then guided. s23_a: the in-place RoPE's GPU test, then
#   prefill_step with moeil_ropex / moeil_ropei. s23_b: attn_prefill, then guided. Then targets.
# gluon: tests/gpu/test_gluon_launch.py and test_sparse_attention_gluon.py, then gpu_attn_prefill_probe.py with the
#   Gluon flash kernels (gluon_ov0, the channel-split gluon_ws) beside flash_bk64_s2 (ATTN_CONFIGS), then (ov0 passed, GLUON_STEP not
#   0) the 16K prefill step without / with it (on by default from 4,096 rows since session 26). Files: pytest_gluon.log, attn_gluon.json / .log, step_gluon.log,
#   step_profile.json.
# gluon_stalls: Nsight Compute on the Gluon flash kernel at GLUON_ROWS prefill rows (default 16384). Files: ncu_gluon.log.
# fp8_stalls: Nsight Compute on the dense FP8 kernel at decode rows (scripts/fp8_profile_target.py; FP8_SHAPES, FP8_ROWS,
#   FP8_CONFIG). Files: ncu_fp8_<shape>.log.
# fp8_sweep: gpu_fp8_linear_sweep.py at FP8_ROWS (192) over FP8_SWEEP_SHAPES with FP8_SWEEP_CONFIGS (the decode band's
#   config and kernels/experimental/fp8_configs.py's candidates). Files: fp8_sweep.json / .log.
# fp8_lastred: the last-program split-K reduce's GPU test, fp8_sweep at 6 / 192 rows with it and the one-row-tile
#   candidate, then prefill_step's decode points with moeil / moeil_lastred / moeil_fp8bm256. Files: pytest_lastred.log,
#   fp8_sweep.*, prefill_step.log, step_profile.json.
# mixed_ab: bench engine, demo, MIXED_PROMPTS (128) chat prompts through MIXED_SEQS (8 32) sequences, adaptive /
#   adaptive_mixed / plain, 5 interleaved passes. Files: mixed_<seqs>.json / .log.
# attn_prefill: scripts/gpu_attn_prefill_probe.py at 4096 / 16384 tokens (flash configs and the paged kernel), then
#   ncu metrics of the flash and paged kernels at 4096. Files: attn_prefill.json / .log, ncu_attn_prefill.log.
# targets: the rest of issue 19's grid after prefill_step's points -- decode 1 / 8 / 64 x 6 @ 4K, 32 x 6 @ 32K and 128K
#   -- per op, with ceilings. Files: targets.log, step_profile.json.
# prefill_step: gpu_step_profile per op at STEP_POINTS (default decode 32 x 6 @ 4K, prefill 4K and 16K) for
#   STEP_VARIANTS (default moeil; e.g. moeil_ropex,moeil_ropek: RoPE around / in the flash kernel, an A/B in one call).
#   Files: prefill_step.log, step_profile.json.
# rope_ab: the GPU test of RoPE in the flash kernel, then the step with it off / on (moeil_ropex / moeil_ropek) at
#   ROPE_POINTS (default prefill 4K and 16K, no ceilings). Files: pytest_rope.log, step_rope.log, step_profile.json.
# CPU check of the plumbing: MODEL=tiny STEPS_ARGS="--prompt-len 96 --budget 64 --decoding 4 --max-model-len 256"
# JAX_PLATFORMS=cpu bash scripts/gpu_queue.sh engine
set -u
MODEL=${MODEL:-bench-4l-96e}
PART=${1:?usage: gpu_queue.sh engine|mhc_overhead|draft|moe_decode|step_mhc|ffi|loop_ab|paged|moe_gu|moe_prefill|indexer_hw|adaptive_switch|moe_stalls|decode_glue|spec_long|prefill_step|mhc_prefill|rope_ab|s22_tests|s22_step|s22_all|guided|s23_all|s23_a|s23_b|targets|attn_prefill|gluon|fp8_stalls|fp8_sweep|fp8_lastred|fp8_planes|mixed_ab|moe_decode_stalls|moe_sd3|moe_xbs3|moe_ladder|moe_ladder2|moe_tm|mhc_rows|indexer_stalls|s28_ncu|gluon_stalls|kernels}
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then   # one wheel at a time: one that does not fit this image (glibc) skips alone
  for w in .whl/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
      || echo "wheel not installed: $w"
  done
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}   # triton.compile (Gluon kernels) needs a writable one
if [ "$JAX_PLATFORMS" = cuda ] && ! python3 -c "import jax_triton" 2>/dev/null; then
  echo "jax_triton is not importable: carry .whl holding jax_triton-0.3.1 (../shared/wheels)"; exit 3
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
git log -1 --format='commit %H' 2>/dev/null || true

steps() {   # name, timeout, then gpu_engine_steps arguments
  local name=$1 t=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$t" python3 scripts/gpu_engine_steps.py --model "$MODEL" --out "$OUT/$name" "$@" ${STEPS_ARGS:-} > "$OUT/steps_$name.log" 2>&1
  echo "== $name (rc $?)"; grep -v '^{' "$OUT/steps_$name.log" | tail -12
  cp "$OUT/$name/engine_steps.json" "$OUT/steps_$name.json" 2>/dev/null; rm -rf "${OUT:?}/$name"
}

eng32() {     # `bench engine --model demo` at batch 32, chat then documentation prompts: tag, max tokens, passes, timeout[, max model len]
  for set in chat text; do
    timeout "$4" python3 -m dsflash.bench engine --model demo --${set}-prompts --prompt-len 48 --max-tokens "$2" \
      --max-model-len "${5:-256}" --batches 32 --passes "$3" --modes spec,adaptive,plain --json "$OUT/$1_$set.json" \
      --compilation-cache-dir /tmp/cc > "$OUT/$1_$set.log" 2>&1
    echo "== bench engine $set batch 32, $2 tokens (rc $?)"
    grep -E "^\[|/ plain|decode phase|by step kind" "$OUT/$1_$set.log" | tail -12
  done
}

stall_metrics() {   # Nsight Compute metrics by name: time, issue activity, registers, warps active, DRAM bytes read,
                    # grid size and the stall reasons per issued instruction (ncu's section sets segfaulted, session 19)
  local m=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread r
  m=$m,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,launch__grid_size
  for r in barrier membar long_scoreboard short_scoreboard math_pipe_throttle wait mio_throttle lg_throttle \
           not_selected selected dispatch_stall no_instruction branch_resolving drain; do
    m=$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  echo "$m"
}

moe_bench() {  # decode configs (MOE_CONFIGS) at 1 / 32 / 64 x 6 rows, then ncu's stall reasons on one config at 192 tokens
  timeout 200 python3 -m dsflash.bench kernels --ops moe --tokens 6,192,384 --quick --no-torch --out "$OUT" \
    --decode-configs ${MOE_CONFIGS:-sw_il,sw_il_bm32} > "$OUT/bench_moe_decode.log" 2>&1
  echo "== bench kernels moe decode (rc $?)"; tail -30 "$OUT/bench_moe_decode.log"
  CONFIGS="$1" TOKENS="192" SKIP=$2 COUNT=$2 NCU_TIMEOUT=200 bash scripts/gpu_ncu_moe.sh > "$OUT/ncu_$1.log" 2>&1
  echo "== ncu $1 (rc $?)"; tail -40 "$OUT/ncu_$1.log"
}

case $PART in
  engine)
    steps trace_ds4 220 --buckets default --decode-steps 4 --trace 3 --lone 2
    steps ds1 150 --buckets default --decode-steps 1 --lone 1
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" steps ds1_nocb 150 --buckets default --decode-steps 1 --lone 1
    ;;
  mhc_overhead)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mhc.py -k epilogue_warps > "$OUT/pytest_mhc.log" 2>&1
    echo "== mhc epilogue warps (rc $?)"; tail -3 "$OUT/pytest_mhc.log"
    timeout 150 python3 -m dsflash.bench kernels --ops mhc --mhc-tokens 6,192 --quick --out "$OUT" \
      --mhc-plans b1=warps_b:1,b2=warps_b:2,ds40=BD:128/DS:40,ds40b1=BD:128/DS:40/warps_b:1 > "$OUT/bench_mhc.log" 2>&1
    echo "== bench kernels mhc (rc $?)"; tail -20 "$OUT/bench_mhc.log"
    steps overhead 240 --buckets default --decode-steps 4 --call-overhead 8 --lone 1
    ;;
  draft)
    for set in ${DRAFT_SETS:-text chat}; do    # session 16: text's batches 8 and 32 did not fit 280 s after batch 1
      timeout "${DRAFT_TIMEOUT:-280}" python3 -m dsflash.bench engine --model demo --${set}-prompts --prompt-len 48 \
        --max-tokens 64 --batches "${DRAFT_BATCHES:-1,8,32}" --passes 3 --modes "${DRAFT_MODES:-spec,adaptive,plain}" --json "$OUT/eng_$set.json" \
        --compilation-cache-dir /tmp/cc > "$OUT/eng_$set.log" 2>&1
      echo "== bench engine $set (rc $?)"; tail -15 "$OUT/eng_$set.log"
    done
    ;;
  moe_decode)
    moe_bench sw_il_bm32 2      # two launches a call (up, down)
    ;;
  step_mhc)     # session 13's queue item 1: the mHC barrier and the command-buffer settings in the step
    timeout 560 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --decode 1@4096 32@4096 \
      --variants moeil --profile-no-cb --cb-modes FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL FUSION --out "$OUT" \
      > "$OUT/step_mhc.log" 2>&1
    echo "== step profile (rc $?)"; grep -v '^{' "$OUT/step_mhc.log" | grep -E "^==|command buffers|^mhc|^routed|kernel-busy|^decode" | head -30
    ;;
  ffi)          # session 14: Triton launches in the FFI form (recorded into command buffers) against the legacy form
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_triton_call.py > "$OUT/pytest_ffi.log" 2>&1
    echo "== triton_call FFI (rc $?)"; grep -E "census|passed|failed|Error" "$OUT/pytest_ffi.log" | head -8
    timeout 420 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --decode 1@4096 32@4096 \
      --variants moeil_ffi,moeil_legacy --profile-no-cb --no-profile --no-ceilings --out "$OUT" > "$OUT/step_ffi.log" 2>&1
    echo "== step profile (rc $?)"; grep -v '^{' "$OUT/step_ffi.log" | grep -E "^==|command buffers|^mhc|^routed|kernel-busy|^decode" | head -30
    ;;
  loop_ab)      # sessions 15-16: the engine's decode loop with legacy launches, FFI launches (both with XLA's default
                # command buffers), and FFI launches + WHILE / CONDITIONAL command buffers (the loop as one graph)
    LA="--buckets 1x256 --prompt-len 256 --budget 256 --lone 1 --steps 4 --decode-steps 4 --call-overhead 6 --trace 2"
    STEPS_ARGS="$LA --triton-launch legacy" steps loop_legacy 230
    STEPS_ARGS="$LA --triton-launch ffi" steps loop_ffi 230    # session 16: the FFI launches alone (XLA's default flags)
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
      STEPS_ARGS="$LA --triton-launch ffi" steps loop_ffi_while 230
    grep -h "call overhead\|decode program" "$OUT"/steps_loop_*.log      # "graphs (trace)": kernels replayed from graphs
    ;;
  paged)        # session 15: the paged sparse attention kernel (GPU test), then the step with it at every row count
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_sparse_attention_paged.py > "$OUT/pytest_paged.log" 2>&1
    echo "== paged attention test (rc $?)"; grep -E "band|passed|failed|Error" "$OUT/pytest_paged.log" | head -8
    timeout 240 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --decode 1@4096 32@4096 \
      --variants moeil,moeil_paged --profile-no-cb --no-ceilings --out "$OUT" > "$OUT/step_paged.log" 2>&1
    echo "== step profile (rc $?)"; grep -v '^{' "$OUT/step_paged.log" | grep -E "^==|^sparse_att|^kv_gather|^attention_other|^decode" | head -40
    ;;
  rope_ab)      # session 21: RoPE in the one-split flash kernel -- its GPU test (bits against RoPE around the kernel),
                # then the step A/B in one call (ROPE_IN_KERNEL off / on) at ROPE_POINTS (default 4K and 16K prefill)
    timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_sparse_attention.py -k rope \
      > "$OUT/pytest_rope.log" 2>&1
    echo "== rope test (rc $?)"; grep -E "rope B|passed|failed|Error" "$OUT/pytest_rope.log" | head -8
    timeout 400 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --decode \
      ${ROPE_POINTS:---prefill 4096@0 16384@0} --variants moeil_ropex,moeil_ropek --profile-no-cb --no-ceilings \
      --out "$OUT" > "$OUT/step_rope.log" 2>&1
    echo "== step profile (rc $?)"; grep -E "^(point|prefill|decode) |^== " "$OUT/step_rope.log" | tail -8
    ;;
  s22_tests)    # session 22: the GPU checks of the session's kernel changes -- RoPE in the flash kernel (bits against
                # RoPE around it), the top-k read to visible (bits), the indexer's convert-alone rounding (bits, 25 cases)
    timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_sparse_attention.py -k rope \
      > "$OUT/pytest_rope.log" 2>&1
    echo "== rope test (rc $?)"; grep -E "rope B|passed|failed|Error" "$OUT/pytest_rope.log" | head -8
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_topk_triton.py -k masked > "$OUT/pytest_topk.log" 2>&1
    echo "== topk masked test (rc $?)"; tail -3 "$OUT/pytest_topk.log"
    timeout ${HW_TIMEOUT:-150} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_indexer.py -k hw_round \
      > "$OUT/pytest_hw.log" 2>&1
    echo "== indexer hw_round 1 / 2 test (rc $?)"; grep -E "differing [1-9]|passed|failed|Error" "$OUT/pytest_hw.log" | tail -6
    ;;
  s22_all)      # session 22, one call when machines are scarce: the bit checks, then the 16K four-way step A/B (~9.5 min)
    HW_TIMEOUT=120 bash "$0" s22_tests
    STEP16_TIMEOUT=270 STEP4_SKIP=1 bash "$0" s22_step
    ;;
  s22_step)     # session 22: the step A/B of the session's changes in one call: 16K with RoPE around / in the kernel,
                # the top-k reading whole rows, the convert-alone rounding; then 4K around / in
    timeout ${STEP16_TIMEOUT:-300} python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --decode --prefill 16384@0 \
      --variants moeil_ropex,moeil_ropek,moeil_fullrows,moeil_cvt --profile-no-cb --no-ceilings --out "$OUT" \
      > "$OUT/step_s22_16k.log" 2>&1
    echo "== step 16K (rc $?)"; grep -E "^(point|prefill) |^== " "$OUT/step_s22_16k.log" | tail -6
    cp "$OUT/step_profile.json" "$OUT/step_profile_16k.json" 2>/dev/null
    if [ -z "${STEP4_SKIP:-}" ]; then
      timeout 150 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --decode --prefill 4096@0 \
        --variants moeil_ropex,moeil_ropek --profile-no-cb --no-ceilings --out "$OUT" > "$OUT/step_s22_4k.log" 2>&1
      echo "== step 4K (rc $?)"; grep -E "^(point|prefill) |^== " "$OUT/step_s22_4k.log" | tail -4
    fi
    ;;
  moe_gu)       # session 13's queue item 3: split gate/up, bit identity then timing and ncu
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_layout.py -k split_gate_up > "$OUT/pytest_gu.log" 2>&1
    echo "== split_gate_up bit identity (rc $?)"; tail -3 "$OUT/pytest_gu.log"
    MOE_CONFIGS=sw_il,sw_il_gu,sw_il_gu_xb,sw_il_bm32,sw_il_bm32_gu moe_bench sw_il_gu 3   # up, epilogue, down
    ;;
  moe_prefill)  # sessions 16-17: wide il prefill candidates against the serving bands' tiles (predictions: NOTES):
                # the launch orders (n_fast, group_m) bit-identical to their bases on the GPU first, then the bench,
                # then the DRAM bytes of the base and the _nf order (session 17's _nf profile crashed under ncu)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_layout.py -k launch_order > "$OUT/pytest_order.log" 2>&1
    echo "== launch orders bit-identical (rc $?)"; tail -3 "$OUT/pytest_order.log"
    timeout 330 python3 -m dsflash.bench kernels --ops moe --tokens 1024,4096,16384 --quick --no-torch --out "$OUT" \
      --prefill-configs ${PREFILL_CONFIGS:-sw_il_bm64_xb,sw_il_bm128,sw_il_bm128_nf,sw_il_bm128_nf_g4,sw_il_bm128_nf_g8,sw_il_bm128_gu_xb,sw_il_bm128_gu_xb_nf,sw_il_bm64_gu_xb_s2} \
      > "$OUT/bench_moe_prefill.log" 2>&1
    echo "== bench kernels moe prefill (rc $?)"; grep -v '^{' "$OUT/bench_moe_prefill.log" | tail -14
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ "${NCU_MOE:-1}" != 0 ] && [ -n "$NCU" ] && for cn in ${NCU_CONFIGS:-sw_il_bm128_nf:2 sw_il_bm128_nf_g8:2}; do   # config:launches
      c=${cn%:*} n=${cn#*:}     # profile the second call's launches (the first call compiles)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 100 "$NCU" --clock-control none --target-processes all \
        --kernel-name regex:_moe_ --launch-skip "$n" --launch-count "$n" \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 scripts/moe_profile_target.py --config "$c" --tokens 4096 --reps 1 > "$OUT/ncu_moe_prefill_$c.log" 2>&1
      echo "== ncu $c T=4096 (rc $?)"
      grep -E "_moe_|gpu__time|dram__bytes|lts__t_sector|sm__throughput" "$OUT/ncu_moe_prefill_$c.log" | head -24
    done
    ;;
  indexer_hw)   # sessions 17 / 22: the indexer scorer's hardware bf16 rounding (hw_round 1) and the convert alone
                # (hw_round 2), bits against the integer rounding, then time (NOTES "hw_round", "Session 22")
    SKIP_TESTS=0 PYTEST_K="hw_round" TEST_TIMEOUT=240 BENCH_TIMEOUT=300 OUT="$OUT" bash scripts/gpu_kernels_run.sh \
      --ops indexer --indexer-shapes 1x4096x4096,1x16384x16384 --indexer-hw-round --reps 3 > "$OUT/indexer_hw.log" 2>&1
    echo "== indexer hw_round (rc $?)"; grep -E "passed|failed|hw-round|scores-only|same bits" "$OUT/indexer_hw.log" | tail -20
    ;;
  adaptive_switch)  # session 17: what switching the adaptive engine's decode programs costs (issue 23; NOTES)
    timeout 200 python3 scripts/adaptive_switch_cost.py --batch 32 --parts catchup,switch --repeats 30 \
      --json "$OUT/switch.json" > "$OUT/switch.log" 2>&1
    echo "== switch cost (rc $?)"; tail -12 "$OUT/switch.log"
    eng32 eng32 64 9 170
    ;;
  fp8_stalls)   # session 26: why the dense FP8 decode launches run at ~0.45-0.8 TB/s (a 192-row step: o_proj, q_proj, the
                # shared expert 1.43 ms against ~0.27 of floor): Nsight Compute's stall reasons, issue activity and DRAM
                # bytes of FP8_SHAPES at FP8_ROWS rows, the picked config (FP8_CONFIG overrides)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    M=$(stall_metrics)
    [ -n "$NCU" ] && for sh in ${FP8_SHAPES:-sh_w13 wo_b wq_b}; do
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 120 "$NCU" --clock-control none --target-processes all \
        --kernel-name regex:_fp8_linear --launch-skip 2 --launch-count 2 --metrics "$M" \
        python3 scripts/fp8_profile_target.py --shape "$sh" --rows "${FP8_ROWS:-192}" ${FP8_CONFIG:+--config $FP8_CONFIG} \
        --reps 2 > "$OUT/ncu_fp8_$sh.log" 2>&1
      echo "== ncu fp8 $sh rows ${FP8_ROWS:-192} (rc $?)"; grep -E "^$sh |_fp8_linear" "$OUT/ncu_fp8_$sh.log" | head -4
      grep -E "gpu__|smsp__|sm__|launch__|dram__" "$OUT/ncu_fp8_$sh.log" | sed 's/smsp__average_warps_issue_stalled_//' | head -48
    done
    ;;
  indexer_stalls)  # session 28: the paged indexer scorer, 1.05 + 0.53 ms of the 32 x 6 @ 128K step (its op at 19 % of
                # its floor; the 128K / 4K target binds on it): Nsight Compute's stall reasons, issue activity, DRAM
                # bytes at 128K (one call of gpu_indexer_split.py), then the scorer timed at 2 and 3 stages (~3 min).
                # `--parts paged`: the whole script segfaulted under ncu (session 29, with and without jax-triton:
                # an XLA sort is the suspect)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    M=$(stall_metrics)
    [ -n "$NCU" ] && XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 200 "$NCU" --clock-control none --target-processes all \
      --kernel-name regex:_indexer_paged --launch-skip 1 --launch-count 1 --metrics "$M" \
      python3 scripts/gpu_indexer_split.py --contexts ${INDEXER_CONTEXT:-131072} --seqs 32 --rows 6 --reps 1 \
      --parts paged --out "$OUT" > "$OUT/ncu_indexer.log" 2>&1
    echo "== ncu indexer (rc $?)"
    grep -E "_indexer_paged|gpu__|smsp__|sm__|launch__|dram__" "$OUT/ncu_indexer.log" | sed 's/smsp__average_warps_issue_stalled_//' | head -30
    # the paged scorer at 2 (default) and 3 stages (indexer_paged_triton.NUM_STAGES; session 29's sm_90 study), timed
    timeout 150 python3 scripts/gpu_indexer_split.py --contexts 131072 32768 --seqs 32 --rows 6 --reps 10 \
      --parts paged --paged-stages 3 --out "$OUT" > "$OUT/indexer_stages.log" 2>&1
    echo "== paged scorer, stages 2 / 3 (rc $?)"
    grep -o '"context": [0-9]*\|"scores_paged[a-z0-9_]*": [0-9.]*\|"paged_s3_equal": [a-z]*' "$OUT/indexer_stages.log" | paste -sd' '
    ;;
  fp8_sweep)    # session 27: the decode band's config against kernels/experimental/fp8_configs.py's candidates at
                # FP8_ROWS (192) for FP8_SWEEP_SHAPES, kernel busy time per call (scripts/gpu_fp8_linear_sweep.py)
    timeout "${FP8_SWEEP_TIMEOUT:-300}" python3 scripts/gpu_fp8_linear_sweep.py --rows ${FP8_ROWS:-192} \
      --shapes ${FP8_SWEEP_SHAPES:-wo_b wq_b shared_w13} --reps 5 --out "$OUT" \
      --configs ${FP8_SWEEP_CONFIGS:-decode_bn128 dec_bn64_bm256_bk64 dec_bn64_bm256_bk64_s4 dec_bn128_w8} \
      > "$OUT/fp8_sweep.log" 2>&1
    echo "== fp8 sweep (rc $?)"; grep -v "^{" "$OUT/fp8_sweep.log" | tail -12
    ;;
  fp8_lastred)  # session 27 (~8 min): the last-program split-K reduce -- its GPU bit-identity test, the sweep at 6 and
                # 192 rows against decode_bn128 and the one-row-tile candidate, then the decode step with each
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_linear.py -k "last_program or named_configs" \
      > "$OUT/pytest_lastred.log" 2>&1
    echo "== GPU tests (rc $?)"; tail -3 "$OUT/pytest_lastred.log"
    FP8_ROWS="6 192" FP8_SWEEP_SHAPES="wq_a wo_b shared_w13 shared_w2" FP8_SWEEP_TIMEOUT=200 \
      FP8_SWEEP_CONFIGS="decode_bn128 dec_bn128_lastred dec_bn64_bm256_bk64" bash "$0" fp8_sweep
    STEP_POINTS="--decode 32@4096 1@4096" STEP_VARIANTS=moeil,moeil_lastred,moeil_fp8bm256 bash "$0" prefill_step
    ;;
  fp8_planes)   # session 28 (~7 min): the E4M3 bit-placement decode (Fp8LinearConfig.planes) -- its GPU tests against
                # the XLA path (16 cases + the large-scale fallback), the sweep at 6 / 192 rows against decode_bn128,
                # then the decode step (32 x 6 and 1 x 6 @ 4K) with moeil / moeil_planes
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_linear.py -k "planes" \
      > "$OUT/pytest_planes.log" 2>&1
    echo "== GPU tests (rc $?)"; tail -3 "$OUT/pytest_planes.log"
    FP8_ROWS="6 192" FP8_SWEEP_SHAPES="wq_a wq_b wo_b shared_w13 shared_w2" FP8_SWEEP_TIMEOUT=200 \
      FP8_SWEEP_CONFIGS="decode_bn128 dec_bn128_planes" bash "$0" fp8_sweep
    STEP_POINTS="--decode 32@4096 1@4096" STEP_VARIANTS=moeil,moeil_planes bash "$0" prefill_step
    ;;
  mixed_ab)     # session 27 (issue 23): the mixed-step A/B with passes of seconds, not tenths (session 27's 32-prompt
                # passes spread +-25 %): MIXED_PROMPTS (128) chat prompts through MIXED_SEQS (8, 32) sequences, 5 passes
    for seqs in ${MIXED_SEQS:-8 32}; do
      timeout "${MIXED_TIMEOUT:-270}" python3 -m dsflash.bench engine --model demo --chat-prompts \
        --num-prompts "${MIXED_PROMPTS:-128}" --max-num-seqs "$seqs" --max-tokens 64 --passes 5 \
        --modes adaptive,adaptive_mixed,plain --json "$OUT/mixed_$seqs.json" --compilation-cache-dir /tmp/cc \
        > "$OUT/mixed_$seqs.log" 2>&1
      echo "== mixed A/B, $seqs sequences (rc $?)"; grep -E "/ plain|^\[" "$OUT/mixed_$seqs.log" | tail -6
    done
    ;;
  moe_stalls)   # sessions 18-19: why the il prefill kernels run at 200-360 TFLOP/s of bf16 wgmma with their bytes in L2:
                # stall reasons per issued instruction by metric (ncu's section set segfaulted, session 19), 4096 tokens
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    M=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
    for r in barrier membar long_scoreboard short_scoreboard math_pipe_throttle wait mio_throttle lg_throttle \
             not_selected selected dispatch_stall no_instruction branch_resolving drain; do
      M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
    done
    M=$M${NCU_EXTRA:+,$NCU_EXTRA}   # e.g. session 20's L2 traffic: lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed
    [ -n "$NCU" ] && for ct in ${NCU_CONFIGS:-sw_il_bm128_nf_g8_hp_xp_dp}; do   # config or config:tokens (4096)
      c=${ct%%:*}; t=4096; [ "$ct" != "$c" ] && t=${ct#*:}
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 150 "$NCU" --clock-control none --target-processes all \
        --kernel-name regex:_moe_ --launch-skip "${NCU_SKIP:-2}" --launch-count "${NCU_COUNT:-2}" --metrics "$M" \
        python3 scripts/moe_profile_target.py --config "$c" --tokens "$t" --reps 1 > "$OUT/ncu_stalls_${c}_T$t.log" 2>&1
      echo "== ncu stalls $c T=$t (rc $?)"
      grep -E "_moe_|gpu__|smsp__|sm__|launch__|lts__|dram__" "$OUT/ncu_stalls_${c}_T$t.log" | sed 's/smsp__average_warps_issue_stalled_//' | head -${NCU_LINES:-60}
    done
    ;;
  moe_decode_stalls)  # session 28: the routed-expert decode kernels (the step's largest share, ~56 % of their byte
                # floor) under Nsight Compute at the serving bands' points: 192 tokens (32 x 6, sw_il_bm32) and 6 (1 x 6,
                # sw_il); stall reasons, issue activity, registers, DRAM bytes (~1 min)
    # every _moe_ launch of both calls (compile call + one rep: up, down and, where K is split, their epilogues);
    # NCU_EXTRA adds metrics -- with dram__throughput's pct, smsp__inst_executed and lts__t_bytes ncu segfaulted (s28)
    NCU_CONFIGS="${NCU_CONFIGS:-sw_il_bm32:192 sw_il:6}" NCU_SKIP=0 NCU_COUNT=8 \
      NCU_EXTRA="${NCU_EXTRA:-dram__bytes_read.sum}" \
      NCU_LINES=200 bash "$0" moe_stalls
    ;;
  moe_sd3)      # session 28: the bm32 band's down kernel at 3 stages (6 programs per SM, was 4): kernel times at 192 /
                # 384 tokens (32 / 64 x 6), then the decode step with it (~5 min)
    timeout 200 python3 -m dsflash.bench kernels --ops moe --tokens 192,384 --quick --no-torch --out "$OUT" \
      --decode-configs sw_il_bm32,sw_il_bm32_sd3,sw_il > "$OUT/bench_moe_sd3.log" 2>&1
    echo "== bench kernels moe (rc $?)"; tail -14 "$OUT/bench_moe_sd3.log"
    STEP_POINTS="--decode 32@4096 64@4096" STEP_VARIANTS=moeil,moeil_sd3 bash "$0" prefill_step
    ;;
  moe_ladder)   # session 29: the il decode ladder (scripts/gpu_moe_ladder.py): the routed-expert decode kernels' loop
                # taken apart (loads / + decode / + x slab / + MMA; MoeConfig.probe) at 6 tokens (sw_il) and 192
                # (sw_il_bm32), up and down kernels timed apart from a profiler trace, each rung as compiled and with
                # its programs per SM pinned to the kernel's; rung 0 checked against the reference first (~3-4 min).
                # Files: moe_ladder.json / .log, moe_ladder_sm90.json / .log
    timeout 330 python3 scripts/gpu_moe_ladder.py --out "$OUT" > "$OUT/moe_ladder.log" 2>&1
    echo "== moe ladder (rc $?)"; grep -E "streaming read|rung 0 vs|^read |^ *T |^ *(6|192) " "$OUT/moe_ladder.log" | tail -45
    ;;
  moe_ladder2)  # session 30: ladder 2, the up kernel's load stream (its rung 1 ran at the kernel's 1.8 TB/s on the H100,
                # the down kernel's at 2.4-2.5): rungs 0 / 1 / 5 no scales / 6 contiguous scale words / 7 W1 only / 8
                # one matrix a program (split_gate_up), free and pinned, at 6 and 192 tokens; the stream probe at the
                # up and down kernels' buffers (gpu_moe_stream_probe.py --shape); then Nsight Compute on the 192-token
                # launches of LADDER2_NCU_VARIANTS (two metric passes: the stall list, then memory) (~6-7 min).
                # Files: moe_ladder2.json / .log, moe_ladder2_sm90.json / .log, stream_up.json / .log,
                # stream_down.json / .log, ncu_ladder2_{A,B}.log, ncu_ladder2_summary.txt, ncu_query.txt
    mkdir -p "$OUT/ladder2"
    timeout 220 python3 scripts/gpu_moe_ladder.py --rungs 0,1,5,6,7,8 --out "$OUT/ladder2" > "$OUT/moe_ladder2.log" 2>&1
    echo "== moe ladder 2 (rc $?)"; grep -E "streaming read|rung 0 vs|sm_90 compile child" "$OUT/moe_ladder2.log" | tail -4
    mv "$OUT/ladder2/moe_ladder.json" "$OUT/moe_ladder2.json" 2>/dev/null
    mv "$OUT/ladder2/moe_ladder_sm90.json" "$OUT/moe_ladder2_sm90.json" 2>/dev/null
    mv "$OUT/ladder2/moe_ladder_sm90.log" "$OUT/moe_ladder2_sm90.log" 2>/dev/null; rmdir "$OUT/ladder2" 2>/dev/null
    timeout 130 python3 scripts/gpu_moe_stream_probe.py --shape up --json "$OUT/stream_up.json" > "$OUT/stream_up.log" 2>&1
    echo "== stream probe, up buffers (rc $?)"
    timeout 60 python3 scripts/gpu_moe_stream_probe.py --shape down --order expert --json "$OUT/stream_down.json" \
      > "$OUT/stream_down.log" 2>&1
    echo "== stream probe, down buffers (rc $?)"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    V=${LADDER2_NCU_VARIANTS:-0:free,1:pinned,5:pinned,6:pinned,7:pinned}
    NV=$(( $(echo "$V" | tr ',' '\n' | wc -l) * 2 ))      # il launches a pass: up + down a variant, after as many warm-up ones
    MA=$(stall_metrics)
    MB=""    # the memory pass, only metrics this ncu knows (an unknown name fails the whole pass)
    [ -n "$NCU" ] && "$NCU" --query-metrics > "$OUT/ncu_query.txt" 2>&1
    for m in gpu__time_duration.sum dram__bytes_read.sum dram__throughput.avg.pct_of_peak_sustained_elapsed \
             lts__t_sector_hit_rate.pct l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum \
             l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum \
             l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum lts__t_sectors_srcunit_tex_op_read.sum \
             launch__occupancy_limit_shared_mem launch__shared_mem_per_block_dynamic; do
      if [ "$(wc -l < "$OUT/ncu_query.txt" 2>/dev/null || echo 0)" -lt 100 ] || grep -qE "^${m%%.*}([[:space:]]|$)" "$OUT/ncu_query.txt"; then
        MB=${MB:+$MB,}$m
      else
        echo "ncu: no metric ${m%%.*} here, left out"
      fi
    done
    ncu_pass() {  # tag, metrics
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 150 "$NCU" --clock-control none --target-processes all \
        --kernel-name regex:"_moe_(up|down)_kernel_il" --launch-skip "$NV" --launch-count "$NV" --metrics "$2" \
        python3 scripts/gpu_moe_ladder.py --ncu-target --plan 192:sw_il_bm32 --ncu-variants "$V" --pin-blocks 4,4 \
        > "$OUT/ncu_ladder2_$1.log" 2>&1
      echo "== ncu ladder 2, pass $1 (rc $?; $(grep -c '^  _moe_' "$OUT/ncu_ladder2_$1.log") kernels)"
    }
    if [ -n "$NCU" ]; then
      ncu_pass A "$MA"
      ncu_pass B "$MB"
      if ! grep -q '^  _moe_' "$OUT/ncu_ladder2_B.log" && [ "$SECONDS" -lt 430 ]; then   # s28: a list with dram's pct segfaulted
        mv "$OUT/ncu_ladder2_B.log" "$OUT/ncu_ladder2_B_failed.log"
        ncu_pass B "$(echo "$MB" | tr ',' '\n' | grep -v '^dram__throughput' | paste -sd,)"
      fi
      python3 scripts/gpu_moe_ladder.py --plan 192:sw_il_bm32 --ncu-variants "$V" \
        --ncu-summary "$OUT/ncu_ladder2_A.log" "$OUT/ncu_ladder2_B.log" > "$OUT/ncu_ladder2_summary.txt" 2>&1
    else
      echo "no ncu on this machine" > "$OUT/ncu_ladder2_summary.txt"
    fi
    echo "== tables ($SECONDS s)"
    grep -E "^read |^ *T |^ *(6|192) " "$OUT/moe_ladder2.log" | tail -50
    sed -n '/^mats /,$p' "$OUT/stream_up.log" | head -40
    sed -n '/^mats /,$p' "$OUT/stream_down.log" | head -12
    cat "$OUT/ncu_ladder2_summary.txt"
    ;;
  moe_tm)       # session 30: the tile-major il layout revived with blocked scales (MoeConfig.tile_major 1 / 2,
                # moe_layout.to_tiles; CPU-built, not run on a GPU before): the GPU bit identity of sw_il[_bm32]_tm /
                # _tm2 with plain il at 6 and 192 tokens, then the ladder's rungs 0 (kernel) and 1 (loads only), free
                # and pinned, for sw_il / _tm / _tm2 at 6 tokens and sw_il_bm32 / _tm / _tm2 at 192 (~4-5 min).
                # Files: pytest_tm.log, moe_tm.json / .log, moe_tm_sm90.json / .log
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_layout.py -k tile_major \
      > "$OUT/pytest_tm.log" 2>&1
    echo "== GPU bit identity, tile-major vs plain il (rc $?)"; grep -E "bit-identical to|passed|failed" "$OUT/pytest_tm.log" | tail -10
    mkdir -p "$OUT/tm"
    timeout 300 python3 scripts/gpu_moe_ladder.py --rungs 0,1 --out "$OUT/tm" \
      --plan 6:sw_il,6:sw_il_tm,6:sw_il_tm2,192:sw_il_bm32,192:sw_il_bm32_tm,192:sw_il_bm32_tm2 > "$OUT/moe_tm.log" 2>&1
    echo "== moe ladder, tile-major (rc $?)"; grep -E "streaming read|rung 0 vs|sm_90 compile child" "$OUT/moe_tm.log" | tail -8
    mv "$OUT/tm/moe_ladder.json" "$OUT/moe_tm.json" 2>/dev/null
    mv "$OUT/tm/moe_ladder_sm90.json" "$OUT/moe_tm_sm90.json" 2>/dev/null
    mv "$OUT/tm/moe_ladder_sm90.log" "$OUT/moe_tm_sm90.log" 2>/dev/null; rmdir "$OUT/tm" 2>/dev/null
    echo "== table ($SECONDS s)"
    grep -E "^read |^ *T |^ *(6|192) " "$OUT/moe_tm.log" | tail -40
    ;;
  mhc_rows)     # session 28: mHC's kernel B one token a program (mhc_fused_plan.EPI_ROWS_BELOW): its GPU test, then the
                # decode step at 1 / 8 / 32 x 6 @ 4K with moeil_epiblk (the token blocks) / moeil (one token a
                # program: the default since session 29) (~4 min)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mhc.py -k "one_token_a_program" \
      > "$OUT/pytest_mhc_rows.log" 2>&1
    echo "== GPU tests (rc $?)"; tail -3 "$OUT/pytest_mhc_rows.log"
    STEP_POINTS="--decode 1@4096 8@4096 32@4096" STEP_VARIANTS=moeil_epiblk,moeil bash "$0" prefill_step
    ;;
  moe_xbs3)     # session 28: x dequantised once before the up kernel, at 3 stages, in both decode bands: kernel times at
                # 6 / 48 / 192 / 384 tokens, then the decode step with it at 1 / 32 x 6 @ 4K (~5 min)
    timeout 240 python3 -m dsflash.bench kernels --ops moe --tokens 6,48,192,384 --quick --no-torch --out "$OUT" \
      --decode-configs sw_il,sw_il_xb_s3,sw_il_bm32,sw_il_bm32_xb_s3 > "$OUT/bench_moe_xbs3.log" 2>&1
    echo "== bench kernels moe (rc $?)"; grep -E "^  T=" "$OUT/bench_moe_xbs3.log" | tail -6
    STEP_POINTS="--decode 32@4096 1@4096" STEP_VARIANTS=moeil,moeil_xbs3 bash "$0" prefill_step
    ;;
  s28_ncu)      # session 28's two Nsight Compute items in one call (~3 min): the down kernel at 3 stages (did 6 CTAs a
                # SM run?), then the paged indexer scorer at 128K
    NCU_CONFIGS="sw_il_bm32_sd3:192" bash "$0" moe_decode_stalls
    bash "$0" indexer_stalls
    ;;
  decode_glue)  # session 18: which XLA fusions the 32 x 6 decode step's concatenations are (0.42 ms a step in four
                # input_concatenate fusions, sparse_attention / kv_gather / attention_other scopes): the HLO beside them
    timeout 300 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --decode 32@4096 \
      --variants moeil --profile-no-cb --dump-hlo --out "$OUT" > "$OUT/step_glue.log" 2>&1
    echo "== step profile (rc $?)"; grep -v '^{' "$OUT/step_glue.log" | grep -E "^==|^sparse_att|^kv_gather|^attention_other|^decode" | head
    for f in "$OUT"/hlo_*.txt; do grep -E "^ *(ROOT )?%?input_concatenate_fusion(\.[0-9]+)? = " "$f" | cut -c1-400; done
    ;;
  mhc_prefill)  # session 20: the fused mHC kernel A at prefill sizes (~30 % of the read bandwidth at 4K / 16K tokens
                # in the step), hardware bf16 rounding and smaller tiles (more warps a SM); max_diff_vs_default_* = bits
    timeout 400 python3 -m dsflash.bench kernels --ops mhc --mhc-tokens ${MHC_TOKENS:-4096,16384} --quick --out "$OUT" \
      --mhc-plans ${MHC_PLANS:-hw=hw_round:1,t32=BT:32/BD:32,hw_t32=BT:32/BD:32/hw_round:1,hw_t16=BT:16/BD:64/hw_round:1} \
      > "$OUT/bench_mhc.log" 2>&1
    echo "== bench kernels mhc (rc $?)"; grep -vE '^\{' "$OUT/bench_mhc.log" | tail -30
    python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/kernels_*.json"):
    for r in json.load(open(f)).get("mhc", []):
        print(r["T"], {k: (round(v * 1e3, 4) if k.endswith("_s") else v) for k, v in r.items()
                       if k.endswith("_s") or k.startswith("max_diff") or k.startswith("rel_err")})
PY
    ;;
  prefill_step) # session 19's queue item 1: the whole step per op with the session's MoE default and in-GEMM rounding
    timeout 560 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton \
      ${STEP_POINTS:---decode 32@4096 --prefill 4096@0 16384@0} --variants ${STEP_VARIANTS:-moeil} --profile-no-cb --out "$OUT" \
      > "$OUT/prefill_step.log" 2>&1
    echo "== step profile (rc $?)"; grep -E "^(point|decode|prefill) " "$OUT/prefill_step.log" | tail -8
    ;;
  guided)       # issue 22 item 4 on the GPU: structured output's cost (free / json / mixed, speculation off / on)
    timeout ${GUIDED_TIMEOUT:-240} python3 -m dsflash.bench guided --model demo --speculative-modes off,always \
      --passes 2 --json "$OUT/guided.json" > "$OUT/guided.log" 2>&1
    echo "== guided (rc $?)"; grep -E "^(mask cost|\[)" "$OUT/guided.log" | tail -14
    ;;
  targets)      # issue 19's target grid beside prefill_step's points (decode 1 / 8 / 64 x 6 @ 4K, 32 x 6 @ 32K / 128K), ceilings
                # measured in the same call (~5 min); TARGET_POINTS="--decode ... --prefill ..." overrides
    timeout ${TARGETS_TIMEOUT:-570} python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton \
      ${TARGET_POINTS:---decode 1@4096 8@4096 64@4096 32@32768 32@131072 --prefill} --variants moeil \
      --profile-no-cb --out "$OUT" > "$OUT/targets.log" 2>&1
    echo "== targets (rc $?)"; grep -E "^(point|decode|prefill) |^ceilings \(" "$OUT/targets.log" | tail -12
    ;;
  gluon)        # session 25: Gluon kernels through jax-triton (the launch path, then the prefill flash kernel's GPU
                # test), then the Gluon flash kernel against flash_bk64_s2 at 4096 / 16384 prefill rows
    timeout 180 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gluon_launch.py \
      tests/gpu/test_sparse_attention_gluon.py > "$OUT/pytest_gluon.log" 2>&1
    RC=$?; echo "== gluon tests (rc $RC)"; grep -E "^.?gluon (ov|ws)|passed|failed|Error|error" "$OUT/pytest_gluon.log" | head -30
    CONFIGS=${ATTN_CONFIGS:-flash_bk64_s2,gluon_ov0,gluon_ws}
    if [ "$RC" = 124 ] || grep -q "FAILED.*-ws\]" "$OUT/pytest_gluon.log"; then   # a hang or a wrong ws kernel: not timed
      CONFIGS=${CONFIGS//,gluon_ws/}; echo "gluon_ws left out of the probe"
    fi
    timeout 150 python3 scripts/gpu_attn_prefill_probe.py --tokens 4096 16384 --no-paged --json "$OUT/attn_gluon.json" \
      --configs "$CONFIGS" > "$OUT/attn_gluon.log" 2>&1
    echo "== attn prefill, gluon (rc $?)"; sed -n '/^tokens /,$p' "$OUT/attn_gluon.log" | head -20
    grep -E "error" "$OUT/attn_gluon.log" | head -5
    # the step A/B (gluon_ov0 in the model) only if ov0 passed its tests; the channel-split kernel's do not gate it
    if [ "$RC" != 124 ] && grep -q "passed" "$OUT/pytest_gluon.log" && ! grep -q "FAILED.*\(-ov0\]\|test_gluon_launch\)" \
        "$OUT/pytest_gluon.log" && [ "${GLUON_STEP:-1}" = 1 ]; then
      timeout 220 python3 scripts/gpu_step_profile.py --preset "$MODEL" --backend triton --prefill 16384@0 \
        --variants moeil_nogluon,moeil --profile-no-cb --no-ceilings --out "$OUT" > "$OUT/step_gluon.log" 2>&1
      echo "== step profile, gluon (rc $?)"; grep -E "^(point|decode|prefill) |^sparse_attention " "$OUT/step_gluon.log" | tail -8
    fi
    ;;
  attn_prefill) # session 23: the flash kernel at prefill shapes vs the paged (NVFP4-reading) kernel and flash configs,
                # then Nsight Compute's L2 / DRAM traffic, tensor and issue activity and stall reasons at 4096 tokens
    timeout 240 python3 scripts/gpu_attn_prefill_probe.py --tokens 4096 16384 --json "$OUT/attn_prefill.json" \
      --configs ${ATTN_CONFIGS:-flash_bk64,flash_bk32,flash_bk64_s2,flash_bk32_w16} \
      > "$OUT/attn_prefill.log" 2>&1
    echo "== attn prefill (rc $?)"; sed -n '/^tokens /,$p' "$OUT/attn_prefill.log" | head -20
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    M=gpu__time_duration.sum,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
    M=$M,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
    M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
    for r in barrier long_scoreboard short_scoreboard math_pipe_throttle wait mio_throttle lg_throttle selected; do
      M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
    done
    for m in "$M" ${NCU_TENSOR:+sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active}; do
      [ -n "$NCU" ] && XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 150 "$NCU" --clock-control none --target-processes all \
        --kernel-name regex:"_flash_kernel|_paged_kernel" --launch-count 2 --metrics "$m" \
        python3 scripts/gpu_attn_prefill_probe.py --tokens 4096 --configs flash_bk64 --once >> "$OUT/ncu_attn_prefill.log" 2>&1
      echo "== ncu (rc $?)"
    done
    grep -E "_flash_kernel|_paged_kernel|gpu__|smsp__|sm__|launch__|lts__|dram__|l1tex__" "$OUT/ncu_attn_prefill.log" \
      | sed 's/smsp__average_warps_issue_stalled_//' | head -60
    ;;
  gluon_stalls) # session 26: where the Gluon flash kernel's ~6,500 cycles a block go (~2,050 of tensor work): Nsight
                # Compute's stall reasons, issue and tensor-pipe activity of flash_gluon_kernel at GLUON_ROWS (16384)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    M=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
    M=$M,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,lts__t_bytes.sum
    M=$M,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active
    for r in barrier membar long_scoreboard short_scoreboard math_pipe_throttle wait mio_throttle lg_throttle \
             not_selected selected dispatch_stall no_instruction branch_resolving sleeping; do
      M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
    done
    [ -n "$NCU" ] && XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 200 "$NCU" --clock-control none --target-processes all \
      --kernel-name regex:flash_gluon_kernel --launch-count 1 --metrics "$M" \
      python3 scripts/gpu_attn_prefill_probe.py --tokens "${GLUON_ROWS:-16384}" --configs gluon_ov0 --no-paged --once \
      > "$OUT/ncu_gluon.log" 2>&1
    echo "== ncu gluon (rc $?)"
    grep -E "flash_gluon|gpu__|smsp__|sm__|launch__|lts__|dram__|l1tex__" "$OUT/ncu_gluon.log" \
      | sed 's/smsp__average_warps_issue_stalled_//' | head -40
    ;;
  s23_all)      # session 23, one call: the per-op step with ceilings (decode 32 x 6, 4K, 16K), then the guided bench
    bash "$0" prefill_step
    GUIDED_TIMEOUT=200 bash "$0" guided
    ;;
  s23_a)        # session 23, issue 19 in one call (~9 min): the in-place RoPE's GPU test, then the per-op step with
                # ceilings (decode 32 x 6, prefill 4K / 16K), RoPE by concatenation / in place
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_rope_triton.py > "$OUT/pytest_rope_inplace.log" 2>&1
    echo "== in-place RoPE GPU test (rc $?)"; tail -3 "$OUT/pytest_rope_inplace.log"
    STEP_VARIANTS=moeil_ropex,moeil_ropei bash "$0" prefill_step
    ;;
  s23_b)        # session 23 (~8 min): attention alone at prefill shapes (+ ncu), then the guided bench (issue 22)
    bash "$0" attn_prefill
    GUIDED_TIMEOUT=180 bash "$0" guided
    ;;
  spec_long)    # session 18 (issue 23): batch 32 with outputs long enough for decode to dominate (256 tokens), 5 passes
    eng32 eng32long 256 5 260 384   # prompts up to 128 tokens (chat) / 48 (documentation) + 256 out
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
  *) echo "usage: $0 engine|mhc_overhead|draft|moe_decode|step_mhc|ffi|loop_ab|paged|moe_gu|moe_prefill|indexer_hw|adaptive_switch|moe_stalls|decode_glue|spec_long|prefill_step|mhc_prefill|rope_ab|s22_tests|s22_step|s22_all|guided|s23_all|s23_a|s23_b|targets|attn_prefill|gluon|fp8_stalls|fp8_sweep|fp8_lastred|fp8_planes|mixed_ab|moe_decode_stalls|moe_sd3|moe_xbs3|moe_ladder|moe_ladder2|moe_tm|mhc_rows|indexer_stalls|s28_ncu|gluon_stalls|kernels"; exit 2 ;;
esac
ls -la "$OUT"
