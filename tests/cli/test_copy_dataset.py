"""The copy benchmark: ``scripts/make_copy_dataset.py`` writes at least 40 prompts of six
kinds, the same every run, and the bench reads each kind of the committed file as a
dataset of its own."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import script_module
from vllm_graft.assets.datasets import COPY_FILE, COPY_KINDS, copy_prompts


@pytest.fixture(scope="module")
def generated():
    with script_module("make_copy_dataset") as module:
        yield module.build(), module.build()


def test_the_generator_writes_forty_prompts_of_six_kinds_deterministically(generated):
    first, second = generated
    assert first == second
    assert len(first) >= 40
    kinds = {r["kind"] for r in first}
    assert kinds == set(COPY_KINDS) and len(kinds) >= 6
    assert all(sum(r["kind"] == k for r in first) >= 6 for k in COPY_KINDS)
    assert len({r["id"] for r in first}) == len(first)
    assert len({r["prompt"] for r in first}) == len(first)
    assert all(r["source"].split(":")[0] in ("stdlib", "pydoc_data", "generated")
               for r in first)


def test_the_committed_file_is_the_generators(generated):
    """Data made from seeds alone is the same on every Python; the rest comes from the
    standard library of the Python that wrote the file."""
    committed = [json.loads(line) for line in COPY_FILE.read_text().splitlines()]
    assert [r["id"] for r in committed] == [r["id"] for r in generated[0]]
    seeded = [r for r in generated[0] if r["source"].startswith("generated:")]
    assert seeded and all(r in committed for r in seeded)


def test_each_kind_loads_as_a_dataset_of_chat_prompts():
    for kind in COPY_KINDS:
        prompts = copy_prompts(kind)
        assert len(prompts) == 8
        assert all(p.chat and p.source == kind and p.text for p in prompts)
    assert [p.text for p in copy_prompts("copy_rag", 2)] == \
        [p.text for p in copy_prompts("copy_rag")[:2]]


def test_the_bench_reads_copy_kinds():
    from vllm_graft.bench.runner import load_dataset

    prompts = load_dataset("copy_agent", None, COPY_FILE.parent, 3)
    assert [p.text for p in prompts] == [p.text for p in copy_prompts("copy_agent", 3)]


def test_bad_input_names_the_kind_or_the_file(tmp_path):
    with pytest.raises(ValueError, match="copy_nothing"):
        copy_prompts("copy_nothing")
    missing = tmp_path / "copy.jsonl"
    with pytest.raises(FileNotFoundError, match="make_copy_dataset"):
        copy_prompts("copy_rag", path=missing)
    missing.write_text('{"kind": "copy_rag", "prompt": "x"}\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match=r"copy.jsonl:2.*'kind'"):
        copy_prompts("copy_rag", path=missing)
