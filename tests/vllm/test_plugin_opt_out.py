"""vLLM loads every installed general plugin unless ``VLLM_PLUGINS`` names the ones to
load: leaving ``graft`` out of it keeps Graft's patches out of the process."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
load_general_plugins()
print(EngineArgs.create_speculative_config.__module__)
"""


def _patched_module(plugins: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip().splitlines()[-1]


def test_graft_is_applied_by_default_and_left_out_when_vllm_plugins_omits_it():
    assert _patched_module(None).startswith("vllm_graft.")
    assert _patched_module("graft").startswith("vllm_graft.")
    assert _patched_module("some_other_plugin").startswith("vllm.")
