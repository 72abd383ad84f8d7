"""`data convert` and `data synth` with a bucket (``s3://``, ``gs://``) for --out or an input.

Both commands write their parts under temporary names and rename them at the end, and convert's
parsers read local files; a bucket renames nothing. So a bucket --out is written into a local
temporary directory (``$TMPDIR``; it needs room for the dataset) and uploaded when the command
succeeds: the Parquet parts first, ``_dataset.json`` last, so a reader never finds the metadata of
files not yet there; then the old parts that were not rewritten are deleted (--overwrite). A bucket
input of `convert` is downloaded into a temporary directory first. The directory lock of a local
--out (tpurec/data/out_lock.py) has no counterpart in a bucket: one writer at a time.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from tpurec.data.schema import DATASET_JSON, DataError
from tpurec.runtime import storage


@contextmanager
def staged_output(out: str, overwrite: bool) -> Iterator[str]:
    """The directory to write: `out` itself when local; for a bucket URI a temporary local
    directory whose files are uploaded to `out` when the block ends without an error."""
    if not storage.is_uri(out):
        yield out
        return
    dest = storage.path(out)
    if not dest.bucket_exists():
        raise DataError(f"--out {out}: {dest.missing_reason()}")
    existing = sorted(dest.glob("*.parquet"))
    if existing and not overwrite:
        raise DataError(f"{out} already holds {len(existing)} .parquet files; use --overwrite")
    with tempfile.TemporaryDirectory(prefix="tpurec-out-") as local:
        yield local
        upload(local, out)


def upload(local: str, out: str) -> list[str]:
    """The files of directory `local` copied to bucket directory `out`, ``_dataset.json`` last;
    .parquet objects of `out` not among them deleted after. Returns the names uploaded."""
    from pyarrow import fs as pafs

    dest = storage.path(out)
    names = sorted(n for n in os.listdir(local) if os.path.isfile(os.path.join(local, n)) and not n.startswith("."))
    names.sort(key=lambda n: n == DATASET_JSON)  # stable: the metadata goes last
    for name in names:
        fs, key = storage.arrow(dest / name)
        try:
            pafs.copy_files(
                os.path.join(local, name), key, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs
            )
        except OSError as e:
            raise DataError(f"{dest / name}: upload failed ({str(e).strip().splitlines()[0]})") from None
    for stale in dest.glob("*.parquet"):
        if stale.name not in names:
            stale.unlink(missing_ok=True)
    return names


@contextmanager
def staged_inputs(inputs: list[str]) -> Iterator[list[str]]:
    """`inputs` with each bucket file or directory replaced by a local copy (one level of a
    directory: the files convert reads), a glob in the last part of a URI (``s3://b/day_*.gz``: no
    shell expands it) by the files it matches; local ones as given."""
    if not any(storage.is_uri(p) for p in inputs):
        yield inputs
        return
    from pyarrow import fs as pafs

    expanded: list[str] = []
    for p in inputs:
        if storage.is_uri(p) and any(c in p.rpartition("/")[2] for c in "*?["):
            found = sorted(str(f) for f in storage.path(p).parent.glob(p.rpartition("/")[2]) if f.is_file())
            if not found:
                raise DataError(f"{p}: no file matches")
            expanded += found
        else:
            expanded.append(p)
    with tempfile.TemporaryDirectory(prefix="tpurec-in-") as local:
        out = []
        for i, p in enumerate(expanded):
            if not storage.is_uri(p):
                out.append(p)
                continue
            src = storage.path(p)
            if not src.exists():
                raise DataError(f"{p}: {src.missing_reason()}")
            files = [f for f in src.iterdir() if f.is_file()] if src.is_dir() else [src]
            into = os.path.join(local, str(i))
            os.makedirs(into)
            for f in files:
                fs, key = storage.arrow(f)
                pafs.copy_files(key, os.path.join(into, f.name), source_filesystem=fs)
            out.append(into if src.is_dir() else os.path.join(into, src.name))
        yield out
