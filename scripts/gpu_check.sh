#!/usr/bin/env bash
# One prepared check of everything Graft runs on a GPU without vLLM, in under 8 minutes:
#   1. builds the compiled ops for the GPU found (in place) and runs their tests, which
#      compare the CUDA kernels with the torch reference on random inputs;
#   2. scripts/gpu_check.py's sections, each in a process of its own with its own time
#      limit (a hang, a crash or a lost CUDA context costs only that section), most
#      important first, those the time budget cannot reach recorded as not run: the
#      Triton tree-attention kernel against the SDPA reference (fp16/bf16/fp32), a whole
#      decoding step of a Qwen3-8B-shaped target and EAGLE-3 head in CUDA graphs beside
#      plain decoding and EAGLE-3 chains (tokens/s projected with the committed CPU
#      results' accepted tokens), the tree kernel's timing against dense causal
#      FlashAttention, Graft's step bookkeeping at batch 1/8/32 (vocab 151,936; the fused
#      step captured whole, and the torch path), the verification cost curve of a
#      Qwen3-8B-shaped model (bf16, transformers), the tree build under torch.compile.
# Writes gpu_check.json, gpu_check.md and the logs into OUT_DIR; exits non-zero on any
# failure, mismatch or section not run. Needs python3 with torch (CUDA), triton and
# transformers; no vLLM.
#
#   scripts/gpu_check.sh OUT_DIR            # on a GPU machine
#   scripts/gpu_check.sh OUT_DIR --smoke    # CPU, toy sizes, Triton interpreter: checks
#                                           # this script where no GPU is available
# PYTHON picks the interpreter (default python3). GPU_CHECK_WHEELS, a folder of wheels,
# is installed into a temporary folder first, for packages the machine lacks (pydantic).
# GPU_CHECK_BUDGET_S (default 480) is the whole script's time; GPU_CHECK_SECTIONS (names
# of gpu_check.py's sections) runs only those.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR [--smoke]}
MODE=${2:-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

BUDGET=${GPU_CHECK_BUDGET_S:-480}
: > "$OUT/gpu_check.log"
rm -f "$OUT/gpu_check.json"
PREFLIGHT=()
SMOKE=()
if [ "$MODE" = --smoke ]; then
  echo "gpu_check: smoke run on the CPU (toy sizes, Triton interpreter)"
  export TRITON_INTERPRET=1
  SMOKE=(--smoke)
  PREFLIGHT=(--preflight "mode=smoke (CPU)")
elif ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU found (nvidia-smi -L failed): nothing was measured." \
       "Run it on a GPU machine, or with --smoke to check the script on the CPU."
  exit 0
fi

# gpu_check.py's sections, each in a process of its own (see the top of this file)
run_sections() {
  local plan name limit left status killed=() not_run=()
  plan=$("$PY" scripts/gpu_check.py --out "$OUT" --plan ${SMOKE[@]+"${SMOKE[@]}"} \
         ${GPU_CHECK_SECTIONS:+--sections $GPU_CHECK_SECTIONS}) || return 1
  while read -r name limit; do
    left=$((BUDGET - SECONDS - 15))  # 15 s for the report
    if [ "$left" -lt 20 ]; then
      not_run+=(--not-run "$name=the check's time budget (${BUDGET} s) was spent")
      echo "gpu_check: $name not run: the time budget is spent"
      continue
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 10 "$limit" "$PY" scripts/gpu_check.py --out "$OUT" --merge \
      ${SMOKE[@]+"${SMOKE[@]}"} \
      --sections "$name" --limit-s "$limit" </dev/null 2>&1 | tee -a "$OUT/gpu_check.log"
    status=${PIPESTATUS[0]}
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
      killed+=(--killed "$name=$limit")
      echo "gpu_check: $name killed at its time limit ($limit s)" | tee -a "$OUT/gpu_check.log"
    fi
  done <<< "$plan"
  "$PY" scripts/gpu_check.py --out "$OUT" --finish ${SMOKE[@]+"${SMOKE[@]}"} \
    ${PREFLIGHT[@]+"${PREFLIGHT[@]}"} \
    ${killed[@]+"${killed[@]}"} ${not_run[@]+"${not_run[@]}"} 2>&1 | tee -a "$OUT/gpu_check.log"
  return "${PIPESTATUS[0]}"
}

if [ "$MODE" = --smoke ]; then
  BUDGET=${GPU_CHECK_BUDGET_S:-100000}  # the interpreter's pace is no GPU's
  run_sections
  exit $?
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
  timeout 150 "$PY" -m pytest -v -rs -p no:cacheprovider $XDIST tests/ops \
    >"$OUT/ops_tests.log" 2>&1
  STATUS=$?
  OPS="$(tail -1 "$OUT/ops_tests.log")"
  if [ $STATUS -ne 0 ]; then OPS="FAILED: $OPS"; FAILED=1; tail -30 "$OUT/ops_tests.log"; fi
  echo "gpu_check: ops tests: $OPS"
fi

PREFLIGHT=(--preflight "compiled ops build=$BUILD" --preflight "compiled op tests=$OPS")
run_sections || FAILED=1
exit $FAILED
