"""`tpurec bench stats DIR`: the `tpurec data stats` pass against the reader alone, on one dataset.

The target is a stats pass as fast as reading: counting must not be what a user waits for. Both
contenders read the same directory at the same global batch (the plan's batch per device x devices):
the reader alone iterates `ParquetReader` as training does (every column); the stats pass is `tpurec
data stats`'s own loop (`DemandTally.count_stream`, reading plus counting), which reads the id columns
alone (`ids_only`: on Criteo's 40 columns, about 40% less reading CPU; on MLPerf's multi-hot ids, ~5%).
The ratio is thus the user's wait for `data stats` against one epoch of reading, not counting's
cost alone. They take turns in a fresh random order every
round (`timer.interleaved`), each round's ratio is reader seconds / stats seconds (1.0: counting
costs nothing), and the worst round is reported next to the median, with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.data.catalog import MODEL_NAMES


def run_bench(path: str, model: str, topology: str, batch_size: int | None, rounds: int, threads: int) -> dict:
    from tpurec.bench import timer
    from tpurec.data.reader import ParquetReader
    from tpurec.planner.id_limits import DemandTally, layout_of, table_layouts
    from tpurec.planner.limits_cli import check_batch_memory, plan_report

    report = plan_report(path, model=model, tables_file=None, topology=topology, batch_size=batch_size)
    layout, tables = layout_of(report), table_layouts(report)
    check_batch_memory(path, layout, flag_given=batch_size is not None)  # before the reader allocates it
    batch = layout["batch_size_per_device"] * layout["world_size"]

    def reader(ids_only: bool) -> ParquetReader:
        return ParquetReader(path, batch_size=batch, shuffle=False, drop_last=False, ids_only=ids_only)

    def read_only() -> int:
        return sum(b.sparse_features.stride() for b in reader(False))

    def stats_pass() -> int:  # as `tpurec data stats` reads: the id columns alone
        return DemandTally(tables, layout).count_stream(reader(True), threads)

    load_before = os.getloadavg()[0]
    r_read, r_stats = timer.interleaved([read_only, stats_pass], warmup=1, repeats=rounds)
    if r_read.results != r_stats.results:
        raise RuntimeError(f"unequal work: the reader saw {r_read.results} rows, the stats pass {r_stats.results}")
    ratios = [a / b for a, b in zip(r_read.wall, r_stats.wall)]
    rows = r_read.results[0]
    return {
        "data": os.path.abspath(path),
        "model": model,
        "layout": layout,
        "rows": rows,
        "global_batch": batch,
        "threads": threads,
        "stats_reads": "id columns",
        # count_stream's route: one pool decoding and counting (multi-hot data, 2+ threads), or the
        # reader's decoding thread beside the counting caller (and threads - 2 counting threads)
        "route": "pool" if threads >= 2 and any(f.multi_hot for f in reader(True).schema.sparse) else "split",
        "rounds": rounds,
        "reader_rows_per_s": round(rows / r_read.median),
        "stats_rows_per_s": round(rows / r_stats.median),
        "ratio_vs_reader": round(statistics.median(ratios), 3),
        "worst_ratio_vs_reader": round(min(ratios), 3),
        "best_ratio_vs_reader": round(max(ratios), 3),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="`tpurec data stats` against the reader alone (rows/s ratio)")
    p.add_argument("path", metavar="DIR", help="a dataset directory (tpurec data synth / convert)")
    p.add_argument("--model", choices=MODEL_NAMES, default="criteo-kaggle", help="table set (default criteo-kaggle)")
    p.add_argument("--topology", default="v5p-8", help="slice whose layout is measured (default v5p-8)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="batch per device (default: as tpurec plan)")
    p.add_argument("--rounds", type=positive_int, default=5, help="timed rounds (default 5)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="the stats pass's threads in all (default: cores), as data stats counts them",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    threads = args.threads or os.cpu_count() or 1
    res = run_bench(args.path, args.model, args.topology, args.batch_size, args.rounds, threads)
    if args.json:
        print(strict_json.dumps(res, indent=1))
        return 0
    print(
        f"{res['rows']:,} rows, global batch {res['global_batch']} ({args.model} on {args.topology}), "
        f"{threads} thread(s), {res['rounds']} rounds in random order, load {res['load_average']}\n"
        f"reader alone {res['reader_rows_per_s']:,} rows/s, stats pass {res['stats_rows_per_s']:,} rows/s: "
        f"{res['ratio_vs_reader']}x the reader (worst round {res['worst_ratio_vs_reader']}x, "
        f"best {res['best_ratio_vs_reader']}x)"
    )
    return 0
