"""The package as a user installs it: ``pip wheel .`` builds a wheel holding the package,
its compiled ops, the console script, the vLLM plugin entry point and the license; that
wheel installed on its own path serves vLLM its plugin from there; the sdist carries
every source the ops build from (the CUDA headers too); and a GPU engine refuses, at
start-up, compiled ops built without their CUDA kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "VLLM_GRAFT_BUILD_CUDA": "0", "MAX_JOBS": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
         "-w", str(out), str(ROOT)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    wheels = list(out.glob("vllm_graft-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_holds_the_package_its_ops_and_its_entry_points(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("vllm_graft/_C") and n.endswith(".so") for n in names), names
    assert "vllm_graft/core/fused.py" in names and "vllm_graft/vllm/plugin.py" in names
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "[vllm.general_plugins]" in entry_points
    assert "graft = vllm_graft.vllm.plugin:register" in entry_points
    assert "vllm-graft = vllm_graft.cli.main:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "Provides-Extra: cpu" in metadata and "Provides-Extra: gpu" in metadata
    assert any(n.endswith("LICENSE") for n in names)


def test_the_installed_wheel_serves_vllm_its_plugin(wheel, tmp_path):
    """Installed alone on a path of its own (beside the environment's vLLM, ahead of the
    repository's editable install), the package imports its compiled ops from there and
    vLLM finds its plugin there."""
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    code = f"""
import importlib.metadata as metadata, sys
sys.path.insert(0, {str(site)!r})
import vllm_graft.ops, torch
assert vllm_graft.ops.__file__.startswith({str(site)!r}), vllm_graft.ops.__file__
assert torch.ops.vllm_graft.graft_tree_finalize.default is not None
plugins = [ep for ep in metadata.entry_points(group="vllm.general_plugins")
           if ep.name == "graft" and str(ep.dist._path).startswith({str(site)!r})]
assert plugins, "no plugin entry point in the installed wheel"
plugins[0].load()
print("installed")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and "installed" in result.stdout, result.stderr[-3000:]


def test_the_sdist_carries_every_source_of_the_ops(tmp_path):
    result = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "VLLM_GRAFT_BUILD_CUDA": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    sdist = next(tmp_path.glob("vllm_graft-*.tar.gz"))
    names = {Path(n).relative_to(Path(n).parts[0]).as_posix()
             for n in tarfile.open(sdist).getnames() if len(Path(n).parts) > 1}
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*")
               if p.is_file()}
    missing = sources - names
    assert not missing, missing
    assert {"LICENSE", "pyproject.toml", "setup.py", "README.md"} <= names


def test_a_gpu_engine_refuses_compiled_ops_without_cuda_kernels(monkeypatch):
    import vllm_graft.ops as ops
    from vllm_graft.vllm.proposer import check_compiled_ops

    monkeypatch.setattr(ops, "cuda_ops_available", lambda: False)
    with pytest.raises(RuntimeError, match="built without their CUDA kernels"):
        check_compiled_ops("compiled", "cuda")
    check_compiled_ops("reference", "cuda")
    check_compiled_ops("compiled", "cpu")
