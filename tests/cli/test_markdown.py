"""The Markdown tables every report renders (benchmark, scripts, GPU check)."""

import pytest

from vllm_graft.markdown import markdown_table, records_table


def test_a_table_has_a_header_an_aligned_rule_and_one_line_per_row():
    lines = markdown_table(["method", "tok/s"], [["plain", 48.1], ["graft", "1.2x"]],
                           align="lr", cell=lambda v: f"{v:.2f}")
    assert lines == ["| method | tok/s |", "|---|---:|", "| plain | 48.10 |",
                     "| graft | 1.2x |"]  # strings are kept as they are
    assert markdown_table(["a"], [])[1] == "|---|"  # left aligned by default


def test_records_fill_their_columns_and_a_missing_key_is_an_empty_cell():
    records = [{"batch": 1, "ms": 0.5}, {"batch": 8}]
    assert records_table(records) == ["| batch | ms |", "|---|---|", "| 1 | 0.5 |",
                                      "| 8 |  |"]
    assert records_table(records, ["ms"])[2:] == ["| 0.5 |", "|  |"]


@pytest.mark.parametrize("call, message", [
    (lambda: markdown_table(["a", "b"], [], align="l"), "align"),
    (lambda: markdown_table(["a", "b"], [], align="lc"), "align"),
    (lambda: markdown_table(["a", "b"], [[1]]), "1 cells for 2 columns"),
    (lambda: records_table([]), "columns"),
])
def test_a_malformed_table_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
