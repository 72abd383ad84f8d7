"""Heavier end-to-end checks (run with `make test-all`)."""

import gzip
import shutil

import pytest

from tpurec.bench.data import write_criteo_tsv  # the raw Criteo TSV `tpurec bench data` converts
from tpurec.data.convert import ConvertOptions, convert
from tpurec.data.reader import ParquetReader
from tpurec.data.schema import criteo_schema


@pytest.mark.slow
def test_gz_day_files_convert_in_parallel_and_read_sharded(tmp_path):
    days = []
    for i in range(2):
        plain = tmp_path / f"day_{i}.txt"
        write_criteo_tsv(None, str(plain), 150_000, seed=i)
        gz = tmp_path / f"day_{i}.gz"
        with open(plain, "rb") as src, gzip.open(gz, "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst)
        days.append(str(gz))
    s = convert(
        days, str(tmp_path / "pq"), ConvertOptions(criteo_schema(), row_group_size=32768), jobs=2, show_progress=False
    )
    assert s["rows"] == 300_000 and s["files"] == 2 and s["bad_lines"] == 0
    seen = []
    for rank in range(3):
        r = ParquetReader(tmp_path / "pq", 8192, rank, 3, shuffle=True, seed=1)
        n = 0
        for b in r:
            n += b.labels.shape[0]
            assert b.sparse_features.values().min() >= 0
        seen.append(n)
    assert sum(seen) == 300_000 and max(seen) - min(seen) <= 32768
