#!/usr/bin/env bash
# Issue 32 item 1 at `make demo-full` scale, one command on a GPU host (docs/draft-quality.md, "Head-to-head with
# speculators"): eagle3's draft and speculators' (its own Trainer, bench/peer_speculators.py) trained on the
# same features, vocabulary, epochs, token budget, lr and seed, both measured in real vLLM on MT-Bench's
# first turns and the held-out split at k = 3, 5, 7; then the table (bench/peer_table.py).
#
#   bash bench/peer_head_to_head.sh [RUN]     # RUN: a finished `make demo-full` (default demo_full)
#   device tool: run command="bash bench/peer_head_to_head.sh demo_full" carry=["demo_full"]
#
# Needs: speculators 0.9.0 (pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0), vLLM with CUDA.
# On CUDA speculators runs unpatched (flex attention, fused Triton losses, bf16); eagle3's run trained with
# bf16 autocast on CUDA too. RUN must hold run/config.json, features/ (or the features_cache it names),
# the vocab, distilled/ (or prepared/) and export/. Writes RUN/peer/: the peer's data and checkpoints,
# train.log, eval-*.json, table.md. EAGLE3_PEER_EPOCHS overrides the epochs (both trainers keep the run's
# own: eagle3's draft is RUN/export, trained by the demo); EAGLE3_PEER_EVAL_ARGS adds eval flags.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-demo_full}
OUT=$RUN/peer
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PREPARED=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["prepared"])' "$RUN/run/config.json")
FEATURES=$("$PY" -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c["features_cache"] or c["features"])' "$RUN/run/config.json")
EPOCHS=()
[ -n "${EAGLE3_PEER_EPOCHS:-}" ] && EPOCHS=(--epochs "$EAGLE3_PEER_EPOCHS")
/usr/bin/time -v "$PY" -m bench.peer_speculators --run "$RUN" --out "$OUT" "${EPOCHS[@]}" > "$OUT/train.log" 2>&1
PEER=$(ls -d "$OUT"/ckpt-speculators-adamw/[0-9]* | sort -V | tail -1)
EVAL=(--model "$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["model"])' "$RUN/run/config.json")"
      --engine vllm -k 3,5,7 --prompt-set mt-bench --prompt-set heldout --prepared "$PREPARED" --features "$FEATURES"
      --heldout-fraction 0.05 --n-prompts 60 --max-new-tokens 64 --dtype bfloat16 --kv-cache-gib 0 --json)
# eagle3 again with the three Eagle-3.1 norms (speculators' defaults), the run's config otherwise, offline on
# the same features (docs/draft-quality.md: at 2 epochs on demo_small they kept the chain alive past the trained
# depth and cost a point at positions 2-3)
"$PY" -m eagle3 train --config "$RUN/run/config.json" --set prepared= --set features_cache= --set features="$FEATURES" \
    --set norm_before_fc=true --set norm_before_residual=true --set norm_output=true --set progress=false \
    --out "$OUT/eagle3-norms/run" > "$OUT/train-eagle3-norms.log" 2>&1
"$PY" -m eagle3 export "$OUT/eagle3-norms/run" --out "$OUT/eagle3-norms/export" >> "$OUT/train-eagle3-norms.log" 2>&1
# shellcheck disable=SC2086
"$PY" -m eagle3 eval "$RUN/export" "${EVAL[@]}" ${EAGLE3_PEER_EVAL_ARGS:-} > "$OUT/eval-eagle3.json"
# shellcheck disable=SC2086
"$PY" -m eagle3 eval "$OUT/eagle3-norms/export" "${EVAL[@]}" ${EAGLE3_PEER_EVAL_ARGS:-} > "$OUT/eval-eagle3-norms.json"
# shellcheck disable=SC2086
"$PY" -m eagle3 eval "$PEER" "${EVAL[@]}" ${EAGLE3_PEER_EVAL_ARGS:-} > "$OUT/eval-speculators.json"
# eagle3's train time: the demo's own run (metrics.jsonl); the peer's from /usr/bin/time in train.log
"$PY" -m bench.peer_table --eval eagle3="$OUT/eval-eagle3.json" --eval eagle3-norms="$OUT/eval-eagle3-norms.json" \
    --eval speculators="$OUT/eval-speculators.json" --time speculators="$OUT/train.log" \
    --metrics eagle3="$RUN/run/metrics.jsonl" --metrics eagle3-norms="$OUT/eagle3-norms/run/metrics.jsonl" \
    | tee "$OUT/table.md"
