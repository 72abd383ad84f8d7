"""Units of reading (row groups, or row ranges of one), their split across ranks, train/eval split.

Everything here works from the Parquet footers only, so every rank computes the same assignment
without talking to the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tpurec.data.schema import DataError, DataSchema, list_parquet_files, read_file_schema, read_footer
from tpurec.errors import UserError
from tpurec.runtime import storage


@dataclass(frozen=True)
class Unit:
    """Rows [start, stop) of one row group of one file: the smallest piece a rank is given."""

    path: str
    row_group: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def scan(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[DataSchema, list[Unit]]:
    """The common schema and every row group of the files, in file order.

    Errors (not Parquet, truncated, no tpurec metadata, a schema differing from the first file's)
    name the file.
    """
    files = list_parquet_files(paths)
    schema: DataSchema | None = None
    units: list[Unit] = []
    for path, meta in zip(files, footers(files)):
        s = read_file_schema(path, meta)
        if schema is None:
            schema = s
        elif s.to_json() | {"extra": {}} != schema.to_json() | {"extra": {}}:
            raise DataError(f"{path}: its tpurec schema differs from {files[0]}'s")
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if n:
                units.append(Unit(path, rg, 0, n))
    assert schema is not None  # list_parquet_files refuses a list without files
    return schema, units


FOOTER_THREADS = 16  # footers of a bucket's files read at once: each is a round trip of tens of ms


def footers(files: Sequence[str], read: Callable[[Any], Any] = read_footer) -> Iterable[Any]:
    """`read(f)` (a Parquet footer) of each file, in order: a bucket's on threads (a dataset of 1,000
    objects would otherwise spend a minute in round trips before the first step), local ones lazily
    in turn, as before."""
    if not any(storage.is_uri(str(f)) for f in files):
        return (read(f) for f in files)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(FOOTER_THREADS) as pool:
        return list(pool.map(read, files))


def _split_unit(u: Unit) -> tuple[Unit, Unit]:
    mid = u.start + u.rows // 2
    return Unit(u.path, u.row_group, u.start, mid), Unit(u.path, u.row_group, mid, u.stop)


def assign(units: list[Unit], rank: int, world_size: int) -> list[Unit]:
    """This rank's units: disjoint across ranks, their union is ``units``, rows balanced.

    Largest unit first to the least-loaded rank (ties to the lowest rank), which keeps every rank
    within one row group of the others. When there are fewer units than ranks, the largest units
    are halved (row ranges of a row group) so no rank is left without data. The returned list keeps
    the dataset order.
    """
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} not in [0, world_size={world_size})")
    units = list(units)
    total = sum(u.rows for u in units)
    if total < world_size:
        raise DataError(f"{total} rows cannot be split over {world_size} ranks")
    while len(units) < world_size:
        big = max(range(len(units)), key=lambda i: units[i].rows)
        a, b = _split_unit(units[big])
        units[big : big + 1] = [a, b]
    load = [0] * world_size
    mine: list[int] = []
    for i in sorted(range(len(units)), key=lambda i: (-units[i].rows, i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        load[r] += units[i].rows
        if r == rank:
            mine.append(i)
    return [units[i] for i in sorted(mine)]


def split_train_eval(
    paths: str | os.PathLike | Sequence[str | os.PathLike], eval_fraction: float = 0.1, source: Any = None
) -> tuple[list[Unit], list[Unit]]:
    """A deterministic train/eval split; neither side is ever empty (needs >= 2 rows).

    With enough row groups, whole row groups go to eval: every k-th one (k = round(1/fraction)),
    starting from the last, so eval samples the whole dataset. With too few row groups, the last
    ``max(1, round(fraction * rows))`` rows of every row group are held out instead. Pass either
    list to ``ParquetReader`` in place of paths.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise UserError("eval_fraction must be in (0, 1)")
    units = list(source.units) if source is not None else scan(paths)[1]  # source: a mapped dataset's
    k = max(2, round(1.0 / eval_fraction))
    if len(units) >= k:
        last = len(units) - 1
        eval_idx = {i for i in range(len(units)) if (last - i) % k == 0}
        return (
            [u for i, u in enumerate(units) if i not in eval_idx],
            [u for i, u in enumerate(units) if i in eval_idx],
        )
    train, evals = [], []
    for u in units:
        if u.rows < 2:
            train.append(u)
            continue
        hold = min(u.rows - 1, max(1, round(eval_fraction * u.rows)))
        train.append(Unit(u.path, u.row_group, u.start, u.stop - hold))
        evals.append(Unit(u.path, u.row_group, u.stop - hold, u.stop))
    if not evals:
        raise DataError("dataset too small to hold out an eval split (needs a row group of >= 2 rows)")
    return train, evals
