"""Each table's hot-row curve: the share of its ids its k most used rows receive, at a few k.

`tpurec data stats` counts every id of every table once (`HotRowTally`, beside the id limits) and
writes the curve into the limits file under each table's `hot_rows`:

    {"ids": 4096000, "ids_per_sample": 1.0, "rows_seen": 997,
     "top_k": [1, 2, 4, ..., 512, 997], "ids_covered": [0.072, 0.127, ..., 0.967, 1.0]}

`top_k` doubles from 1 up to the rows seen (the last point, where every id is covered). Doubling
keeps the curve to about 27 points for a 2^26-row table while the head, where a Zipf law is
steepest, is read almost row by row; the planner (hit_rate.py) reads the rows between two points as
equally popular. Counting keeps one int64 per row (8 bytes a row on the host during the pass), so
tables over HOT_ROWS_MAX_ROWS rows get no curve (the planner then uses the default load factor).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

# 2^26 rows: 512 MiB of counts for the largest table counted (MLPerf DCNv2's 40 M-row tables fit)
HOT_ROWS_MAX_ROWS = 2**26
# ids counted per table over a pass, at most (HotRowTally): about 13 s for a table too large for the
# host's caches, 0.15 s for a small one
HOT_ROWS_IDS = 2**27


@dataclass(frozen=True)
class HotRows:
    """One table's curve: `covered[i]` of its `ids` went to its `top_k[i]` most used rows."""

    ids: int
    ids_per_sample: float
    rows_seen: int
    top_k: tuple[int, ...]
    covered: tuple[float, ...]

    def to_json(self) -> dict:
        return {
            "ids": self.ids,
            "ids_per_sample": self.ids_per_sample,
            "rows_seen": self.rows_seen,
            "top_k": list(self.top_k),
            "ids_covered": list(self.covered),
        }

    @classmethod
    def from_json(cls, doc: dict) -> HotRows:
        return cls(
            int(doc["ids"]),
            float(doc["ids_per_sample"]),
            int(doc["rows_seen"]),
            tuple(int(k) for k in doc["top_k"]),
            tuple(float(c) for c in doc["ids_covered"]),
        )


def curve_points(rows_seen: int) -> list[int]:
    """1, 2, 4, ... below `rows_seen`, then `rows_seen` itself."""
    points, k = [], 1
    while k < rows_seen:
        points.append(k)
        k *= 2
    return points + [rows_seen] if rows_seen else []


def curve_of(counts: np.ndarray, samples: int) -> HotRows:
    """The curve of one table's per-row id counts over `samples` samples."""
    seen = np.sort(counts[counts > 0])[::-1]
    ids = int(seen.sum())
    cumulative = np.cumsum(seen)
    points = curve_points(len(seen))
    covered = tuple(round(float(cumulative[k - 1]) / ids, 6) for k in points) if ids else ()
    return HotRows(ids, round(ids / samples, 6) if samples else 0.0, len(seen), tuple(points), covered)


class HotRowTally:
    """Per table, how many ids each row received over the pass; safe to call from several threads.

    Counting an id into a large table costs a cache miss (about 100 ns, 20x what the limits' count
    of it costs), so a table is counted on every batch only up to HOT_ROWS_IDS ids over the pass:
    given the pass's `batches`, a table with more has every k-th batch counted (k from its first
    batch's ids), a sample of the pass's batches whose shares of ids are the pass's, up to sampling."""

    def __init__(self, rows: dict[str, int], batches: int | None = None) -> None:
        self.counts = {t: np.zeros(n, np.int64) for t, n in rows.items() if n <= HOT_ROWS_MAX_ROWS}
        self.batches = batches
        self._seen = dict.fromkeys(self.counts, 0)  # batches seen, per table
        self._stride: dict[str, int] = {}
        self._samples = dict.fromkeys(self.counts, 0)  # samples of the batches counted, per table
        self._locks = {t: threading.Lock() for t in self.counts}

    def add(self, table: str, ids: np.ndarray, samples: int) -> None:
        """One batch's `ids` of `table` (rows of it, checked in range by the caller's pass) over `samples`."""
        if table not in self.counts:
            return
        with self._locks[table]:
            seen = self._seen[table]
            self._seen[table] += 1
            if seen == 0:
                total = (self.batches or 1) * ids.size
                self._stride[table] = max(1, math.ceil(total / HOT_ROWS_IDS))
            if seen % self._stride[table]:
                return
            np.add.at(self.counts[table], ids.astype(np.int64, copy=False), 1)
            self._samples[table] += samples

    def result(self) -> dict[str, HotRows]:
        return {t: curve_of(c, self._samples[t]) for t, c in self.counts.items()}


def load_hot_rows(doc: dict) -> dict[str, HotRows]:
    """{table: HotRows} of a limits document's tables that carry a curve (files written before the
    curve was measured have none: {})."""
    tables = doc.get("tables") if isinstance(doc, dict) else None
    if not isinstance(tables, dict):
        return {}
    return {
        str(name): HotRows.from_json(t["hot_rows"])
        for name, t in tables.items()
        if isinstance(t, dict) and isinstance(t.get("hot_rows"), dict)
    }
