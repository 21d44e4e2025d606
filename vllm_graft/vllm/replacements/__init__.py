"""The replacement functions of the patches that :mod:`vllm_graft.vllm.patches` lists,
one module per vLLM area: ``engine_config`` (engine arguments, speculative config,
request validation, runner choice), ``tenants`` (where a request's tenant comes from),
``runner_setup`` (building the model runner, its KV cache and its start-up profile),
``runner_steps`` (the runner's per-step hooks), ``shutdown`` (saving the successor
state at shutdown), ``attention`` (tree attention) and ``counters`` (Graft's counters
from the runner to Prometheus). The table of what is patched, and in which order,
stays in :mod:`vllm_graft.vllm.patches`."""
