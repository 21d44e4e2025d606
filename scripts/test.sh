#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/core -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/runtime-env.sh
exec .venv/bin/python -m pytest "${@:-tests}"
