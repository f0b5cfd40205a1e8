#!/usr/bin/env bash
# Supervised chat stage of the demo model on one GPU (issue 22 item 3): fine-tune the shipped target on conversations
# built from CPython's docs (dsflash/train/chat_data.py; V4.1 chat template, thinking blocks, DSML tool calls) mixed
# with documentation rows, export, then measure: held-out chat loss and documentation perplexity (metrics.json),
# DSpark acceptance through the engine on documentation and chat prompts (spec.json), real chat exchanges and a tool
# call round trip (chat_samples.json). From the repo root, wheels installed on PYTHONPATH (README of the device):
#
#   bash scripts/gpu_train_chat.sh train [extra python -m dsflash.train args]   # < 10 min
#   bash scripts/gpu_train_chat.sh eval [CHECKPOINT [spec_eval args]]   # < 10 min; default /tmp/chat_run/checkpoint
#   bash scripts/gpu_train_chat.sh all [extra args]     # both, one after the other
#
# Two phases because the device runs one command for at most 10 minutes. Extra train args come last, so they
# override the defaults below (argparse: the last value wins), e.g. --sft-steps 3000 --max-sft-seconds 240 or
# --draft-steps 2000 (then the draft retrains on the fine-tuned target as served; by default it is the shipped one).
# train returns: the checkpoint's safetensors shards (two of ~8 MB), checkpoint_rest.tgz (config, index, tokenizer,
# training.json, heldout_rows.npy, log.jsonl, loss.png), metrics.json, train.log; eval: spec.json,
# chat_samples.json, eval.log. At most 7 files, each < 16 MB.
set -u
PHASE=${1:-all}; shift || true
OUT=${OUT:-out}; mkdir -p "$OUT"
# autotuning off: tiny shapes, and it made the first draft step of gpu_train_draft.sh take 177 s (docs/training.md)
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
# JAX_PLATFORMS=cpu from the caller runs the same commands on a CPU (the smoke run in docs/training.md)
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
RUN=/tmp/chat_run

train() {
  # 32 rows x 1,024 tokens a step (24 chat + 8 documentation rows); ~1,200 chat rows per epoch, so 180 s is many
  # epochs: the step with the lowest held-out chat loss is exported (--keep-best, the default)
  timeout 540 python3 -m dsflash.train --target-from dsflash/assets/demo --out "$RUN" \
    --sft-steps 3000 --max-sft-seconds 180 --sft-batch-size 32 --sft-seq-len 1024 --sft-lr 6e-4 --sft-lm-fraction 0.25 \
    --batch-size 64 --eval-every 100 --draft-steps 0 "$@" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' > "$OUT/train.log"
  tail -30 "$OUT/train.log"
  local ck=$RUN/checkpoint
  cp "$RUN/metrics.json" "$OUT/" 2>/dev/null
  cp "$ck"/model-*.safetensors "$OUT/" 2>/dev/null
  cp "$RUN/log.jsonl" "$RUN/loss.png" "$ck/" 2>/dev/null
  tar czf "$OUT/checkpoint_rest.tgz" -C "$ck" --exclude='model-*.safetensors' . 2>/dev/null
  tail -c 20000 "$OUT/train.log" > "$OUT/train.tail" && mv "$OUT/train.tail" "$OUT/train.log"
  python3 - "$OUT/metrics.json" <<'PY'
import json, sys
try:
    m = json.load(open(sys.argv[1])); s = m["sft"]
    print("sft steps", s["steps_run"], "kept", s["step_kept"], "held-out chat loss", round(s["init_heldout_chat_loss"], 3),
          "->", round(s["heldout_chat_loss"], 3), "(loaded", round(s["loaded_heldout_chat_loss"], 3), ") doc ppl",
          round(m["loaded_heldout_ppl"], 3),
          "bytes", m["checkpoint_bytes"], "s", m["seconds"])
except Exception as e:
    print("no result:", e)
PY
}

evaluate() {
  local ck=${1:-$RUN/checkpoint}; shift || true
  timeout 330 python3 -m dsflash.train.spec_eval "$ck" --prompts 16 --max-tokens 48 --chat-prompts 16 "$@" \
    > "$OUT/spec.json" 2> "$OUT/eval.log"
  timeout 200 python3 scripts/chat_samples.py "$ck" --trials 20 > "$OUT/chat_samples.json" 2>> "$OUT/eval.log"
  tail -c 20000 "$OUT/eval.log" > "$OUT/eval.tail" && mv "$OUT/eval.tail" "$OUT/eval.log"
  python3 - "$OUT/spec.json" <<'PY'
import json, sys
try:
    sp = json.load(open(sys.argv[1]))
    for k, r in (("docs", sp), ("chat", sp.get("chat", {}))):
        print(k, "acceptance", r.get("spec_mean_acceptance_length"), r.get("spec_acceptance_rate_per_pos"),
              "greedy equal", r.get("greedy_equal"))
except Exception as e:
    print("no result:", e)
PY
  python3 - "$OUT/chat_samples.json" <<'PY'
import json, sys
try:
    t = json.load(open(sys.argv[1]))["trials"]
    print({k: {a: b for a, b in v.items() if a != "rows"} for k, v in t.items()})
except Exception as e:
    print("no trials:", e)
PY
}

case $PHASE in
  train) train "$@" ;;
  eval) evaluate "$@" ;;
  all) train "$@"; evaluate ;;
  *) echo "usage: $0 train|eval|all [args]"; exit 2 ;;
esac
ls -la "$OUT"
