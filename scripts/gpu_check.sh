#!/usr/bin/env bash
# GPU check (issue 8): the benchmark on a random-weight model of a real architecture's shape, 4K-32K tokens.
# Needs no network: the model is built from a config (default Llama-3-8B dimensions, bf16 on CUDA) with random
# weights, which is fine for speed and memory. Writes the JSON report and prints the table.
#
#   scripts/gpu_check.sh [OUT.json] [PRESET|CONFIG_JSON]      e.g. scripts/gpu_check.sh gpu.json llama3-8b
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check.json}"
MODEL="${2:-llama3-8b}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", file=sys.stderr)
PY
# Sections that need the embedded tokenizer (needle) say so and are skipped on a random model.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m kvviz bench --preset gpu --random-model "$MODEL" --device cuda \
  --lengths 4096,8192,16384,32768 --json "$OUT"
echo "gpu_check: wrote $OUT" >&2
