"""`tpurec train --data PATH` that is not Parquet (a file, or a directory holding Parquet files, maybe
in Hive partitions): one line saying what PATH is and the `tpurec data convert` command that makes
Parquet from it."""

from __future__ import annotations

import os
from pathlib import Path

from tpurec.runtime import storage

# What `tpurec data convert` takes (its --format auto: tpurec/data/cli.py).
TEXT_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz", ".txt", ".txt.gz", ".gz")
TORCHREC_DAY_SUFFIXES = (".npy", ".npz")


def _convert(inputs: str, out: str, table_set: str, csv: bool = False) -> str:
    fmt = " --format csv" if csv else ""
    return f"`tpurec data convert {inputs}{fmt} --out {out} --table-set {table_set}`"


def _out_for(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".csv", ".tsv", ".txt"):
        name = name.removesuffix(suffix)
    return str(path.with_name(f"{name or 'data'}_parquet"))


def data_problem(data: str, table_set: str) -> str | None:
    """None when `data` is a directory holding .parquet files; else the one line."""
    path = storage.path(data)  # a local Path, or a bucket's (tpurec/runtime/storage.py)
    if not path.exists():
        why = path.missing_reason() if storage.is_uri(data) else "no such directory"
        if storage.is_uri(data) and not path.bucket_exists():
            return f"--data {data}: {why}"  # a mistyped bucket: converting data into it is no answer
        return (
            f"--data {data}: {why}; --data takes the Parquet directory "
            f"{_convert('INPUT...', data, table_set)} writes from Criteo text or TorchRec day files"
        )
    if path.is_file():
        lower = path.name.lower()
        if lower.endswith((".parquet", ".parq")):
            return None  # one Parquet file: read as it is (through a column mapping if not tpurec's)
        csv = lower.endswith((".csv", ".csv.gz"))
        return f"--data {data}: a file; --data takes a Parquet directory: convert it first with " + _convert(
            data, _out_for(path), table_set, csv
        )
    if any(path.glob("*.parquet")) or any(path.rglob("*.parq*")) or _holds_parquet(path):
        return None
    files = sorted(f.name.lower() for f in path.iterdir() if f.is_file() and not f.name.startswith((".", "_")))
    csvs = [f for f in files if f.endswith((".csv", ".csv.gz"))]
    days = [f for f in files if f.endswith(TORCHREC_DAY_SUFFIXES)]
    out = str(path.parent / f"{path.name}_parquet")
    if csvs:
        pattern = os.path.join(data, "*.csv.gz" if all(f.endswith(".gz") for f in csvs) else "*.csv")
        how = _convert(pattern, out, table_set, csv=True)
    elif days:
        how = _convert(data, out, table_set)
    elif files:
        how = _convert(os.path.join(data, "FILE..."), out, table_set)
    else:
        how = _convert("INPUT...", data, table_set)
        return f"--data {data}: an empty directory; --data takes the Parquet directory {how} writes"
    return f"--data {data}: no .parquet files ({len(files)} other file(s)); convert them first with {how}"


def _holds_parquet(path: Path, most: int = 100) -> bool:
    """Parquet files named otherwise (Hive's `000000_0`), in partition directories too: a look at the
    first bytes of at most `most` files."""
    import itertools

    for f in itertools.islice((f for f in path.rglob("*") if f.is_file()), most):
        try:
            with f.open("rb") as fh:
                if fh.read(4) == b"PAR1":
                    return True
        except OSError:
            continue
    return False
