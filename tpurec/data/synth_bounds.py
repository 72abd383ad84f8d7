"""How many synthetic rows this host can make: `data synth --rows` and `train --synth-rows` checked
against memory and free disk before anything is written.

Memory: synthesize keeps every row's true probability and label (float64 + int8) to measure
oracle_auc at the end, where torchmetrics' AUC sorts them: 89 bytes per row at the peak (max RSS of
5,000,000 against 1,000,000 dlrm-tiny rows, docs/data.md), whatever the table set.
Disk: the Parquet bytes per row of this table set, ids per sample and codec, measured by writing
SAMPLE_ROWS generated rows to memory, times SAFETY_FACTOR: whole datasets differ from the sample
(their row groups of 65,536 rows hold larger dictionaries, or fall back to plain encoding) by
-13% to +14% on tpurec's table sets, so the bound is the sample's figure plus 30% and never
underestimates them. The sample is taken only when the rows could fill the disk at
PLAIN_BYTES_PER_ID per id, the size of a plain int64 id with its list levels, above any
dictionary-encoded id.
"""

from __future__ import annotations

import os

from tpurec.data.schema import DataSchema
from tpurec.outputs import free_disk_bytes
from tpurec.runtime.host_resources import available_bytes

MEMORY_BYTES_PER_ROW = 96  # 89 measured (module docstring), rounded up
SAMPLE_ROWS = 16384
# Whole datasets over the sample's bytes per row, measured (docs/results.md, "Synthetic data: disk
# estimate"): 0.87-0.88 for dlrm-tiny and criteo-kaggle, 1.13-1.14 for mlperf-dcnv2 (its large
# tables' dictionaries); the factor keeps the bound above every one of them.
SAFETY_FACTOR = 1.3
PLAIN_BYTES_PER_ID = 9  # int64 value + up to one byte of repetition / definition levels
LABEL_BYTES, DENSE_BYTES = 1, 4


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def parquet_bytes_per_row(schema: DataSchema, hots: list[int], compression: str) -> float:
    """Parquet bytes per synthetic row, from SAMPLE_ROWS rows written to memory as synthesize writes."""
    import pyarrow as pa

    from tpurec.data.schema import parquet_writer
    from tpurec.data.synth import generate_chunk

    arrow_schema = schema.arrow_schema()
    cols, _, _ = generate_chunk(0, 0, SAMPLE_ROWS, schema, hots)
    sink = pa.BufferOutputStream()
    with parquet_writer(sink, arrow_schema, compression) as w:
        w.write_table(pa.Table.from_arrays([cols[f.name] for f in arrow_schema], schema=arrow_schema))
    return sink.getvalue().size / SAMPLE_ROWS


def rows_problem(
    flag: str,
    rows: int,
    out_dir: str | os.PathLike,
    table_set: str | None,
    multi_hot_sizes: list[int] | None = None,
    compression: str = "none",
    own_schema: tuple[DataSchema, list[int]] | None = None,
) -> str | None:
    """Why `rows` synthetic rows of `table_set` cannot be made into `out_dir` on this host (one line
    naming `flag`, the value and the bound), or None. Callers ask before synthesize writes anything.
    ``own_schema``: a model's own features (tpurec.data.synth.features_schema) instead of the table set's."""
    from tpurec.data.synth import synth_schema

    schema, hots = own_schema or synth_schema(table_set or "dlrm-tiny", multi_hot_sizes)
    memory = available_bytes()
    if memory is not None and rows * MEMORY_BYTES_PER_ROW > memory:
        return (
            f"{flag} {rows:,}: making them needs about {_gib(rows * MEMORY_BYTES_PER_ROW)} of memory "
            f"({MEMORY_BYTES_PER_ROW} bytes per row: each row's probability is kept for oracle_auc), but this host "
            f"has {_gib(memory)} available: at most {memory // MEMORY_BYTES_PER_ROW:,} rows"
        )
    free = free_disk_bytes(out_dir)
    plain = LABEL_BYTES + DENSE_BYTES * len(schema.dense) + PLAIN_BYTES_PER_ID * sum(hots)
    if free is None or rows * plain <= free:
        return None  # fits even written plain: no sample needed
    per_row = parquet_bytes_per_row(schema, hots, compression) * SAFETY_FACTOR
    if rows * per_row <= free:
        return None
    return (
        f"{flag} {rows:,}: about {_gib(rows * per_row)} of Parquet ({per_row:.0f} bytes per row: measured on "
        f"{SAMPLE_ROWS:,} rows, plus {SAFETY_FACTOR - 1:.0%}), but {out_dir} has {_gib(free)} free: "
        f"at most {int(free // per_row):,} rows"
    )
