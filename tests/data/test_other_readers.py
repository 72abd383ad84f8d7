"""A converted directory (Parquet files + _dataset.json) opens in other readers as docs/data.md says.

polars and DuckDB are not tpurec dependencies: their tests skip where they are not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "data.md"
POLARS_GLOB = 'pl.scan_parquet("DIR/*.parquet")'
DUCKDB_GLOB = "read_parquet('DIR/*.parquet')"


def test_the_docs_give_the_glob_for_readers_that_do_not_skip_the_metadata():
    text = DOC.read_text()
    assert POLARS_GLOB in text and DUCKDB_GLOB in text


def test_polars_reads_the_documented_glob(synth_dir):
    pl = pytest.importorskip("polars")
    frame = eval(POLARS_GLOB.replace("DIR", str(synth_dir)), {"pl": pl}).collect()
    assert frame.height == 5000 and "label" in frame.columns


def test_duckdb_reads_the_documented_glob(synth_dir):
    duckdb = pytest.importorskip("duckdb")
    query = "select count(*) from " + DUCKDB_GLOB.replace("DIR", str(synth_dir))
    assert duckdb.sql(query).fetchall() == [(5000,)]


def test_pyarrow_dataset_reads_the_directory_as_it_is(synth_dir):
    import pyarrow.dataset as ds

    assert ds.dataset(str(synth_dir), format="parquet").count_rows() == 5000
