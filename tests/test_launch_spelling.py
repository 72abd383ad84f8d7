"""One way to launch, as written after `make install`: `.venv/bin/torchrun` and `.venv/bin/python`
(make install puts both there; a plain `torchrun` is not on PATH unless the venv is activated)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A launch command spelled another way: bare `torchrun --...`, `python -m torch.distributed.run --...`,
# or an example run with a bare `python`.
OTHER_SPELLINGS = re.compile(
    r"(?<![\w/.-])torchrun\s+--|python[\d.]*\s+-m\s+torch\.distributed\.run\s+--|(?<![\w/.-])python[\d.]*\s+examples/"
)


def _texts():
    yield REPO / "README.md"
    yield from sorted((REPO / "docs").glob("*.md"))
    yield from sorted((REPO / "examples").glob("*.py"))
    yield from sorted((REPO / "tpurec").rglob("*.py"))


def test_docs_and_examples_launch_one_way():
    bad = [
        f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for path in _texts()
        for text in [path.read_text()]
        for m in OTHER_SPELLINGS.finditer(text)
    ]
    assert not bad, "spell launches as .venv/bin/torchrun / .venv/bin/python:\n" + "\n".join(bad)


def test_the_pattern_sees_the_other_spellings():
    for wrong in (
        "torchrun --standalone x.py",
        "python -m torch.distributed.run --nproc-per-node 2",
        "python examples/q.py",
    ):
        assert OTHER_SPELLINGS.search(wrong), wrong
    for right in (".venv/bin/torchrun --standalone x.py", ".venv/bin/python examples/q.py", "under torchrun over gloo"):
        assert not OTHER_SPELLINGS.search(right), right
    assert (REPO / ".venv" / "bin" / "torchrun").exists() or not (REPO / ".venv").exists()
