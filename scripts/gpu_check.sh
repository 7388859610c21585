#!/usr/bin/env bash
# GPU check (issue 8): the benchmark on a random-weight model of a real architecture's shape, 4K-32K tokens.
# Needs no network: the model is built from a config (default Llama-3-8B dimensions, bf16 on CUDA) with random
# weights, which is fine for speed and memory. Writes the JSON report and prints the table.
#
#   scripts/gpu_check.sh [--dry-run] [OUT.json] [PRESET|CONFIG_JSON]      e.g. scripts/gpu_check.sh gpu.json llama3-8b
#
# --dry-run runs the same command on the CPU with quick sizes and the tiny shape (seconds), to check the script and
# the environment before spending GPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT="${1:-gpu_check.json}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if [ "$DRY_RUN" = 1 ]; then
  MODEL="${2:-tiny}"
  SIZES=(--quick --device cpu --lengths 64,128)
else
  MODEL="${2:-llama3-8b}"
  SIZES=(--preset gpu --device cuda --lengths 4096,8192,16384,32768)
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
