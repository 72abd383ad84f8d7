"""The README's status table stays readable (issue 62): no cell over 40 words; the detail lives in docs/."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_WORDS = 40


def _cells(text: str) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [cell.strip() for row in rows for cell in row.strip().strip("|").split("|")]


def test_no_status_cell_is_over_40_words():
    cells = _cells(README.read_text())
    assert len(cells) > 30, "the status table should be found"
    long = {cell[:60]: len(cell.split()) for cell in cells if len(cell.split()) > MAX_WORDS}
    assert not long, long


def test_the_check_counts_words_of_a_cell():
    table = "| a | b |\n|---|---|\n| " + " ".join(["w"] * 41) + " | x |\n"
    assert [len(c.split()) for c in _cells(table)] == [1, 1, 41, 1]
