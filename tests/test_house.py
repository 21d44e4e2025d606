"""The floor plan holds: no import cycle among vllm_graft's modules (imports inside
functions count: they hide a cycle, they do not remove it), no module over 600 lines,
and the layers import downwards only (the algorithm core never imports the vLLM adapter,
the CLI or the bench harness; the harness never imports the CLI)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_graft"
MAX_LINES = 600

#: room -> rooms it must never import (its own or any module below them)
LAYERS_BELOW = {
    "vllm_graft.core": ("vllm_graft.vllm", "vllm_graft.cli", "vllm_graft.bench",
                        "vllm_graft.training"),
    "vllm_graft.kernels": ("vllm_graft.vllm", "vllm_graft.cli", "vllm_graft.bench",
                           "vllm_graft.core"),
    "vllm_graft.vllm": ("vllm_graft.cli", "vllm_graft.bench"),
    "vllm_graft.bench": ("vllm_graft.cli",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path) -> set[str]:
    """The vllm_graft modules ``name`` imports anywhere in its body: ``from a import b``
    names the submodule ``a.b`` when there is one, else the module ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_at_most_600_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(PACKAGE.parent)}: {lines} lines"


def test_layers_import_downwards_only():
    wrong = [(name, target) for name, targets in GRAPH.items() for target in targets
             for room, forbidden in LAYERS_BELOW.items()
             if (name == room or name.startswith(room + "."))
             and any(target == f or target.startswith(f + ".") for f in forbidden)]
    assert wrong == []
