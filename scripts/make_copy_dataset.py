"""Write the copy benchmark: prompts whose answers repeat much of the prompt.

    python scripts/make_copy_dataset.py [--out assets/datasets/copy.jsonl]

Six kinds, eight prompts each, one JSON object a line (``kind``, ``id``, ``source``,
``prompt``); each kind is a dataset of ``vllm-graft bench --datasets``:

- ``copy_rename``: rename an identifier through a span of a module, return it whole
- ``copy_typehints``: add type hints and docstrings to a span of functions
- ``copy_spelling``: fix spelling and grammar mistakes put into a paragraph of prose
- ``copy_reformat``: CSV to a Markdown table, JSON to YAML (data made up here)
- ``copy_rag``: answer from a retrieved document, quoting a passage of it in full
- ``copy_agent``: an agent transcript whose tool outputs the final answer repeats

Sources, all offline: Python standard-library modules and the language reference
topics of ``pydoc_data`` (Python Software Foundation License), and data and typos made
by this script from fixed seeds. The output depends only on the Python version whose
standard library is read (the committed file came from CPython 3.11).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sysconfig
from pathlib import Path

from vllm_graft.assets.datasets import COPY_FILE, COPY_KINDS

PER_KIND = 8
MIN_CHARS, MAX_CHARS = 1200, 3200  # about 300-900 tokens of SmolLM2's tokenizer
SYNONYMS = {"result": "outcome", "data": "payload", "name": "label", "value": "item",
            "path": "file_path", "line": "row", "text": "content", "args": "arguments",
            "self": "self", "obj": "target", "key": "lookup_key", "items": "entries",
            "source": "origin", "filename": "file_name", "node": "element",
            "parts": "pieces", "lines": "rows", "prefix": "head", "index": "position"}


def stdlib_modules() -> list[Path]:
    """The standard library's top-level modules, in name order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def function_spans(path: Path, annotated: bool | None = None) -> list[str]:
    """Runs of consecutive top-level functions of ``path`` of MIN_CHARS-MAX_CHARS
    characters (with ``annotated=False``: functions without annotations only)."""
    try:
        source = path.read_text()
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    spans, run = [], []
    for node in tree.body:
        plain = isinstance(node, ast.FunctionDef) and (annotated is None or not any(
            a.annotation for a in node.args.args) and node.returns is None)
        if not plain:
            run = []
            continue
        run.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
        text = "\n\n\n".join(run)
        if len(text) > MAX_CHARS:
            run = run[-1:] if len(run[-1]) <= MAX_CHARS else []
        elif len(text) >= MIN_CHARS and len(run) >= 2:
            spans.append(text)
            run = []
    return spans


def renamed_identifier(code: str) -> tuple[str, str] | None:
    """The most used local name of ``code`` (an argument or an assigned name of at least
    three letters) and its new name."""
    tree = ast.parse(code)
    counts: dict[str, int] = {}
    bound = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
             for a in n.args + n.kwonlyargs}
    bound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id in bound:
            counts[n.id] = counts.get(n.id, 0) + 1
        elif isinstance(n, ast.arg) and n.arg in bound:
            counts[n.arg] = counts.get(n.arg, 0) + 1
    names = sorted((c, name) for name, c in counts.items()
                   if len(name) >= 3 and name != "self" and c >= 4)
    if not names:
        return None
    old = names[-1][1]
    return old, SYNONYMS.get(old, f"{old}_value")


def code_kinds(modules: list[Path]) -> tuple[list[dict], list[dict]]:
    rename, hints = [], []
    for i, path in enumerate(modules):
        if len(rename) < PER_KIND and i % 2 == 0:
            for span in function_spans(path):
                found = renamed_identifier(span)
                if found:
                    old, new = found
                    rename.append(record("copy_rename", f"stdlib:{path.name}", (
                        f"Rename `{old}` to `{new}` everywhere in the following Python "
                        "code. Keep everything else exactly as it is and return the "
                        f"complete code.\n\n```python\n{span}\n```")))
                    break
        if len(hints) < PER_KIND and i % 2 == 1:
            spans = function_spans(path, annotated=False)
            if spans:
                hints.append(record("copy_typehints", f"stdlib:{path.name}", (
                    "Add type hints to every function in the following Python code and a "
                    "docstring to each function that has none. Keep the code otherwise "
                    f"unchanged and return the complete code.\n\n```python\n{spans[0]}\n```")))
    return rename, hints


def reference_topics() -> list[tuple[str, str]]:
    """The language reference's topics (``pydoc_data``) of MIN_CHARS-MAX_CHARS
    characters, in name order."""
    from pydoc_data.topics import topics

    return [(name, text.strip()) for name, text in sorted(topics.items())
            if MIN_CHARS <= len(text.strip()) <= MAX_CHARS]


def with_mistakes(text: str, rng: random.Random) -> str:
    """``text`` with a letter pair swapped in about one word of ten, and some "the"
    doubled and "its" written "it's"."""
    def mistake(match: re.Match) -> str:
        word = match.group(0)
        if word == "its" and rng.random() < 0.7:
            return "it's"
        if word == "the" and rng.random() < 0.2:
            return "the the"
        if len(word) >= 5 and word.isalpha() and rng.random() < 0.1:
            j = rng.randrange(1, len(word) - 2)
            return word[:j] + word[j + 1] + word[j] + word[j + 2:]
        return word
    return re.sub(r"[A-Za-z]+", mistake, text)


def prose_kinds() -> tuple[list[dict], list[dict]]:
    topics = reference_topics()
    spelling, rag = [], []
    rng = random.Random(52)
    for name, text in topics[0::2][:PER_KIND]:
        spelling.append(record("copy_spelling", f"pydoc_data:{name}", (
            "Fix the spelling and grammar mistakes in the following text. Change nothing "
            f"else and return the corrected text in full.\n\n{with_mistakes(text, rng)}")))
    for name, text in topics[1::2][:PER_KIND]:
        paragraphs = [p for p in text.split("\n\n") if len(p) >= 200]
        quoted = paragraphs[len(paragraphs) // 2] if paragraphs else text
        opening = " ".join(quoted.split()[:8])
        rag.append(record("copy_rag", f"pydoc_data:{name}", (
            f"Retrieved document:\n\n{text}\n\nUsing only the document above, answer: what "
            f"does it say in the passage that begins \"{opening}\"? Quote that passage word "
            "for word in full, then explain it in one sentence.")))
    return spelling, rag


CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Quebec", "Tunis", "Perth",
          "Krakow", "Bogota", "Hanoi", "Accra", "Dublin", "Tallinn", "Cusco", "Riga"]
NAMES = ["Ada", "Bram", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana", "Ines", "Jonas",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tomo"]


def reformat_kind() -> list[dict]:
    rng = random.Random(7)
    out = []
    for i in range(PER_KIND):
        rows = []
        for j in range(14 + 2 * i):
            rows.append({"id": 1000 + 37 * j + i, "name": rng.choice(NAMES),
                         "city": rng.choice(CITIES), "orders": rng.randrange(1, 500),
                         "revenue": round(rng.uniform(10, 9999), 2),
                         "joined": f"20{rng.randrange(10, 26)}-{rng.randrange(1, 13):02d}-"
                                   f"{rng.randrange(1, 29):02d}"})
        if i % 2 == 0:
            header = ",".join(rows[0])
            body = "\n".join(",".join(str(v) for v in r.values()) for r in rows)
            out.append(record("copy_reformat", "generated:csv", (
                "Convert the following CSV data into a Markdown table with the same columns "
                f"and rows, in the same order.\n\n```csv\n{header}\n{body}\n```")))
        else:
            services = {f"service_{r['id']}": {"owner": r["name"], "region": r["city"],
                                               "replicas": r["orders"] % 9 + 1,
                                               "limits": {"cpu": f"{r['orders'] % 4 + 1}",
                                                          "memory": f"{r['orders']}Mi"},
                                               "since": r["joined"]} for r in rows[:10]}
            out.append(record("copy_reformat", "generated:json", (
                "Convert the following JSON document into YAML with the same keys and "
                "values, in the same order.\n\n```json\n"
                f"{json.dumps({'services': services}, indent=2)}\n```")))
    return out


def agent_kind(modules: list[Path]) -> list[dict]:
    rng = random.Random(11)
    out = []
    for path in modules[len(modules) // 3:]:
        spans = function_spans(path)
        if not spans or len(out) == PER_KIND:
            continue
        code = spans[0][:MAX_CHARS * 2 // 3]
        code = code[:code.rfind("\n")]
        first = code.splitlines()[0]
        line = rng.randrange(5, 40)
        transcript = (
            f"User: The tests of {path.stem} fail after the last change. Find the cause.\n\n"
            f"Assistant: I will read the file first.\n"
            f"Tool call: read_file(\"Lib/{path.name}\")\n"
            f"Tool output:\n{code}\n\n"
            f"Assistant: Now I run the tests.\n"
            f"Tool call: run(\"python -m pytest tests/test_{path.stem}.py -x -q\")\n"
            f"Tool output:\nF\n=== FAILURES ===\n___ test_{path.stem}_roundtrip ___\n"
            f"Lib/{path.name}:{line}: in {first.split('(')[0].replace('def ', '')}\n"
            f"    {first.strip()}\nE   AssertionError\n1 failed, {rng.randrange(8, 60)} "
            f"passed in {rng.uniform(0.2, 3):.2f}s\n\n"
            "User: Write your report: repeat the file you read exactly as the tool showed "
            "it, then the test output exactly as shown, then say in one sentence what to "
            "check next.")
        out.append(record("copy_agent", f"stdlib:{path.name}", transcript))
    return out


def record(kind: str, source: str, prompt: str) -> dict:
    return {"kind": kind, "source": source, "prompt": prompt}


def build() -> list[dict]:
    """Every prompt, kind by kind, each with its ``id`` (kind and number)."""
    modules = stdlib_modules()
    rename, hints = code_kinds(modules)
    spelling, rag = prose_kinds()
    records = [*rename, *hints, *spelling, *reformat_kind(), *rag, *agent_kind(modules)]
    numbered = []
    for kind in COPY_KINDS:
        of_kind = [r for r in records if r["kind"] == kind]
        numbered += [{"id": f"{kind}-{i:02d}", **r} for i, r in enumerate(of_kind)]
    return numbered


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=COPY_FILE, help="the JSONL file to write")
    args = p.parse_args(argv)
    records = build()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    counts = {k: sum(r["kind"] == k for r in records) for k in COPY_KINDS}
    print(f"{args.out}: {len(records)} prompts, {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
