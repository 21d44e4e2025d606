"""One verified hybrid tree drawn in the terminal (``vllm-graft generate --show-tree``).

A tree record (:func:`vllm_graft.vllm.rpc.take_tree_records`) holds the rows of one
verified tree, root first: each row's token, parent row, source flags
(:data:`vllm_graft.cli.sources.FLAG_LABELS`), the rows the target accepted, and where
drafting stopped (``stage``, an index into the drafting checkpoints; one past the last:
no checkpoint stopped it). The view draws every branch coloured by its source, the
accepted path bold with a tick, and one line of checkpoints: those passed, the one that
pruned the drafting, those never reached. Every node also carries its source letter, so
the drawing reads the same without colours. Nothing here imports vLLM.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable

from rich.console import Console, Group
from rich.text import Text
from rich.tree import Tree

from vllm_graft.cli.sources import BOTH, CONTEXT, DRAFT, FLAG_LABELS, RETRIEVED, TARGET
from vllm_graft.cli.view import LETTERS, STYLES
from vllm_graft.core.config import PAPER_CHECKPOINTS

#: the letters and marks of the drawing
KEY = Text.assemble(*(part for label, name in ((DRAFT, "drafted"), (RETRIEVED, "retrieved"),
                                               (BOTH, "both"), (CONTEXT, "copied from the context"))
                      for part in ((f"{LETTERS[label]} {name}", STYLES[label]), "  ")),
                    ("\u2713 accepted", "bold green"), style="dim")
#: nodes drawn at most (the accepted path always; then rows in the order they were built)
MAX_NODES = 24


def is_chain(parents: list[int]) -> bool:
    """Every row the child of the row before: a copy chain or an EAGLE-style chain."""
    return all(parent == row - 1 for row, parent in enumerate(parents) if row)


def pick_tree(records: list[dict]) -> dict | None:
    """The record most worth drawing: a tree before a chain, then the longest accepted
    path, the most kinds of source, the most rows; None without records."""
    def worth(record: dict) -> tuple:
        kinds = {FLAG_LABELS.get(flag, TARGET) for flag in record["source"][1:]}
        return (not is_chain(record["parents"]), len(record["accepted_rows"]), len(kinds),
                len(record["tokens"]))
    return max(records, key=worth, default=None)


def shown_rows(parents: list[int], accepted: set[int], max_nodes: int) -> list[int]:
    """Rows to draw, root first: the accepted path, then rows in build order while there
    is room, each with its ancestors (a row's parent comes before it in build order)."""
    keep: set[int] = {0}

    def add(row: int) -> None:
        while row > 0 and row not in keep:
            keep.add(row)
            row = parents[row]

    for row in sorted(accepted):
        add(row)
    for row in range(1, len(parents)):
        if len(keep) >= max_nodes:
            break
        add(row)
    return sorted(keep)


def checkpoint_line(stage: int, checkpoints: tuple[int, ...] | None,
                    confidence: list[float] | None) -> Text:
    """Each drafting checkpoint: passed, pruned here, or not reached (``stage`` -1: the
    tree had no drafting)."""
    text = Text()
    text.append("checkpoints ", style="bold")
    if stage < 0:
        return text.append("none: no drafting (retrieval and copies only)")
    if not checkpoints:
        return text.append(f"drafting stopped at stage {stage}")
    for index, step in enumerate(checkpoints):
        if index:
            text.append("  ")
        name = f"draft step {step}"
        if index < stage:
            text.append(f"{name} passed", style="green")
        elif index == stage:
            text.append(f"{name} pruned the drafting", style="bold red")
            if confidence and step < len(confidence) and confidence[step] == confidence[step]:
                text.append(f" (best path {confidence[step]:.2f})", style="red")
        else:
            text.append(f"{name} not reached", style="dim")
    if stage >= len(checkpoints):
        text.append("  (drafted to full depth)", style="green")
    return text


def node_label(piece: str, label: str, accepted: bool) -> Text:
    text = Text()
    text.append(json.dumps(piece, ensure_ascii=False), style=(STYLES.get(label) or "") +
                (" reverse" if accepted else ""))
    text.append(f" {LETTERS.get(label, '?')}", style="dim")
    if accepted:
        text.append(" \u2713", style="bold green")
    return text


def tree_view(record: dict, piece: Callable[[int], str], checkpoints: tuple[int, ...] | None = None,
              max_nodes: int = MAX_NODES) -> Group:
    """One verified tree: a header (rows, accepted tokens), the branches under the root
    with the accepted path marked, a line of hidden rows when the tree is larger than
    ``max_nodes``, and the checkpoints. ``piece(token)`` is the token's text."""
    tokens, parents, sources = record["tokens"], record["parents"], record["source"]
    accepted = set(record["accepted_rows"])
    rows = shown_rows(parents, accepted, max_nodes)
    chain = " (a chain)" if is_chain(parents) else ""
    header = Text(f"verified tree{chain}: {len(tokens) - 1} nodes, {len(accepted)} accepted "
                  f"+ 1 bonus token from the target", style="bold")
    branches: dict[int, Tree] = {0: Tree(node_label(piece(tokens[0]), TARGET, False)
                                         .append("  (root: the last token decoded)", style="dim"))}
    for row in rows[1:]:
        label = FLAG_LABELS.get(sources[row], TARGET)
        branches[row] = branches[parents[row]].add(node_label(piece(tokens[row]), label,
                                                              row in accepted))
    parts: list = [header, branches[0]]
    if len(rows) < len(tokens):
        parts.append(Text(f"... {len(tokens) - len(rows)} more nodes not drawn", style="dim"))
    parts.append(checkpoint_line(record.get("stage", -1), checkpoints, record.get("confidence")))
    parts.append(KEY)
    return Group(*parts)


def tree_text(record: dict, piece: Callable[[int], str], checkpoints: tuple[int, ...] | None = None,
              max_nodes: int = MAX_NODES, width: int = 100) -> str:
    """:func:`tree_view` as plain text (no colours): for logs, pipes and tests."""
    console = Console(width=width, color_system=None, force_terminal=False, file=io.StringIO())
    console.print(tree_view(record, piece, checkpoints, max_nodes))
    return console.file.getvalue()


def tree_to_draw(records: list[dict], tokenizer) -> dict | None:
    """One request's tree most worth drawing (:func:`pick_tree`), with each row's text
    (``pieces``, each token decoded alone) for :func:`show_trees`."""
    record = pick_tree(records)
    if record is None:
        return None
    return {**record, "pieces": [tokenizer.decode([token]) for token in record["tokens"]]}


def graft_checkpoints(spec: dict | None) -> tuple[int, ...]:
    """The drafting checkpoints of a Graft speculative config (the default: the paper's)."""
    return tuple(((spec or {}).get("graft") or {}).get("checkpoints", PAPER_CHECKPOINTS))


def show_trees(console: Console, prompts: list[str], trees: list[dict | None],
               checkpoints: tuple[int, ...] | None) -> None:
    """Per prompt, its tree most worth drawing, or why there is none."""
    for prompt, tree in zip(prompts, trees):
        first_line = prompt.strip().splitlines()[0] if prompt.strip() else ""
        console.print(Text("tree of  ", style="bold") + Text(first_line[:80]))
        if tree is None:
            console.print(Text("no tree verified: every step of this answer decoded plainly "
                               "(budget \"auto\" drafts where it pays)", style="dim"))
        else:
            console.print(tree_view(tree, dict(zip(tree["tokens"], tree["pieces"])).get,
                                    checkpoints))
        console.print()
