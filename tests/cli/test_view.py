"""The generate view on a recorded step trace (no engine): every token's colour and
letter follow the source its tree recorded, target tokens stay uncoloured."""

from __future__ import annotations

import io

from rich.console import Console

from vllm_graft.cli.sources import external_id, label_output, mismatches, records_by_request
from vllm_graft.cli.view import STYLES, answer_text, comparison_table, show_answer

PROMPT_LEN = 5
# Output of one request, 7 tokens (max_tokens 7). The prefill emits output[0]; the tree
# rooted at position 5 (output[0]) accepts a drafted then a "both" node, then the
# target's bonus output[3]; a tree-less step emits output[4]; the tree rooted at
# position 9 (output[4]) accepts a retrieved node, a padding node and a drafted one that
# falls past max_tokens (vLLM drops it, with the bonus).
TOKENS = [10, 11, 12, 13, 14, 15, 16]
RECORDS = [
    {"req_id": "0-1a2b3c4d", "position": 5, "source": [0, 1, 3, 2, 1],
     "accepted_rows": [1, 2], "accepted_tokens": [11, 12]},
    {"req_id": "0-1a2b3c4d", "position": 9, "source": [0, 2, 1, 4, 1],
     "accepted_rows": [1, 3, 4], "accepted_tokens": [15, 16, 99]},
]
# the later tree is placed by position, not by order, so shuffle the trace
RECORDS.reverse()
EXPECTED = ["target", "draft", "both", "target", "target", "retrieved", "padding"]
PIECES = ["The", " cat", " sat", " on", " the", " mat", "."]


def _labelled():
    return label_output(records_by_request(RECORDS)["0"], PROMPT_LEN, TOKENS)


def test_trace_labels_follow_recorded_sources():
    labelled = _labelled()
    assert labelled.sources == EXPECTED
    assert labelled.cut == {"draft": 1}  # the accepted node vLLM cut at max_tokens
    assert mismatches(RECORDS, PROMPT_LEN, TOKENS) == []
    assert mismatches(RECORDS, PROMPT_LEN, [10, 11, 0, 13, 14, 15, 16]) == [2]


def test_internal_request_ids_map_to_the_callers():
    assert external_id("17-0123abcd") == "17"
    assert external_id("chat-3-0123abcd") == "chat-3"
    assert external_id("plain") == "plain"


def test_colours_match_sources():
    text = answer_text(PIECES, _labelled().sources)
    assert text.plain == "".join(PIECES)
    styled = {(span.start, span.end): str(span.style) for span in text.spans}
    offset = 0
    for piece, source in zip(PIECES, EXPECTED):
        span = (offset, offset + len(piece))
        if source == "target":
            assert span not in styled  # the target's own tokens are left as they are
        else:
            assert styled[span] == STYLES[source]
        offset += len(piece)
    assert len(set(STYLES[s] for s in ("draft", "retrieved", "both", "padding"))) == 4


def test_terminal_output_is_coloured_and_piped_output_plain():
    sources = _labelled().sources
    tty = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=100)
    show_answer(tty, "Tell me about cats.", PIECES, sources)
    assert "\x1b[1;36m cat" in tty.file.getvalue()  # bold cyan: drafted
    assert "\x1b[1;32m sat" in tty.file.getvalue()  # bold green: both
    assert "\x1b[1;35m mat" in tty.file.getvalue()  # bold magenta: retrieved

    piped = Console(file=io.StringIO(), width=20)  # narrower than the answer: not wrapped
    show_answer(piped, "Tell me about cats.", PIECES, sources)
    lines = piped.file.getvalue().splitlines()
    assert "\x1b" not in piped.file.getvalue()
    assert lines[1] == "answer  The cat sat on the mat."
    assert lines[2] == "sources .db..rp"


def test_comparison_table_lists_the_compared_numbers():
    report = {"graft": {"tokens_per_s": 50.0, "mean_accepted_tokens": 1.98,
                        "draft_forwards_per_tree": 1.62, "matrix_hit_rate": 0.83},
              "plain": {"tokens_per_s": 100.0}, "speedup": 0.5, "greedy_identical": True}
    console = Console(file=io.StringIO(), width=100)
    console.print(comparison_table(report))
    out = console.file.getvalue()
    for expected in ("tokens/s", "50.0", "100.0", "MAT", "1.98", "0.50x", "1.62",
                     "83 %", "greedy output identical", "yes"):
        assert expected in out, expected


def test_comparison_table_shows_budget_autos_modes_and_the_warm_up():
    report = {"graft": {"tokens_per_s": 90.0,
                        "steps_by_mode": {"tree": 2, "chain": 30, "plain": 40}},
              "plain": {"tokens_per_s": 80.0}, "speedup": 1.125, "warmup_tokens": 16}
    console = Console(file=io.StringIO(), width=100)
    console.print(comparison_table(report))
    out = console.file.getvalue()
    for expected in ("steps: tree / chain / plain", "2 / 30 / 40", "1.12x",
                     "untimed warm-up (16 tokens a prompt)"):
        assert expected in out, expected
    del report["warmup_tokens"], report["graft"]["steps_by_mode"]
    console = Console(file=io.StringIO(), width=100)
    console.print(comparison_table(report))
    assert "warm-up" not in console.file.getvalue()
    assert "steps:" not in console.file.getvalue()
