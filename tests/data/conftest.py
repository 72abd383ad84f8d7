"""Small datasets shared by the data tests (generated once per session, a few MB at most)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """5,000 dlrm-tiny rows in 2 files of 4 row groups (1,000 rows each, last one short)."""
    from tpurec.data.synth import synthesize

    out = tmp_path_factory.mktemp("synth")
    synthesize(5000, str(out), seed=3, rows_per_file=3000, row_group_size=1000, show_progress=False)
    return out


@pytest.fixture(scope="session")
def synth_table(synth_dir):
    """The synthetic rows as one pyarrow Table, in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tpurec.data.schema import list_parquet_files

    return pa.concat_tables([pq.read_table(p) for p in list_parquet_files(synth_dir)])
