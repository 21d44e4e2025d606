#!/usr/bin/env bash
# The main job: installs everything (scripts/setup.sh), then generates with Graft on the
# real vLLM engine and prints accepted-length statistics next to plain decoding.
# Until a trained head for a real model is committed, the model is a tiny random Qwen3
# with a random EAGLE-3 head built locally (seconds); retrieval does the accepting.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/runtime-env.sh
MODELS=${MODELS:-.cache/demo-models}
.venv/bin/python scripts/make_tiny_models.py "$MODELS" >/dev/null
exec .venv/bin/vllm-graft generate "$MODELS/target" --dtype float32 \
  --speculative-config "$MODELS/graft.json" --compare --max-tokens 128 "$@"
