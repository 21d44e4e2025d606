# Sourced by the project's scripts: the environment every vLLM process here needs.
# shellcheck shell=bash
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ! nvidia-smi -L >/dev/null 2>&1; then
  # vLLM's CPU backend reserves 92 % of RAM for KV cache unless told otherwise.
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
  # vLLM's CPU kernels expect Intel OpenMP; without it an in-process engine runs ~50x slower.
  if [ -f "$ROOT/.venv/lib/libiomp5.so" ]; then
    export LD_PRELOAD="$ROOT/.venv/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
  fi
fi
