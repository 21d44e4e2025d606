"""Helpers of the command-line tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@contextlib.contextmanager
def script_module(name: str):
    """``scripts/<name>.py`` imported as the module ``name``, registered in
    ``sys.modules`` while in use (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
