"""Checksums of a checkpoint's files, written before its COMPLETE marker and verified before use.

A checkpoint directory with COMPLETE was fully written, but a disk error, a partial copy or a
flipped byte later would still load as "exact" (DCP does not verify its data). `write_checksums`
records every file's size and SHA-256 in CHECKSUMS.json (after fsync-ing the files, so the
marker never precedes the data on disk); `problems` re-reads them and names what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CHECKSUMS = "CHECKSUMS.json"
_SKIP = {CHECKSUMS, "COMPLETE"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in _SKIP)


def write_checksums(directory) -> dict:
    """fsync every file of `directory`, then write CHECKSUMS.json (itself fsync-ed)."""
    directory = Path(directory)
    table = {}
    for p in _files(directory):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        table[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    out = directory / CHECKSUMS
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return table


def problems(directory) -> list[str] | None:
    """What differs from CHECKSUMS.json (empty: intact); None when the checkpoint has no checksums."""
    directory = Path(directory)
    path = directory / CHECKSUMS
    if not path.exists():
        return None
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"{path}: unreadable ({e})"]
    found = []
    for name, want in table.items():
        p = directory / name
        if not p.is_file():
            found.append(f"{p}: missing")
        elif p.stat().st_size != want["bytes"]:
            found.append(f"{p}: {p.stat().st_size:,} bytes, {want['bytes']:,} written")
        elif _sha256(p) != want["sha256"]:
            found.append(f"{p}: contents changed since it was written (checksum mismatch)")
    return found
