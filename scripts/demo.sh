#!/usr/bin/env bash
# The main job: installs everything (scripts/setup.sh), then runs the core benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/runtime-env.sh
exec .venv/bin/python scripts/bench_core.py "$@"
