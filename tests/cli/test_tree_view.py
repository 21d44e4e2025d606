"""The terminal drawing of one verified hybrid tree (``generate --show-tree``), on a
hand-made tree record in the layout the worker records (no engine)."""

from __future__ import annotations

from vllm_graft.cli.tree_view import is_chain, pick_tree, shown_rows, tree_text

PIECES = {10: "def", 11: " is", 12: "_pal", 13: " foo", 14: "\n", 15: " bar", 16: "indrome",
          17: "(s"}
#: root, a drafted branch (" is" -> "_pal" -> "indrome", accepted), a drafted sibling,
#: a retrieved branch with context copies under it
TREE = {"tokens": [10, 11, 12, 13, 14, 15, 16, 17], "parents": [-1, 0, 1, 0, 3, 1, 2, 4],
        "source": [0, 1, 3, 2, 8, 1, 9, 10], "accepted_rows": [1, 2, 6], "stage": 1,
        "confidence": [0.9, 0.4, float("nan")]}
CHAIN = {"tokens": [10, 11, 12, 13], "parents": [-1, 0, 1, 2], "source": [0, 8, 8, 8],
         "accepted_rows": [1, 2, 3], "stage": -1, "confidence": []}


def test_every_branch_is_drawn_under_its_parent_with_its_source_and_the_accepted_path():
    lines = tree_text(TREE, PIECES.get, checkpoints=(0, 1, 5)).splitlines()
    assert lines[0] == "verified tree: 7 nodes, 3 accepted + 1 bonus token from the target"
    assert lines[1].startswith('"def"')
    assert lines[2:9] == ['├── " is" d ✓',
                          '│   ├── "_pal" b ✓',
                          '│   │   └── "indrome" c ✓',
                          '│   └── " bar" d',
                          '└── " foo" r',
                          '    └── "\\n" c',
                          '        └── "(s" c']


def test_the_checkpoint_that_pruned_the_drafting_is_named():
    text = tree_text(TREE, PIECES.get, checkpoints=(0, 1, 5), width=200)
    assert ("checkpoints draft step 0 passed  draft step 1 pruned the drafting (best path "
            "0.40)  draft step 5 not reached") in text
    full = tree_text({**TREE, "stage": 3}, PIECES.get, checkpoints=(0, 1, 5), width=200)
    assert "draft step 5 passed  (drafted to full depth)" in full
    assert "no drafting" in tree_text(CHAIN, PIECES.get, checkpoints=(0, 1, 5))


def test_a_large_tree_keeps_the_accepted_path_and_says_what_it_left_out():
    parents = [-1] + [0] * 30 + [30]  # 30 children of the root; row 31 under row 30
    record = {"tokens": list(range(32)), "parents": parents, "source": [0] + [1] * 31,
              "accepted_rows": [30, 31], "stage": 0, "confidence": []}
    rows = shown_rows(parents, {30, 31}, max_nodes=5)
    assert rows[:1] == [0] and {30, 31} <= set(rows) and len(rows) == 5
    text = tree_text(record, str, max_nodes=5)
    assert "27 more nodes not drawn" in text and '"31" d ✓' in text


def test_the_tree_worth_drawing_is_hybrid_before_a_longer_chain():
    assert is_chain(CHAIN["parents"]) and not is_chain(TREE["parents"])
    assert pick_tree([CHAIN, TREE]) is TREE
    assert pick_tree([]) is None
    assert "(a chain)" in tree_text(CHAIN, PIECES.get)


def test_among_trees_the_longest_accepted_path_is_drawn():
    short = {**TREE, "accepted_rows": [3]}
    assert pick_tree([short, TREE]) is TREE
