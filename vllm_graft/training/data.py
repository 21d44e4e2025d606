"""Training data for a draft head: the target's own answers to chat prompts.

1. :func:`generate_answers` lets the target answer ShareGPT prompts with vLLM (greedy),
   so the head learns what the target itself writes.
2. :func:`extract_features` runs the target once more with transformers over prompt +
   answer and stores, per token, the three EAGLE-3 auxiliary hidden states (the inputs
   of layers ``aux_layers``) and the final hidden state (for the target's own next-token
   distribution), in bf16 shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vllm_graft.assets.datasets import Prompt


class WorkDirError(ValueError):
    """A work directory's cached data was made with other settings."""


def check_work_settings(folder: Path, settings: dict, name: str = "settings.json") -> None:
    """The cached answers and features in ``folder`` are reused only for the settings
    that made them: the first run records ``settings`` in ``folder / name``; a later
    run with others stops, naming the keys, instead of training on the old data (a
    folder from before the record is taken as it is, and recorded)."""
    record = folder / name
    if record.is_file():
        kept = json.loads(record.read_text())
        changed = sorted(key for key in set(kept) | set(settings)
                         if kept.get(key) != settings.get(key))
        if changed:
            differences = ", ".join(f"{key} {kept.get(key)!r} -> {settings.get(key)!r}"
                                    for key in changed)
            raise WorkDirError(f"work directory {folder} holds data made with other "
                               f"settings ({differences}): delete it, or pass another "
                               f"--work-dir")
        return
    folder.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=1, sort_keys=True))


def chat_prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    if prompt.chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt.text)["input_ids"]


def generate_answers(model: str, prompts: list[Prompt], out: Path, *, max_prompt_tokens: int,
                     max_tokens: int, dtype: str = "bfloat16", **engine_options) -> Path:
    """Writes ``out`` (JSON lines: prompt_ids, answer_ids). Idempotent.
    ``engine_options``: further vLLM engine arguments (tensor parallelism, ...)."""
    if out.is_file():
        return out
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_graft.machine import has_gpu

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    ids = [x for x in ids if len(x) <= max_prompt_tokens]
    llm = LLM(model=model, seed=0,
              **{"enforce_eager": not has_gpu(),
                 "max_model_len": max_prompt_tokens + max_tokens, "max_num_seqs": 64,
                 **engine_options, "dtype": dtype})
    outputs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens),
                           use_tqdm=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for prompt_ids, o in zip(ids, outputs):
            f.write(json.dumps({"prompt_ids": prompt_ids,
                                "answer_ids": list(o.outputs[0].token_ids)}) + "\n")
    tmp.replace(out)
    return out


def read_answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 taps: the inputs of layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


@torch.inference_mode()
def extract_features(model_dir: str, answers: list[dict], out_dir: Path, *,
                     aux_layers: tuple[int, ...], batch_tokens: int = 4096,
                     max_len: int = 1024, dtype: torch.dtype = torch.float32) -> Path:
    """Shards ``features-N.npz``: tokens, loss mask (answer positions), aux [T, 3, H]
    and final [T, H] hidden states as bf16 (stored as uint16), per sequence. Idempotent.
    ``dtype`` is the compute dtype (float32: bf16 is emulated, slowly, without AVX-512)."""
    done = out_dir / "features.done"
    if done.is_file():
        return out_dir
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    shard, index, sizes = [], 0, []
    for record in tqdm(answers, desc="features", unit="seq"):
        ids = (record["prompt_ids"] + record["answer_ids"])[:max_len]
        if len(record["answer_ids"]) < 2 or len(ids) < 4:
            continue
        out = model(torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states  # [embeddings, layer 1 input, ..., final (normed)]
        aux = torch.stack([hidden[i][0] for i in aux_layers], dim=1)  # [T, 3, H]
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(record["prompt_ids"]):] = True
        shard.append({"tokens": np.asarray(ids, dtype=np.int32), "mask": mask,
                      "aux": _bf16(aux), "final": _bf16(hidden[-1][0])})
        sizes.append(len(ids))
        if sum(len(s["tokens"]) for s in shard) >= batch_tokens * 16:
            _write_shard(out_dir / f"features-{index}.npz", shard)
            shard, index = [], index + 1
    if shard:
        _write_shard(out_dir / f"features-{index}.npz", shard)
    done.write_text(json.dumps({"sequences": len(sizes), "tokens": int(sum(sizes)),
                                "aux_layers": list(aux_layers)}))
    return out_dir


def _bf16(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).contiguous().view(torch.uint16).numpy()


def _write_shard(path: Path, shard: list[dict]) -> None:
    arrays = {}
    for i, seq in enumerate(shard):
        for key, value in seq.items():
            arrays[f"{i}.{key}"] = value
    np.savez(path, **arrays)


def load_shards(out_dir: Path) -> list[dict]:
    """All sequences, with tensors (aux / final back to bf16)."""
    sequences = []
    for path in sorted(out_dir.glob("features-*.npz"), key=lambda p: int(p.stem.split("-")[1])):
        data = np.load(path)
        count = len({k.split(".")[0] for k in data.files})
        for i in range(count):
            sequences.append({
                "tokens": torch.from_numpy(data[f"{i}.tokens"].astype(np.int64)),
                "mask": torch.from_numpy(data[f"{i}.mask"]),
                "aux": torch.from_numpy(data[f"{i}.aux"]).view(torch.bfloat16),
                "final": torch.from_numpy(data[f"{i}.final"]).view(torch.bfloat16),
            })
    return sequences
