"""`tpurec data stats DIR`: one streaming pass over a Parquet dataset measuring each table's id limits
for the layout a plan gives (tpurec.planner.id_limits), written as a limits file.

  tpurec data stats DIR --model dlrm-tiny --topology v5p-8 --out limits.json
  tpurec data stats DIR --model dlrm-tiny --plan P.json --out limits.json
  tpurec data stats DIR --model-module my_pkg.models:build --topology v5p-8 --out limits.json
  tpurec data stats RAW --model dlrm-tiny --topology v5p-8 --zch --out limits.json

`--zch` (the ids after `tpurec train --zch`'s remap) is added by tpurec.dlrm.zch_stats, which replays the
remap and hands this pass its batches and tables (`RemappedIds`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.data.catalog import MODEL_NAMES, TRAINING_DEFAULTS
from tpurec.errors import UserError

if TYPE_CHECKING:
    from tpurec.embedding.demand import TableShards


def register(actions: argparse._SubParsersAction) -> None:
    s = actions.add_parser(
        "stats",
        help="measure per-table id limits for a plan's layout (for --limits)",
        description="One pass over a Parquet dataset: per table, the ids and unique ids per SparseCore "
        "partition each global batch puts on its shard, for the layout of a plan (--plan) or of the "
        "plan tpurec makes for --topology; writes the limits to use with --limits.",
        epilog="example: tpurec data stats data/ --model dlrm-tiny --topology v5p-8 --out limits.json",
    )
    s.add_argument(
        "path",
        metavar="DIR",
        help="a dataset directory (tpurec data convert / synth), or any Parquet file or directory (see --label)",
    )
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=MODEL_NAMES, help="a named table set")
    src.add_argument("--tables", metavar="FILE", help="tables from a .json / .yaml file (as tpurec plan)")
    src.add_argument(
        "--model-module",
        metavar="MODULE:FN",
        help="your model, as tpurec plan --model-module (the data's columns are its feature names)",
    )
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", metavar="SLICE", help="plan for this slice first (as tpurec plan)")
    where.add_argument("--plan", metavar="P.json", help="a saved plan (tpurec plan --format json)")
    s.add_argument("--batch-size", type=positive_int, default=None, help="batch per device (default: as tpurec plan)")
    s.add_argument("--out", required=True, metavar="FILE", help="the limits file to write (JSON)")
    s.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="threads in all (default: cores): on multi-hot data one pool decodes and counts; "
        "else two read and the rest count",
    )
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    from tpurec.data.mapping import add_flags

    add_flags(s)  # --label/--dense/--sparse/--columns: Parquet tpurec did not write
    s.set_defaults(run=run)


class Batches(Protocol):
    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


class RemappedIds(Protocol):
    """The ids after a remap instead of the data's own (`data stats --zch`, tpurec.dlrm.zch_stats): the
    tables as the remapped run shards them, and its global batches with remapped ids, in its order."""

    record: dict  # the limits file's `zch`: what remap the ids were counted after

    def tables(self, report: dict, layout: dict) -> list[TableShards]: ...

    def batches(self, path: str, layout: dict, tables: list[TableShards]) -> Batches: ...


def run(args: argparse.Namespace, remap: RemappedIds | None = None) -> int:
    from tpurec.data.cli import reader_gone_ok

    return reader_gone_ok(lambda a: _run(a, remap))(args)


def _check_out(path: str) -> None:
    """Refuse an output that cannot be written, before the pass (a probe file: root passes
    os.access but not a read-only mount)."""
    from tpurec.outputs import check_outputs

    check_outputs([("--out", path, "file")])


def _report(args: argparse.Namespace, meta: dict) -> dict:
    from tpurec.planner import report as reports

    if args.plan:
        return reports.report_from_file(args.plan)
    if args.model_module:
        from tpurec.planner import model_module
        from tpurec.planner.cli import DMP_PLANNING_BATCH_SIZE

        model, constraints = model_module.load_model(args.model_module)
        return reports.plan_module(
            model,
            model_module.model_tables(model, constraints),
            args.topology,
            batch_size=args.batch_size or DMP_PLANNING_BATCH_SIZE,  # as DistributedModelParallel plans it
            optimizer=None,
            constraints=constraints,
            model=args.model_module,
        )
    return plan_report(
        args.path,
        model=args.model,
        tables_file=args.tables,
        topology=args.topology,
        batch_size=args.batch_size,
        meta=meta,
    )


def plan_report(
    path: str,
    *,
    model: str | None,
    tables_file: str | None,
    topology: str,
    batch_size: int | None,
    meta: dict | None = None,
) -> dict:
    """The plan tpurec makes for `topology` (as `tpurec plan`), for a named model's or a file's tables;
    `meta`: the data's metadata (default: read from `path`)."""
    from tpurec.planner import report as reports

    tables = _tables(path, model, tables_file, meta)
    trained = TRAINING_DEFAULTS.get(model) if model else None
    batch = batch_size or (trained.batch_size if trained else 256)
    optimizer = trained.embedding_optimizer if trained else "rowwise_adagrad"
    return reports.plan_tables(tables, topology, batch_size=batch, optimizer=optimizer, model=model)


def _tables(path: str, model: str | None, tables_file: str | None, meta: dict | None = None) -> list:
    """The model's tables, with the row counts the data's ids index into (as `tpurec train` builds them);
    the feature names of mapped Parquet (its own column names, in order), as `tpurec train` names them."""
    from dataclasses import replace

    from tpurec.data.schema import dataset_metadata

    if tables_file:
        from tpurec.planner.tables_file import load_tables

        return load_tables(tables_file)
    from tpurec.data.catalog import get_table_set

    assert model is not None  # argparse requires --model or --tables
    tables = list(get_table_set(model).tables)
    meta = meta if meta is not None else dataset_metadata(path)
    sparse = meta.get("sparse", [])
    if not sparse:
        return tables
    # Data of another shape gets a model of its shape (tpurec.dlrm.model.build_model): the table set's
    # first tables, and past its count tables `t_<feature>` like its last one, sized by the data.
    reshaped = len(sparse) != len(tables)
    specs = tables[: len(sparse)]
    for f in sparse[len(tables) :]:
        if f.get("num_embeddings") is None:
            raise UserError(
                f"{path}: sparse column {f['name']!r} has no table size and the {model} tables are "
                f"{len(tables)}: give it one (--sparse NAME:ROWS)"
            )
        specs.append(replace(tables[-1], name=f"t_{f['name']}", feature=f["name"], extra_features=()))
    tables = [
        replace(t, num_embeddings=int(f["num_embeddings"])) if f.get("num_embeddings") is not None else t
        for t, f in zip(specs, sparse)
    ]
    if "mapping" in meta or reshaped:  # the data's own column names, as `tpurec train` names features
        tables = [replace(t, feature=f["name"]) for t, f in zip(tables, sparse)]
    return tables


def batch_bytes_per_row(meta: dict) -> int:
    """Host bytes a row of this dataset takes in a batch the reader builds: label and dense values
    (float32), and per feature its ids (int64) and its length (int32); multi-hot features at their
    recorded ids per sample (1 when not recorded)."""
    sparse = meta.get("sparse") or []
    hots = meta.get("multi_hot_sizes") or [1] * len(sparse)
    ids = sum(int(h) if isinstance(h, int) and h > 0 else 1 for h in hots)
    return 4 + 4 * len(meta.get("dense") or []) + 8 * ids + 4 * len(sparse)


def batches_in_memory(path: str, layout: dict, meta: dict | None = None) -> int | None:
    """How many global batches the stats pass may hold at once (counted side by side, or waiting):
    half of this host's available memory over a batch's bytes, at least 1; None where unknown. On a
    host of many cores, `--threads` batches of 2M samples each would otherwise outgrow its memory."""
    from tpurec.data.schema import dataset_metadata
    from tpurec.runtime.host_resources import available_bytes

    memory = available_bytes()
    if memory is None:
        return None
    per_row = batch_bytes_per_row(meta if meta is not None else dataset_metadata(path))
    need = layout["batch_size_per_device"] * layout["world_size"] * per_row
    return max(1, memory // 2 // max(need, 1))


def check_batch_memory(path: str, layout: dict, flag_given: bool, meta: dict | None = None) -> None:
    """Refuse a batch this host cannot hold once, before the reader allocates it: `--batch-size 1e9`
    tried to allocate 416 GB and died with a RuntimeError traceback."""
    from tpurec.data.schema import dataset_metadata
    from tpurec.runtime.host_resources import available_bytes

    memory = available_bytes()
    if memory is None:
        return
    per_row = batch_bytes_per_row(meta if meta is not None else dataset_metadata(path))
    world, batch = layout["world_size"], layout["batch_size_per_device"]
    need = batch * world * per_row
    if need > memory:
        flag = f"--batch-size {batch:,}" if flag_given else f"the plan's batch of {batch:,} per device"
        raise UserError(
            f"{flag}: a global batch of {batch * world:,} rows ({world} devices) needs about "
            f"{need / 2**30:,.1f} GiB of memory ({per_row} bytes per row of {path}), but this host has "
            f"{memory / 2**30:,.1f} GiB available: at most {max(1, memory // per_row // world):,} per device"
        )


def _run(args: argparse.Namespace, remap: RemappedIds | None = None) -> int:
    from tqdm import tqdm

    from tpurec.data.reader import ParquetReader
    from tpurec.planner.id_limits import FORMAT, DemandTally, layout_of, table_layouts
    from tpurec.runtime.library_notices import quiet_fx_tracing_notice

    quiet_fx_tracing_notice()  # the reader's KeyedJaggedTensors: torch's is_fx_tracing line otherwise
    _check_out(args.out)
    from tpurec.runtime import storage

    if not storage.path(args.path).exists():
        raise UserError(f"{args.path}: no such dataset directory or Parquet file")
    if args.model_module:  # a typo told at once, not after torch loads
        from tpurec.planner.model_module import parse_target

        parse_target(args.model_module)
    from tpurec.data.mapped import open_source
    from tpurec.data.mapping import spec_from_args
    from tpurec.data.schema import dataset_metadata

    # a plan file or a model's code is checked before the data is opened (it needs no data): a bad
    # one is the user's first mistake to hear of, and told without reading a byte of the dataset
    early = _report(args, {}) if args.plan or args.model_module else None
    source = open_source(args.path, spec_from_args(args))  # None: tpurec's own data
    meta = source.metadata() if source is not None else dataset_metadata(args.path)
    report = early if early is not None else _report(args, meta)
    if args.model and args.plan and report.get("model") not in (None, args.model):
        raise UserError(f"--plan {args.plan} is a plan for {report.get('model')!r}, not --model {args.model}")
    layout = layout_of(report)
    tables = remap.tables(report, layout) if remap is not None else table_layouts(report)
    global_batch = layout["batch_size_per_device"] * layout["world_size"]
    check_batch_memory(args.path, layout, flag_given=args.batch_size is not None, meta=meta)
    reader: Batches
    if remap is not None:  # the remapped run's batches, in its order
        reader = remap.batches(args.path, layout, tables)
    else:
        # mapped features without :ROWS hash into the plan's table of that feature, and raw ids (`data
        # convert/synth --raw-ids`) into its tables, as `tpurec train` without --zch reads them
        raw = any(f.get("num_embeddings") is None for f in meta.get("sparse", []))
        sizes = {f: t.rows for t in tables for f in t.features} if source is not None or raw else None
        # the ids alone: the label and dense columns are not read (a third less reading on Criteo's columns)
        reader = ParquetReader(
            args.path,
            batch_size=global_batch,
            shuffle=False,
            drop_last=False,
            source=source,
            table_sizes=sizes,
            ids_only=True,
        )
    threads = args.threads or os.cpu_count() or 1
    tally = DemandTally(tables, layout)
    show = not args.quiet and sys.stderr.isatty()
    start = time.perf_counter()
    with tqdm(total=len(reader), unit="batch", disable=not show, desc="tpurec data stats") as bar:
        held = batches_in_memory(args.path, layout, meta)
        rows = tally.count_stream(reader, threads, on_batch=lambda: bar.update(1), max_held=held)
    seconds = time.perf_counter() - start
    if rows == 0:
        raise UserError(f"{args.path}: no rows to measure")
    doc = {
        "format": FORMAT,
        "version": 1,
        "layout": layout,
        "data": args.path if storage.is_uri(args.path) else os.path.abspath(args.path),
        "plan": args.plan or f"tpurec plan for {args.topology}",
        **({"zch": remap.record} if remap is not None else {}),
        "rows": rows,
        "batches": len(tally.per_batch[tables[0].name]) if tables else 0,
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds, 1) if seconds > 0 else None,
        "tables": tally.result(),
    }
    from tpurec.outputs import write_atomic

    write_atomic(args.out, strict_json.dumps(doc, indent=1) + "\n", "--out")
    worst = max(doc["tables"].items(), key=lambda kv: kv[1]["max_ids_per_partition"], default=None)
    print(
        f"wrote {args.out}: {len(tables)} tables, {rows:,} rows in {doc['batches']} global batches of {global_batch} "
        f"({doc['rows_per_s']:,.0f} rows/s)"
        + (f"; largest limit {worst[1]['max_ids_per_partition']} ids per partition ({worst[0]})" if worst else ""),
        file=sys.stderr,
    )
    return 0
