"""Checksums of a checkpoint's files, written before its COMPLETE marker and verified before use.

A checkpoint directory with COMPLETE was fully written, but a disk error, a partial copy or a
flipped byte later would still load as "exact" (DCP does not verify its data). `write_checksums`
records every file's size and SHA-256 in CHECKSUMS.json (after fsync-ing the files, so the
marker never precedes the data on disk); `problems` re-reads them and names what differs.

The manifest itself is checked first (`read_manifest`): it must exist and list every file the
checkpoint holds. A manifest that is missing, malformed, or lists fewer files than are there would
otherwise switch verification off for what it leaves out (`{}` verifies nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath

from tpurec import strict_json
from tpurec.errors import UserError
from tpurec.runtime import storage

CHECKSUMS = "CHECKSUMS.json"
_SKIP = {CHECKSUMS, "COMPLETE"}
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(UserError):
    """CHECKSUMS.json is missing, malformed or incomplete: the checkpoint cannot be verified."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in _SKIP)


def write_checksums(where: str | os.PathLike) -> dict:
    """fsync every file of directory `where`, then write CHECKSUMS.json (itself fsync-ed)."""
    directory = storage.path(where)
    table = {}
    for p in _files(directory):
        if not storage.is_uri(p):  # an object in a bucket is durable once its write returned
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        table[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    out = directory / CHECKSUMS
    if storage.is_uri(out):
        out.write_text(strict_json.dumps(table, indent=1))
        return table
    with open(out, "w") as f:
        strict_json.dump(table, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return table


def read_manifest(where: str | os.PathLike) -> dict[str, dict]:
    """CHECKSUMS.json as {relative path: {"bytes": int, "sha256": hex}}, covering every file of
    directory `where`; ManifestError (one line naming the file and what is wrong) otherwise."""
    directory = storage.path(where)
    path = directory / CHECKSUMS
    if not path.is_file():
        raise ManifestError(f"{path} is missing, so no file of the checkpoint can be checked")
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: unreadable ({e})") from None
    if not isinstance(table, dict):
        raise ManifestError(f"{path}: a JSON {type(table).__name__}, not an object of file -> {{bytes, sha256}}")
    for name, want in table.items():
        problem = _entry_problem(name, want)
        if problem:
            raise ManifestError(f"{path}: entry {name!r}: {problem}")
    unlisted = [str(p.relative_to(directory)) for p in _files(directory) if str(p.relative_to(directory)) not in table]
    if unlisted:
        more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
        have = len(_files(directory))
        raise ManifestError(
            f"{path} lists {have - len(unlisted)} of the checkpoint's {have} files; not listed: "
            f"{', '.join(unlisted[:3])}{more}"
        )
    return table


def _entry_problem(name: str, want: object) -> str | None:
    """Why one manifest entry is malformed, or None."""
    parts = PurePosixPath(name).parts
    if not name or PurePosixPath(name).is_absolute() or ".." in parts or parts[-1] in _SKIP:
        return "not a file inside the checkpoint"
    if not isinstance(want, dict):
        return f"{json.dumps(want)} is not an object with bytes and sha256"
    size, digest = want.get("bytes"), want.get("sha256")
    if type(size) is not int or size < 0:  # bool is an int: refused by the exact type
        return f'"bytes" is {json.dumps(size)}, not a size in bytes (an integer >= 0)'
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        return f'"sha256" is {json.dumps(digest)}, not 64 lowercase hex digits'
    return None


def problems(where: str | os.PathLike, table: dict[str, dict] | None = None) -> list[str]:
    """What differs from the manifest `table` (read with `read_manifest` when not given; its
    ManifestError propagates). Empty: every file is intact."""
    directory = storage.path(where)
    if table is None:
        table = read_manifest(directory)
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
