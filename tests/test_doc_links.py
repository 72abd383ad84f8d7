"""Every relative link in the README and docs/ names a file that exists (and a heading, for #anchors)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(REPO)}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                headings = [_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)]
                if anchor not in headings:
                    bad.append(f"{doc.relative_to(REPO)}: {target}: no such heading")
    assert not bad, "\n".join(bad)
