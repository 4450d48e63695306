#!/usr/bin/env bash
# The built-in demo (`make demo`): a real corpus (Python's own standard library), a tokenizer,
# pretokenized shards, validate, plan, train a tiny model on the CPU, then show what was recorded.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/train/demo-tiny.yaml
OUT="${APR_DEMO_OUT:-demo-run}"
export APR_HOME="${APR_HOME:-$PWD/$OUT/apr-home}"
rm -rf "$OUT/run"
mkdir -p "$OUT"

# Bold headings on a terminal only: a piped or logged run (make demo | tee log) gets plain text, and
# NO_COLOR (https://no-color.org) turns them off anywhere. The apr commands follow the same rule.
if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; else BOLD='' PLAIN=''; fi
step() { printf '\n%s==> %s%s\n' "$BOLD" "$*" "$PLAIN"; }

step "1/6 Train a byte-level BPE tokenizer on the standard library's source"
apr data train-tokenizer --builtin stdlib --vocab-size 2048 --overwrite --out "$OUT/tokenizer.json"

step "2/6 Pretokenize the corpus into Parquet shards (seq_len 128)"
apr data pretokenize --builtin stdlib --tokenizer "$OUT/tokenizer.json" --seq-len 128 \
  --val-fraction 0.05 --seed 0 --overwrite --out "$OUT/data"

step "3/6 Validate the config (schema and config-only contracts, no torch import)"
apr train validate "$CONFIG"

step "4/6 Plan: step algebra, memory and time budget, data and tokenizer contracts"
apr train plan "$CONFIG" -out "$OUT/plan.json" --overwrite

step "5/6 Apply the saved plan: train on the CPU"
apr train apply "$OUT/plan.json"

step "6/6 What the run recorded"
apr runs ls --global
apr monitor --json "$OUT/run" > "$OUT/state.json"
python3 - "$OUT/state.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["state"]
hist = s.get("val_loss_history") or []
first = hist[0][1] if hist else float("nan")
print(f"run {s['run_id']}: status {s['status']}, step {s['step']}/{s['total_steps']}, "
      f"train loss {s['loss']:.3f}, val loss {first:.3f} -> {s['val_loss']:.3f}")
PY
echo
echo "Checkpoints and records are in $OUT/run/. Watch a run live with: apr monitor $OUT/run"
