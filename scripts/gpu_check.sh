#!/usr/bin/env bash
# One prepared check of everything Graft runs on a GPU without vLLM, in under 8 minutes:
#   1. builds the compiled ops for the GPU found (in place) and runs their tests, which
#      compare the CUDA kernels with the torch reference on random inputs;
#   2. scripts/gpu_check.py: the Triton tree-attention kernel against the SDPA reference
#      (fp16/bf16/fp32) and its timing against dense causal FlashAttention, Graft's step
#      bookkeeping at batch 1/8/32 (vocab 151,936; the fused step and the torch path), a
#      whole decoding step of a Qwen3-8B-shaped target and EAGLE-3 head in CUDA graphs
#      beside plain decoding and EAGLE-3 chains (tokens/s projected with the committed
#      CPU results' accepted tokens), and the verification cost curve of a
#      Qwen3-8B-shaped model (bf16, transformers).
# Writes gpu_check.json, gpu_check.md and the logs into OUT_DIR; exits non-zero on any
# failure or mismatch. Needs python3 with torch (CUDA), triton and transformers; no vLLM.
#
#   scripts/gpu_check.sh OUT_DIR            # on a GPU machine
#   scripts/gpu_check.sh OUT_DIR --smoke    # CPU, toy sizes, Triton interpreter: checks
#                                           # this script where no GPU is available
# PYTHON picks the interpreter (default python3). GPU_CHECK_WHEELS, a folder of wheels,
# is installed into a temporary folder first, for packages the machine lacks (pydantic).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [--smoke]}
MODE=${2:-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

if [ "$MODE" = --smoke ]; then
  echo "gpu_check: smoke run on the CPU (toy sizes, Triton interpreter)"
  export TRITON_INTERPRET=1
  exec "$PY" scripts/gpu_check.py --out "$OUT" --smoke --preflight "mode=smoke (CPU)"
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU found (nvidia-smi -L failed): nothing was measured." \
       "Run it on a GPU machine, or with --smoke to check the script on the CPU."
  exit 0
fi

if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    "$GPU_CHECK_WHEELS"/*.whl || { echo "gpu_check: installing $GPU_CHECK_WHEELS failed"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:$SITE
fi

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
FAILED=0
# Build with the system compiler, which links libstdc++ dynamically as torch does. The
# GPU image names a compiler (/opt/gcc, in CC / CXX too) that links it statically: every
# error message the ops format then segfaults (two libstdc++ copies disagree on the
# locale). So the system compiler wins whenever there is one.
if [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++
  export LDSHARED="/usr/bin/g++ -shared" LDCXXSHARED="/usr/bin/g++ -shared"
fi
CAPABILITY=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
echo "gpu_check: building the compiled ops for compute capability $CAPABILITY"
if TORCH_CUDA_ARCH_LIST=$CAPABILITY VLLM_GRAFT_BUILD_CUDA=1 MAX_JOBS=$(nproc) \
   timeout 300 "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  BUILD="ok"
else
  BUILD="FAILED (see build.log)"; FAILED=1
  tail -20 "$OUT/build.log"
fi
if [ "$BUILD" = ok ] && ! ldd vllm_graft/_C*.so | grep -q "libstdc++"; then
  BUILD="FAILED: vllm_graft/_C links libstdc++ statically (set CXX to a compiler that does not)"
  FAILED=1
fi
echo "gpu_check: build $BUILD"

OPS="skipped (build failed)"
if [ "$BUILD" = ok ]; then
  echo "gpu_check: compiled-op tests (CUDA kernels against the torch reference)"
  # -v names each test; with pytest-xdist a crashing test takes down only its worker
  XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout 240 "$PY" -m pytest -v -rs -p no:cacheprovider $XDIST tests/ops \
    >"$OUT/ops_tests.log" 2>&1
  STATUS=$?
  OPS="$(tail -1 "$OUT/ops_tests.log")"
  if [ $STATUS -ne 0 ]; then OPS="FAILED: $OPS"; FAILED=1; tail -30 "$OUT/ops_tests.log"; fi
  echo "gpu_check: ops tests: $OPS"
fi

# GPU_CHECK_SECTIONS (names of gpu_check.py's sections) runs only those
timeout 420 "$PY" scripts/gpu_check.py --out "$OUT" ${GPU_CHECK_SECTIONS:+--sections $GPU_CHECK_SECTIONS} \
  --preflight "compiled ops build=$BUILD" --preflight "compiled op tests=$OPS" \
  2>&1 | tee "$OUT/gpu_check.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED=1
exit $FAILED
