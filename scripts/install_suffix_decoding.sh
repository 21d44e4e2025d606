#!/usr/bin/env bash
# Install what vLLM's suffix decoding (the bench's `suffix` method) needs into the
# project's environment: arctic-inference 0.1.1, the version vLLM 0.32 asks for.
#
#     scripts/install_suffix_decoding.sh [PYTHON]     # default: .venv/bin/python
#
# The package index has no wheel of it for this platform, and `pip install
# arctic-inference` fails: its isolated build pulls in torch 2.7.0 with CUDA (gigabytes)
# and then CMake finds no Python development module in that build environment. Only its
# suffix-tree extension (C++, nanobind) is built here: its build tools go to a temporary
# directory, the build runs without isolation against the environment's torch, and the
# package is installed without dependencies (it needs none at run time), so vLLM and
# torch stay as they are.
set -euo pipefail
PYTHON=${1:-.venv/bin/python}
VERSION=0.1.1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m pip download "arctic-inference==$VERSION" --no-deps --no-build-isolation \
    -d "$WORK/src"
"$PYTHON" -m pip install --target "$WORK/tools" --no-deps nanobind==2.9.2 grpcio-tools wheel
PYTHONPATH="$WORK/tools" "$PYTHON" -m pip wheel "$WORK/src/arctic_inference-$VERSION.tar.gz" \
    --no-deps --no-build-isolation -w "$WORK/wheel"
"$PYTHON" -m pip install --no-deps "$WORK"/wheel/arctic_inference-*.whl
"$PYTHON" -c "from vllm.utils.import_utils import has_arctic_inference; \
assert has_arctic_inference(); print('suffix decoding: arctic-inference $VERSION installed')"
