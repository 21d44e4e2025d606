#!/usr/bin/env bash
# Rebuilds everything behind bench/results/: the models, the EAGLE-3 head for
# SmolLM2-135M-Instruct, then the full side-by-side benchmark with ablations.
# Hours on a 2-core CPU; each stage is cached and resumes.
#   scripts/reproduce_results.sh                 # head (if missing) + full benchmark
#   RETRAIN=1 scripts/reproduce_results.sh       # also retrain the committed head
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/runtime-env.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0   # in-process engines: fast start, one process
CACHE=${VLLM_GRAFT_CACHE:-$HOME/.cache/vllm-graft}
HEAD=assets/heads/smollm2-135m-eagle3
.venv/bin/vllm-graft prepare-models --models smollm2-135m
if [ "${RETRAIN:-0}" = 1 ] || [ ! -f "$HEAD/config.json" ]; then
  .venv/bin/vllm-graft train-head "$CACHE/models/smollm2-135m" --out "$HEAD" \
    --work-dir "$CACHE/train/smollm2" --num-prompts 2000 --epochs 2 --dtype float32
fi
OUT=${OUT:-bench/results/smollm2-135m}
# SmolLM2 has 8K positions: the long-code stand-ins are 1K / 2K / 4K tokens. The
# committed run fits about an hour on a 2-core CPU; for the larger one add
#   DATASETS="humaneval mtbench gsm8k essays-4k code-1k code-2k code-4k code-7k" and
#   --num-prompts 6 --max-tokens 96 (tree verification over 4K-7K contexts is slow on CPU).
DATASETS=${DATASETS:-humaneval mtbench gsm8k code-1k code-2k code-4k}
.venv/bin/vllm-graft bench --target smollm2-135m --head "$HEAD" --out "$OUT" \
  --datasets $DATASETS --num-prompts 4 --max-tokens 64 --ablations "$@"
# Speed against plain decoding: the modes of budget "auto" (trees, copy chains, plain),
# prompt lookup and EAGLE-3 chains, with a batch sweep; warm-up and calibration from
# the run above.
SPEED_OUT=${SPEED_OUT:-bench/results/smollm2-135m-guard}
.venv/bin/vllm-graft bench --target smollm2-135m --head "$HEAD" --out "$SPEED_OUT" \
  --methods plain eagle3 ngram graft_no_context graft graft_chain graft_auto \
  --datasets humaneval mtbench gsm8k code-edit code-1k code-2k --num-prompts 4 --max-tokens 64 \
  --warmup "$OUT/warmup.bin" --calibration "$OUT/calibration.json" \
  --batch-sizes 1 8 32 --batch-methods plain eagle3 ngram graft_chain graft_auto
