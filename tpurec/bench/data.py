"""`tpurec bench data`: reader throughput against torchrec's in-memory Criteo loader, converter MB/s.

Both readers see the same rows: a synthetic dataset is generated as Parquet, and the same rows are
written in torchrec's binary layout (per file: ``*_dense.npy`` float32 [N, 13], ``*_sparse.npy``
int64 [N, 26], ``*_labels.npy`` int32 [N, 1], what ``BinaryCriteoUtils.tsv_to_npys`` produces) for
``InMemoryBinaryCriteoIterDataPipe``. torchrec's loader reads every .npy into memory first (timed
separately as ``torchrec_load_seconds``); its throughput is then slicing in-memory arrays, while
tpurec's streaming figure includes Parquet decoding every epoch. ``tpurec_in_memory_samples_per_s``
is the like-for-like figure: ``ParquetReader(cache=True)`` after its first epoch. Both are timed
single-threaded on one core (tpurec with ``prefetch=0``); the prefetching figure, which may use a
second core, is reported beside it. Each reader gets ``passes`` timed epochs
(`tpurec.bench.timer.repeat`, no warm-up) and the best one is kept. The ids are those of
`tpurec.data.synth` (a continuous-approximation Zipf law; see `tpurec.bench.workloads`).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import numpy as np

from tpurec import strict_json
from tpurec.argtypes import parquet_codec, positive_int
from tpurec.bench import timer

BATCH = 8192


def _time_iter(make_iter, passes: int) -> tuple[float, float, int]:
    """Best-of-``passes`` (wall samples/s, cpu samples/s, rows) of iterating ``make_iter()``."""

    def epoch() -> int:
        return sum(b.labels.shape[0] for b in make_iter())

    runs = timer.repeat(epoch, warmup=0, repeats=passes)
    return (
        max(n / wall for n, wall in zip(runs.results, runs.wall)),
        max(n / max(cpu, 1e-9) for n, cpu in zip(runs.results, runs.cpu)),
        runs.results[-1],
    )


def write_torchrec_npys(parquet_dir: str, npy_dir: str) -> tuple[list[str], list[str], list[str]]:
    """The Parquet rows in torchrec's binary Criteo layout, one triple of .npy files per Parquet file."""
    import pyarrow.parquet as pq

    from tpurec.data.schema import dataset_metadata, list_parquet_files

    meta = dataset_metadata(parquet_dir)
    dense_names = meta["dense"]
    sparse_names = [f["name"] for f in meta["sparse"]]
    out: dict[str, list] = {"dense": [], "sparse": [], "labels": []}
    for i, path in enumerate(list_parquet_files(parquet_dir)):
        t = pq.read_table(path)
        arrays = {
            "dense": np.stack([t.column(n).to_numpy() for n in dense_names], axis=1).astype(np.float32),
            "sparse": np.stack([t.column(n).to_numpy() for n in sparse_names], axis=1).astype(np.int64),
            "labels": t.column(meta["label"]).to_numpy().astype(np.int32).reshape(-1, 1),
        }
        for kind, arr in arrays.items():
            p = os.path.join(npy_dir, f"day_{i}_{kind}.npy")
            np.save(p, arr)
            out[kind].append(p)
    return out["dense"], out["sparse"], out["labels"]


def _hex8(ids: np.ndarray) -> np.ndarray:
    """uint32 ids -> 8-character lowercase hex strings (numpy 'S8'), vectorised."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    nib = (ids.astype(np.uint64)[:, None] >> shifts) & np.uint64(15)
    return np.ascontiguousarray(digits[nib]).view("S8").reshape(-1)


def write_criteo_tsv(parquet_dir: str, path: str, rows: int, seed: int = 0) -> int:
    """A raw Criteo TSV (no header, ints, hex ids, blanks) with ``rows`` lines; returns its bytes."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    rng = np.random.default_rng(seed)
    cols = {"label": pa.array(rng.integers(0, 2, rows).astype(str))}
    for j in range(13):
        v = np.floor(np.exp(rng.normal(1.0 + j % 4, 1.5, rows))).astype(np.int64) - (j == 1)
        s = pa.array(v).cast(pa.string())
        cols[f"I{j + 1}"] = pa.compute.if_else(pa.array(rng.random(rows) < 0.2), pa.scalar(""), s)
    for j in range(26):
        hx = pa.array(_hex8(rng.integers(0, 2**32, rows, dtype=np.uint64))).cast(pa.string())
        cols[f"C{j + 1}"] = pa.compute.if_else(pa.array(rng.random(rows) < 0.1), pa.scalar(""), hx)
    pcsv.write_csv(pa.table(cols), path, pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))
    return os.path.getsize(path)


TORCHREC_FIGURES = (
    "torchrec_samples_per_s",
    "torchrec_cpu_samples_per_s",
    "torchrec_load_seconds",
    "ratio_vs_torchrec",
    "ratio_vs_torchrec_cpu",
    "ratio_in_memory_vs_torchrec",
    "torchrec_with_load_samples_per_s",
    "ratio_vs_torchrec_with_load",
)


def _torchrec_figures(tp_wall, tp_cpu, tp_mem, tr_wall, tr_cpu, tr_load, tr_rows) -> dict:
    with_load = tr_rows / (tr_load + tr_rows / tr_wall)
    return {
        "torchrec_samples_per_s": round(tr_wall),
        "torchrec_cpu_samples_per_s": round(tr_cpu),
        "torchrec_load_seconds": round(tr_load, 3),
        "ratio_vs_torchrec": round(tp_wall / tr_wall, 3),
        "ratio_vs_torchrec_cpu": round(tp_cpu / tr_cpu, 3),  # per CPU-second: steadier on a busy host
        "ratio_in_memory_vs_torchrec": round(tp_mem / tr_wall, 3),
        "torchrec_with_load_samples_per_s": round(with_load),
        "ratio_vs_torchrec_with_load": round(tp_wall / with_load, 3),
    }


def run_bench(
    rows: int = 2_000_000,
    work_dir: str | None = None,
    table_set: str = "criteo-kaggle",
    passes: int = 5,
    convert_rows: int = 500_000,
    show_progress: bool = False,
    compression: str = "none",
) -> dict:
    import torch  # noqa: F401  (import cost kept out of the timings)
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    from tpurec.data.convert import ConvertOptions, convert
    from tpurec.data.reader import ParquetReader
    from tpurec.data.schema import criteo_schema, dataset_metadata
    from tpurec.data.synth import synthesize

    tmp = tempfile.TemporaryDirectory(prefix="tpurec-bench-data-") if work_dir is None else None
    root = Path(tmp.name if tmp is not None else str(work_dir))
    try:
        pq_dir, npy_dir, tsv_dir = root / "parquet", root / "npy", root / "tsv"
        for d in (npy_dir, tsv_dir):
            d.mkdir(parents=True, exist_ok=True)
        with timer.Stopwatch() as synth_time:
            synthesize(
                rows,
                str(pq_dir),
                seed=0,
                table_set=table_set,
                show_progress=show_progress,
                overwrite=True,
                compression=compression,
            )
        synth_s = synth_time.wall
        multi_hot = any(f.get("multi_hot") for f in dataset_metadata(str(pq_dir)).get("sparse", []))

        def tpurec_iter(prefetch, decode_threads=1):
            return lambda: ParquetReader(str(pq_dir), BATCH, prefetch=prefetch, decode_threads=decode_threads)

        tp_wall, tp_cpu, tp_rows = _time_iter(tpurec_iter(0), passes)
        tp_pf, _, _ = _time_iter(tpurec_iter(2), passes)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        tp_threads, _, _ = _time_iter(tpurec_iter(2, cores), passes) if cores > 1 else (tp_pf, 0.0, 0)
        cached = ParquetReader(str(pq_dir), BATCH, prefetch=0, cache=True)
        for _ in cached:  # first epoch decodes and fills the cache, like torchrec's load
            pass
        tp_mem, _, _ = _time_iter(lambda c=cached: c, passes)
        del cached

        torchrec = None
        if not multi_hot:  # torchrec's binary Criteo layout holds one id per sparse column
            dense_p, sparse_p, labels_p = write_torchrec_npys(str(pq_dir), str(npy_dir))
            with timer.Stopwatch() as load_time:
                tr = InMemoryBinaryCriteoIterDataPipe("train", dense_p, sparse_p, labels_p, BATCH, 0, 1)
            tr_wall, tr_cpu, tr_rows = _time_iter(lambda: tr, passes)
            if tr_rows != tp_rows:
                raise RuntimeError(f"readers disagree on rows: tpurec {tp_rows}, torchrec {tr_rows}")
            torchrec = _torchrec_figures(tp_wall, tp_cpu, tp_mem, tr_wall, tr_cpu, load_time.wall, tr_rows)

        tsv = tsv_dir / "day_0"
        tsv_bytes = write_criteo_tsv(str(pq_dir), str(tsv), convert_rows)
        conv = convert(
            [str(tsv)],
            str(root / "converted"),
            ConvertOptions(criteo_schema()),
            jobs=1,
            show_progress=show_progress,
            overwrite=True,
        )
        return {
            "rows": tp_rows,
            "batch_size": BATCH,
            "parquet_compression": compression,
            "num_sparse": 26,
            "num_dense": 13,
            "table_set": table_set,
            "tpurec_samples_per_s": round(tp_wall),
            "tpurec_cpu_samples_per_s": round(tp_cpu),
            "tpurec_prefetch_samples_per_s": round(tp_pf),
            "tpurec_decode_threads": cores,
            "tpurec_decode_threads_samples_per_s": round(tp_threads),
            "tpurec_in_memory_samples_per_s": round(tp_mem),
            **(torchrec or dict.fromkeys(TORCHREC_FIGURES)),
            "torchrec_skipped": None
            if torchrec
            else f"{table_set} is multi-hot; torchrec's binary Criteo layout is not",
            "converter_mb_per_s": conv["mb_per_s"],
            "converter_rows_per_s": round(conv["rows"] / conv["seconds"]),
            "converter_input_mb": round(tsv_bytes / 1e6, 1),
            "synth_rows_per_s": round(rows / synth_s),
            "passes": passes,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            },
        }
    finally:
        if tmp is not None:
            tmp.cleanup()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="Parquet reader vs torchrec's in-memory Criteo loader, converter MB/s")
    p.add_argument("--rows", type=positive_int, default=2_000_000, help="rows in the generated dataset (default 2M)")
    p.add_argument("--tables", default="criteo-kaggle", help="table set for the ids (default criteo-kaggle)")
    p.add_argument(
        "--passes", type=positive_int, default=5, help="timed passes per reader; the best is kept (default 5)"
    )
    p.add_argument(
        "--convert-rows",
        type=positive_int,
        default=500_000,
        help="rows of raw TSV for the converter figure (default 500000)",
    )
    p.add_argument(
        "--compression", type=parquet_codec, default="none", help="codec of the generated Parquet (default none)"
    )
    p.add_argument("--dir", help="work directory (kept); default a temporary one, removed afterwards")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tpurec.data.cli import reader_gone_ok

    return reader_gone_ok(_run)(args)


def _run(args) -> int:
    import sys

    from tpurec.outputs import check_outputs

    check_outputs([("--dir", args.dir, "dir")])  # before minutes of generating and timing

    res = run_bench(
        args.rows,
        args.dir,
        args.tables,
        args.passes,
        args.convert_rows,
        show_progress=sys.stderr.isatty() and not args.json,
        compression=args.compression,
    )
    if args.json:
        print(strict_json.dumps(res, indent=2))
        return 0
    print(
        f"rows {res['rows']:,}, batch {res['batch_size']}, 26 sparse + 13 dense ({res['table_set']} ids, "
        f"Parquet compression {res['parquet_compression']})"
    )
    print(
        f"tpurec ParquetReader     {res['tpurec_samples_per_s']:>12,} samples/s (1 thread; "
        f"{res['tpurec_prefetch_samples_per_s']:,} with prefetch)"
    )
    print(f"tpurec in-memory (cache) {res['tpurec_in_memory_samples_per_s']:>12,} samples/s")
    if res["torchrec_skipped"]:
        print(f"torchrec in-memory npy   skipped: {res['torchrec_skipped']}")
    else:
        print(
            f"torchrec in-memory npy   {res['torchrec_samples_per_s']:>12,} samples/s "
            f"(after {res['torchrec_load_seconds']} s loading)"
        )
        print(
            f"ratio vs torchrec        {res['ratio_vs_torchrec']:>12} streaming, "
            f"{res['ratio_in_memory_vs_torchrec']} in-memory, {res['ratio_vs_torchrec_with_load']} streaming vs "
            f"torchrec load+iterate"
        )
    print(
        f"converter                {res['converter_mb_per_s']:>12} MB/s "
        f"({res['converter_rows_per_s']:,} rows/s, 1 process)"
    )
    return 0
