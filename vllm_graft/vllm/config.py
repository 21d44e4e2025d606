"""From ``--speculative-config graft.json`` to what vLLM and the Graft runtime use.

vLLM's ``SpeculativeConfig`` knows no method ``graft`` and forbids extra keys, so the
user's form

    {"method": "graft", "model": HEAD, "graft": {...}}

is translated before vLLM validates it: vLLM gets an EAGLE-3 config (or a
``draft_model`` / ``dflash`` one with ``"graft": {"drafter": ...}``) whose
``num_speculative_tokens`` is the tree budget (so the scheduler reserves a tree's worth
of slots per request), and the ``graft`` block travels in
``VllmConfig.additional_config["graft"]`` (part of the config hash, present in every
process). Everything is validated here, in the front end, so a bad key or a missing
file stops start-up with a message that names it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_graft.core.calibration import Calibration, load_calibration
from vllm_graft.core.config import GraftConfig, GraftConfigError, TreeShape, resolve_tree_shape
from vllm_graft.core.successor import read_successor_file
from vllm_graft.offline.models import ModelNotFoundError, model_fingerprint

logger = logging.getLogger(__name__)

GRAFT_METHOD = "graft"
ADDITIONAL_CONFIG_KEY = "graft"
_FILE_KEYS = ("calibration", "warmup")
#: the vLLM speculative method that loads each ``graft.drafter``
VLLM_METHOD_OF_DRAFTER = {"eagle3": "eagle3", "draft_model": "draft_model",
                          "dflash": "dflash"}


def load_speculative_config_arg(value: str) -> dict[str, Any]:
    """The value of ``--speculative-config``: inline JSON, or the path of a JSON / YAML
    file. Relative file paths inside a file are taken relative to that file."""
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise GraftConfigError(f"--speculative-config: invalid JSON ({err})") from None
        return _require_mapping(data, "--speculative-config")
    path = Path(value).expanduser()
    if not path.is_file():
        raise GraftConfigError(
            f"--speculative-config: {value!r} is neither inline JSON nor an existing file")
    try:
        raw = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(raw)
            except yaml.YAMLError as err:  # not a ValueError
                raise ValueError(f"invalid YAML ({err})") from None
        else:
            data = json.loads(raw)
    except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise GraftConfigError(f"speculative config file {str(path)!r}: {err}") from None
    data = _require_mapping(data, f"speculative config file {str(path)!r}")
    return _resolve_relative_paths(data, path.parent)


def _require_mapping(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise GraftConfigError(f"{where}: must be a JSON object")
    return data


def _resolve_relative_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    data = dict(data)
    graft = data.get("graft")
    if isinstance(graft, dict):
        graft = dict(graft)
        for key in _FILE_KEYS:
            if isinstance(graft.get(key), str):
                graft[key] = _relative_to(base, graft[key])
        state = graft.get("successor_state")
        if isinstance(state, dict) and isinstance(state.get("path"), str):
            graft["successor_state"] = {**state, "path": _relative_to(base, state["path"])}
        data["graft"] = graft
    model = data.get("model")
    if isinstance(model, str) and not os.path.isabs(model) and (base / model).exists():
        data["model"] = str(base / model)
    return data


def _relative_to(base: Path, value: str) -> str:
    """A path from a config file: ``~`` expanded, then relative to the file's folder."""
    path = os.path.expanduser(value)
    return path if os.path.isabs(path) else str(base / path)


def is_graft_spec(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("method") == GRAFT_METHOD


def translate_speculative_config(spec: dict[str, Any], *, target_model: str | None = None,
                                 target_vocab_size: int | None = None,
                                 target_tokenizer: TokenizerRef | None = None
                                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a Graft speculative config into (vLLM's EAGLE-3 config, the graft block).

    Validates the graft block and every file it names; with ``target_model`` /
    ``target_vocab_size`` known, also checks the calibration and warm-up files fit them.
    """
    spec = dict(spec)
    graft = spec.pop("graft", None)
    if graft is None:
        graft = {}
    if not isinstance(graft, dict):
        raise GraftConfigError("speculative_config.graft: must be a JSON object")
    config = GraftConfig.from_dict(graft, where="speculative_config.graft")
    if not spec.get("model"):
        raise GraftConfigError(
            "speculative_config.model: Graft needs the path of an EAGLE-3 head "
            "(or of a draft model with graft.drafter = 'draft_model')")
    check_speculators_head(spec["model"], config.drafter)
    if config.thresholds is not None and config.calibration is not None:
        _warn_once(f"speculative_config.graft: both thresholds {list(config.thresholds)} and "
                   f"calibration {config.calibration!r} are set; the thresholds win and the "
                   f"calibration file only seeds budget auto's acceptance odds. Remove "
                   f"thresholds to use the calibrated ones.")
    tokens = spec.get("num_speculative_tokens")
    if tokens is not None and tokens != config.budget:
        raise GraftConfigError(
            f"speculative_config.num_speculative_tokens: set by graft.budget "
            f"({config.budget}); remove it or make it equal, got {tokens}")
    for key in _FILE_KEYS:
        value = getattr(config, key)
        if value is not None and not Path(value).expanduser().is_file():
            raise GraftConfigError(f"speculative_config.graft.{key}: file {value!r} not found")
    settings = config.model_dump(mode="json", exclude_none=True)
    for key in _FILE_KEYS:
        if key in settings:
            settings[key] = str(Path(settings[key]).expanduser().resolve())
    if config.successor_state is not None:
        state_path = Path(config.successor_state.path).expanduser().resolve()
        where = "speculative_config.graft.successor_state.path"
        if not state_path.parent.is_dir():
            raise GraftConfigError(f"{where}: folder {str(state_path.parent)!r} does not "
                                   f"exist")
        if state_path.is_dir():
            raise GraftConfigError(f"{where}: {str(state_path)!r} is a folder, not a file")
        if not os.access(state_path.parent, os.W_OK | os.X_OK) or (
                state_path.exists() and not os.access(state_path, os.W_OK)):
            # found now, not at the first save minutes into serving
            raise GraftConfigError(f"{where}: {str(state_path)!r} cannot be written (no "
                                   f"write permission)")
        settings["successor_state"]["path"] = str(state_path)
        config = GraftConfig.from_dict(settings, where="speculative_config.graft")
    check_files(config, target_model=target_model, drafter_model=spec["model"],
                target_vocab_size=target_vocab_size, target_tokenizer=target_tokenizer)
    spec.update(method=VLLM_METHOD_OF_DRAFTER[config.drafter],
                num_speculative_tokens=config.budget)
    return spec, settings


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


#: the speculators-format model types that load as each ``graft.drafter``
SPECULATORS_TYPES_OF_DRAFTER = {"eagle3": ("eagle3",)}


def check_speculators_head(model: str, drafter: str) -> None:
    """A local head in the speculators format (a ``config.json`` with
    ``speculators_config``, as public EAGLE-3 heads ship) loads unchanged through vLLM's
    own reader; one of a model type that is not the drafter's is refused here, naming the
    file and key, rather than deep inside vLLM's loader. Hub IDs are left to vLLM."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        return
    try:
        head = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise GraftConfigError(f"speculative_config.model: {str(path)!r}: {err}") from None
    if not isinstance(head, dict) or head.get("speculators_config") is None:
        return
    kind = head.get("speculators_model_type")
    allowed = SPECULATORS_TYPES_OF_DRAFTER.get(drafter, ())
    if kind not in allowed:
        raise GraftConfigError(
            f"speculative_config.model: {str(path)!r}: speculators_model_type {kind!r} is not "
            f"a head graft.drafter {drafter!r} can use (expected one of {list(allowed)})")


def _served_fingerprint(model: str | None) -> str | None:
    """The fingerprint of a served model's ``config.json``: a local directory's, or a
    Hub ID's from the Hugging Face cache, where vLLM put it before Graft's config is
    read (never downloaded here). None, with a warning, where neither holds one: the
    calibration is then not checked against that model."""
    if not model:
        return None
    try:
        return model_fingerprint(model, local_files_only=True)
    except ModelNotFoundError as err:
        logger.warning("Graft: the calibration's fingerprint is not checked against %s "
                       "(%s)", model, err)
        return None


def check_files(config: GraftConfig, *, target_model: str | None, drafter_model: str | None,
                target_vocab_size: int | None, target_tokenizer: TokenizerRef | None = None
                ) -> Calibration | None:
    """Validate the calibration, warm-up and successor state files; returns the
    calibration. ``target_tokenizer``: the target's tokenizer (default: its model's)."""
    calibration = None
    if config.calibration is not None:
        calibration = load_calibration(
            config.calibration, config,
            target_fingerprint=_served_fingerprint(target_model),
            drafter_fingerprint=_served_fingerprint(drafter_model))
    # a state file start-up cannot use stops it here under on_corrupt "refuse" only (else
    # the proposer moves it aside: vllm_graft.vllm.successor_state.load_successor_state)
    refused = config.successor_state is not None and config.successor_state.on_corrupt == "refuse"
    files = [path for path in (config.warmup, refused and config.successor_state_file) if path]
    tokenizer = target_tokenizer or (TokenizerRef(target_model) if target_model else None)
    fingerprint = tokenizer.fingerprint() if files and tokenizer else None
    for path in files:
        read_successor_file(path, vocab_size=target_vocab_size, k=config.successor_k,
                            tokenizer_fingerprint=fingerprint)
    return calibration


@dataclass(frozen=True)
class TokenizerRef:
    """Which tokenizer a model uses, as vLLM loads it."""

    path: str
    trust_remote_code: bool = False
    revision: str | None = None

    @classmethod
    def of(cls, model_config) -> TokenizerRef | None:
        path = getattr(model_config, "tokenizer", None) or getattr(model_config, "model", None)
        if not path:
            return None
        return cls(str(path), bool(getattr(model_config, "trust_remote_code", False)),
                   getattr(model_config, "tokenizer_revision", None))

    def fingerprint(self) -> str | None:
        return tokenizer_fingerprint(self.path, self.trust_remote_code, self.revision)

    @classmethod
    def fingerprint_of(cls, model_config) -> str | None:
        """The fingerprint of the tokenizer ``model_config`` names (``None``: none)."""
        tokenizer = cls.of(model_config)
        return tokenizer.fingerprint() if tokenizer is not None else None


@functools.lru_cache(maxsize=8)
def tokenizer_fingerprint(tokenizer: str, trust_remote_code: bool = False,
                          revision: str | None = None) -> str | None:
    """SHA-256 of the tokenizer's token-to-id map, so that a successor matrix learned
    with one tokenizer is never loaded for another with the same vocabulary size.
    ``None`` when the tokenizer cannot be loaded here: the vocabulary-size and
    ``successor_k`` checks still apply, the tokenizer check does not (logged)."""
    try:
        from transformers import AutoTokenizer

        vocab = AutoTokenizer.from_pretrained(
            tokenizer, trust_remote_code=trust_remote_code, revision=revision).get_vocab()
    except Exception as err:  # no tokenizer files, a remote-code tokenizer, ...
        logger.warning("Graft: no tokenizer fingerprint for %s (%s)", tokenizer, err)
        return None
    text = json.dumps(sorted(vocab.items()), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def cuda_graphs_enabled(vllm_config, full: bool = False) -> bool:
    """Whether this engine captures CUDA graphs (``full``: graphs holding attention too):
    not eager mode, a CUDA-graph mode other than NONE (with full graphs), and capture
    sizes to capture (the CPU platform empties them). Read in the worker, after the
    platform and ``enforce_eager`` have settled the compilation config."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and model_config.enforce_eager:
        return False
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", str(mode)) == "NONE":
        return False
    if full and not mode.has_full_cudagraphs():
        return False
    return bool(getattr(compilation, "cudagraph_capture_sizes", None))


@dataclass(frozen=True)
class GraftSettings:
    """What a worker needs: the validated config, the thresholds in force, the tree
    shape in force (``graft.tree_shape`` resolved against this engine's CUDA-graph
    setting: ``auto`` is ``fixed`` with full CUDA graphs over the verification, which
    need one shape per batch size, ``dynamic`` otherwise: eager mode, and the piecewise
    graphs Graft runs, where tree attention runs outside the graphs), and the
    calibration file's contents (None without one)."""

    config: GraftConfig
    thresholds: tuple[float, ...]
    tree_shape: TreeShape = TreeShape.DYNAMIC
    calibration: Calibration | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config) -> GraftSettings | None:
        raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            return None
        config = GraftConfig.from_dict(raw, where="additional_config.graft")
        spec = vllm_config.speculative_config
        calibration = check_files(
            config, target_model=vllm_config.model_config.model,
            drafter_model=spec.model if spec is not None else None,
            target_vocab_size=vllm_config.model_config.get_vocab_size(),
            target_tokenizer=TokenizerRef.of(vllm_config.model_config))
        thresholds = config.effective_thresholds(
            calibration.thresholds if calibration is not None else None)
        return cls(config=config, thresholds=thresholds,
                   tree_shape=resolve_tree_shape(config.tree_shape,
                                                 cuda_graphs_enabled(vllm_config,
                                                                     full=True)),
                   calibration=calibration)
