#!/usr/bin/env bash
# Issue 12's and issue 16's GPU figures in one command, on a lent GPU host with no internet (~6 min):
#   .venv/bin/python -m bench.device_kit       # here, once: .device/ (wheels the host lacks, the tokenizer)
#   device tool: run  command="bash bench/device_check.sh"  carry=[".device"]  timeout_s=480
# 1. bench/gpu_extract.py: dummy:llama-3.1-8b (random weights made on the GPU), 120k tokens, hf backend:
#    naive loop, backend in-process, serve -> extract_dataset -> disk; c/b, c/a, server RSS after load.
# 2. bench/train.py --synthetic --device cuda: hidden 4096 / 32 heads, draft vocab 32000, TTT 7, flex
#    attention, 4k/8k/16k-token micro-batches: tokens/s and max_memory_allocated.
# 3. tests/gpu/test_gpu_flex.py: that compiled flex attention equals the dense form, forward and gradients.
# Writes $OUT/gpu_extract.json, $OUT/train.json, $OUT/gpu_tests.jsonl and $OUT/log (the device tool brings
# $OUT back).
# EAGLE3_CHECK_SMOKE=1: the same plumbing at toy sizes on CPU (tests/e2e/test_device_check.py runs it);
# EAGLE3_DEVICE_KIT: the kit's folder (default .device).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
KIT=${EAGLE3_DEVICE_KIT:-$PWD/.device}
if [ -d "$KIT/wheels" ]; then
    SITE=$(mktemp -d /tmp/eagle3-site.XXXXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$KIT"/wheels/*.whl \
        || { echo "device_check: installing $KIT/wheels failed" >&2; exit 1; }
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -d "$KIT/cache" ]; then
    export EAGLE3_CACHE_DIR="$KIT/cache"
fi
export PYTHONUNBUFFERED=1
if [ "${EAGLE3_CHECK_SMOKE:-0}" = 1 ]; then
    EXTRACT_ARGS=(--model dummy:tiny --tokens 1500 --p50 128 --max-batch-tokens 1024 --device cpu)
    TRAIN_ARGS=(--device cpu --shapes smollm2 --tokens 256 --attention blockwise --steps 1)
else
    EXTRACT_ARGS=()
    TRAIN_ARGS=(--device cuda --shapes llama8b --tokens 4096,8192,16384 --attention flex --steps 2)
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import torch, transformers, fastapi; print("torch", torch.__version__, "transformers",
transformers.__version__, "fastapi", fastapi.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$OUT/log"
status=0
timeout "${EAGLE3_EXTRACT_TIMEOUT_S:-270}" "$PY" bench/gpu_extract.py "${EXTRACT_ARGS[@]}" \
    > "$OUT/gpu_extract.json" 2>> "$OUT/log"
rc=$?; echo "gpu_extract: rc=$rc" | tee -a "$OUT/log"; [ $rc = 0 ] || status=1
timeout "${EAGLE3_TRAIN_TIMEOUT_S:-150}" "$PY" -m bench.train --synthetic "${TRAIN_ARGS[@]}" \
    > "$OUT/train.json" 2>> "$OUT/log"
rc=$?; echo "train: rc=$rc" | tee -a "$OUT/log"; [ $rc = 0 ] || status=1
EAGLE3_GPU_JSON="$OUT/gpu_tests.jsonl" timeout "${EAGLE3_TESTS_TIMEOUT_S:-120}" "$PY" -m pytest -q -s -m gpu \
    -p no:cacheprovider tests/gpu/test_gpu_flex.py >> "$OUT/log" 2>&1
rc=$?; echo "gpu tests: rc=$rc" | tee -a "$OUT/log"; [ $rc = 0 ] || [ $rc = 5 ] || status=1
cat "$OUT/gpu_extract.json" "$OUT/train.json"
exit $status
