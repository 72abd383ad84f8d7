"""`tpurec data convert | synth | inspect`.

Only argparse at module top: the work modules (pyarrow, numpy, torch) load when a command runs.
Bad user input (a malformed line, a missing file, a bad option) raises UserError: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tpurec import strict_json
from tpurec.argtypes import parquet_codec, positive_int, seed_int
from tpurec.data.catalog import MODEL_NAMES
from tpurec.errors import UserError

NAME_PRESETS = {
    "merlin": ([f"I{i}" for i in range(1, 14)], [f"C{i}" for i in range(1, 27)]),
    "torchrec": ([f"int_{i}" for i in range(13)], [f"cat_{i}" for i in range(26)]),
}


_MAPPING_FLAGS = (
    ("label", "COL", "the label column (0/1) of Parquet or CSV/TSV with a header (default: label/click/target)"),
    ("dense", "COL[,COL...]", "dense columns, globs allowed ('f_*'); as `tpurec train --dense`"),
    ("sparse", "NAME[:ROWS][,...]", "sparse (id) columns, globs allowed; ROWS: table size to hash into"),
    ("columns", "FILE", "a YAML/JSON column mapping (as `tpurec data inspect --mapping` prints)"),
)

_parser = None  # `tpurec data`, kept to print its help when no action is given
# Its actions' subparsers: `tpurec.cli` adds actions of higher layers here (`stats` needs a plan).
actions = None


def register(sub: argparse._SubParsersAction) -> None:
    global _parser, actions
    p = _parser = sub.add_parser(
        "data",
        help="Criteo-style Parquet data, or your own Parquet through a column mapping: convert, synth, inspect, stats",
    )
    dsub = actions = p.add_subparsers(dest="data_command", metavar="ACTION")
    p.set_defaults(run=run)  # each action overrides this with its own run
    _add_convert(dsub)
    _add_synth(dsub)
    _add_inspect(dsub)


def _add_convert(dsub: argparse._SubParsersAction) -> None:
    """`tpurec data convert`'s flags."""
    c = dsub.add_parser(
        "convert",
        help="Criteo TSV day files (plain or .gz), TorchRec's .npy/MLPerf's .npz days, or any Parquet/CSV/TSV "
        "through a column mapping -> tpurec's Parquet",
    )
    c.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files, TorchRec day files (day_N_dense.npy / _sparse.npy / _labels.npy, "
        "day_N_sparse_multi_hot.npz) or directories of them, or one Parquet file or directory (Hive partitions too)",
    )
    c.add_argument("--out", required=True, help="output directory (part-NNNNN.parquet + _dataset.json)")
    c.add_argument(
        "--format",
        choices=["auto", "tsv", "csv", "npy", "parquet"],
        default="auto",
        help="auto: *.npy/*.npz (or a directory of them) are TorchRec days, Parquet (a file or a directory of them) "
        "is read through a column mapping, *.csv[.gz] has a header line, anything else is raw Criteo TSV "
        "(default auto)",
    )
    c.add_argument(
        "--table-set",
        "--tables",  # the older spelling; `tpurec plan --tables` takes a FILE, hence --table-set
        dest="tables",
        default=None,
        choices=MODEL_NAMES,
        help="named table set giving num_embeddings per categorical (default criteo-kaggle; "
        "mlperf-dcnv2, the MLPerf caps, for multi-hot .npz days)",
    )
    c.add_argument(
        "--table-sizes",
        help="26 comma-separated num_embeddings, overriding --table-set (with a column mapping: one per sparse "
        "column given without :ROWS, by position)",
    )
    c.add_argument(
        "--ids",
        metavar="KIND[,GLOB=KIND...]",
        default=None,
        help="how text ids are written: hex, decimal, or (with a column mapping) string (hashed); per column with "
        "GLOB=KIND. Criteo text: hex unless given; mapped text: required, never guessed",
    )
    for name, metavar, text in _MAPPING_FLAGS:
        c.add_argument(f"--{name}", metavar=metavar, default=None, help=text)
    c.add_argument("--raw-ids", action="store_true", help="keep int(hex) ids instead of hashing into tables")
    c.add_argument(
        "--mod-ids",
        action="store_true",
        help="id = value mod num_embeddings, as TorchRec's loaders hash (the default for multi-hot .npz)",
    )
    c.add_argument("--raw-dense", action="store_true", help="keep dense values instead of log(max(x,0)+1)")
    c.add_argument(
        "--npy-dense-min",
        help="TorchRec .npy days: the smallest raw dense value of each day's TSV (one, or one per day), "
        "to undo tsv_to_npys' log(x - min + 2); without it the dense values are kept as TorchRec wrote them",
    )
    c.add_argument(
        "--names",
        choices=sorted(NAME_PRESETS),
        default="merlin",
        help="column names: merlin (default: label, I1.., C1..) or torchrec (label, int_0.., cat_0..)",
    )
    c.add_argument(
        "--row-group-size",
        type=positive_int,
        default=None,
        help="rows per Parquet row group (default 65536; Parquet input keeps its own row groups)",
    )
    c.add_argument(
        "--compression",
        type=parquet_codec,
        default="snappy",
        help="Parquet codec (default snappy; none reads faster, files are bigger)",
    )
    c.add_argument("--jobs", type=positive_int, default=None, help="parallel processes (default: cores, <= inputs)")
    c.add_argument("--skip-bad-lines", action="store_true", help="drop malformed lines, count and report them")
    c.add_argument("--overwrite", action="store_true", help="replace .parquet files already in --out")
    _common(c)
    c.set_defaults(run=run_convert)


def _add_synth(dsub: argparse._SubParsersAction) -> None:
    """`tpurec data synth`'s flags."""
    s = dsub.add_parser("synth", help="synthetic Criteo-shaped data with a known best AUC (oracle_auc)")
    s.add_argument("--rows", type=positive_int, default=200_000, help="rows to generate (default 200000)")
    s.add_argument("--out", required=True, help="output directory (part-NNNNN.parquet + _dataset.json)")
    s.add_argument("--seed", type=seed_int, default=0, help="seed of the data and its signal (default 0)")
    s.add_argument(
        "--table-set",
        "--tables",  # the older spelling
        dest="tables",
        default=None,
        choices=MODEL_NAMES,
        help="named table set (tpurec/data/catalog.py), default dlrm-tiny",
    )
    s.add_argument("--rows-per-file", type=positive_int, default=1_000_000, help="rows per file (default 1000000)")
    s.add_argument(
        "--row-group-size", type=positive_int, default=65536, help="rows per Parquet row group (default 65536)"
    )
    s.add_argument(
        "--compression", type=parquet_codec, default="none", help="Parquet codec (default none: fastest to read)"
    )
    s.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out (after success)")
    s.add_argument(
        "--raw-ids",
        action="store_true",
        help="raw ids as `data convert --raw-ids` keeps them (Zipf-skewed over --id-space ids per feature, "
        "not table rows): hashed into the model's tables at read time, or remapped by `tpurec train --zch`",
    )
    s.add_argument(
        "--id-space",
        type=positive_int,
        default=None,
        help="with --raw-ids: distinct raw ids per feature (default 2**32, as Criteo's hex ids)",
    )
    _common(s)
    s.set_defaults(run=run_synth)


def _add_inspect(dsub: argparse._SubParsersAction) -> None:
    """`tpurec data inspect`'s flags."""
    i = dsub.add_parser("inspect", help="schema, rows, row groups, per-column stats, label rate")
    i.add_argument(
        "path",
        metavar="DIR",
        help="a dataset directory or one Parquet file; also Parquet tpurec did not write (see --label)",
    )
    i.add_argument("--json", action="store_true", help="one JSON document instead of text")
    i.add_argument(
        "--mapping",
        action="store_true",
        help="Parquet without tpurec's metadata: print only its column mapping, as a --columns file (YAML)",
    )
    from tpurec.data.mapping import add_flags

    add_flags(i)  # --label/--dense/--sparse/--columns: Parquet tpurec did not write
    i.set_defaults(run=run_inspect)


def run(args: argparse.Namespace) -> int:
    """`tpurec data` without an action: its help, exit 2."""
    if _parser is not None:
        _parser.print_help()
    return 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def reader_gone_ok(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`tpurec data inspect DIR | head`: the reader closing the pipe early ends the command quietly
    (exit 0). User errors are printed by `tpurec.cli.main` (one line, exit 2)."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except BrokenPipeError:  # the reader has what it wanted
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return 0

    return wrapped


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _check_out_dir(args: argparse.Namespace) -> None:
    """--out is written last: refuse one that cannot be written before converting a byte."""
    from tpurec.outputs import check_outputs

    check_outputs([("--out", args.out, "dir")])


MAX_TABLE_SIZE = 2**40  # as tpurec plan --tables bounds rows (tpurec/planner/tables_file.py)


def _whole_numbers(flag: str, text: str, lo: int | None = None) -> list[int]:
    """A comma-separated list of whole numbers (each >= `lo`, and <= MAX_TABLE_SIZE when `lo` is given),
    or UserError naming the flag and the entry: `--table-sizes abc` was a ValueError traceback."""
    out = []
    for i, x in enumerate(text.split(",")):
        try:
            v = int(x.strip())
        except ValueError:
            raise UserError(f"{flag} {text!r}: entry {i + 1} ({x.strip()!r}) is not a whole number") from None
        if lo is not None and not lo <= v <= MAX_TABLE_SIZE:
            raise UserError(f"{flag} {text!r}: entry {i + 1} ({v}) must be in [{lo}, {MAX_TABLE_SIZE:,}]")
        out.append(v)
    return out


@reader_gone_ok
def run_convert(args: argparse.Namespace) -> int:
    from tpurec.data.staging import staged_inputs, staged_output

    out = args.out  # a bucket's --out and inputs go through local copies (tpurec/data/staging.py)
    with staged_output(out, args.overwrite) as args.out, staged_inputs(args.inputs) as args.inputs:
        code = _dispatch_convert(args, out)
    args.out = out
    return code


def _dispatch_convert(args: argparse.Namespace, out: str) -> int:
    from tpurec.data.convert_mapped import wants_mapping
    from tpurec.data.mapping import spec_from_args

    if wants_mapping(args.inputs, spec_from_args(args), args.format):
        return _run_convert_mapped(args, out)
    return _run_convert_criteo(args, out)


def _run_convert_mapped(args: argparse.Namespace, out: str) -> int:
    """Parquet, or CSV/TSV with a header, through a column mapping (tpurec/data/convert_mapped.py)."""
    from tpurec.data.catalog import get_table_set
    from tpurec.data.convert_mapped import MappedOptions, convert_mapped
    from tpurec.data.mapping import spec_from_args

    for flag, given in [
        ("--raw-ids", args.raw_ids),
        ("--mod-ids", args.mod_ids),
        ("--raw-dense", args.raw_dense),
        ("--npy-dense-min", args.npy_dense_min),
        ("--names", args.names != "merlin"),
    ]:
        if given:
            raise UserError(
                f"{flag} is for Criteo text and TorchRec days; with a column mapping the dense values are kept as "
                "stored, ids hashed into each column's ROWS and the columns keep their names"
            )
    _check_out_dir(args)
    sizes = None
    if args.table_sizes:
        sizes = _whole_numbers("--table-sizes", args.table_sizes, lo=1)
    elif args.tables:
        sizes = [t.num_embeddings for t in get_table_set(args.tables).tables]
    opts = MappedOptions(
        spec=spec_from_args(args),
        ids=args.ids,
        input_format=args.format,
        row_group_size=args.row_group_size,
        compression=args.compression,
        skip_bad_lines=args.skip_bad_lines,
        table_sizes=sizes,
    )
    summary = convert_mapped(args.inputs, args.out, opts, show_progress=_progress(args), overwrite=args.overwrite)
    summary["out_dir"] = out  # not the local copy of a bucket's
    yaml_text = summary.pop("mapping_yaml")
    if args.json:
        print(strict_json.dumps(summary, indent=2))
        return 0
    _print_summary(summary)
    if summary["multi_hot_for_nulls"]:
        names = ", ".join(summary["multi_hot_for_nulls"])
        print(f"written as list columns (0 or 1 id per row: some rows have none): {names}")
    inferred = summary["mapping_inferred"]
    print(f"column mapping{' (inferred: ' + ', '.join(inferred) + ')' if inferred else ''}:")
    print(yaml_text, end="")
    return 0


def _print_summary(summary: dict) -> None:
    print(
        f"converted {summary['rows']:,} rows from {summary['files']} file(s) in {summary['seconds']} s "
        f"({summary['mb_per_s']} MB/s): {summary['bytes_in'] / 1e6:.1f} MB in -> "
        f"{summary['bytes_out'] / 1e6:.1f} MB Parquet in {summary['out_dir']}"
    )
    if summary["bad_lines"]:
        print(f"skipped {summary['bad_lines']:,} malformed line(s), e.g.:")
        for e in summary["bad_examples"]:
            print(f"  {e}")


def _run_convert_criteo(args: argparse.Namespace, out: str) -> int:
    """Criteo text (label, 13 dense, 26 categorical by position) and TorchRec's .npy/.npz days."""
    from tpurec.data import npy
    from tpurec.data.catalog import get_table_set
    from tpurec.data.convert import ConvertOptions, convert, resolve_inputs
    from tpurec.data.schema import (
        CAT_HASH,
        CAT_MOD,
        CAT_RAW,
        DENSE_LOG1P,
        DENSE_RAW,
        DENSE_TORCHREC,
        DataSchema,
        criteo_schema,
    )

    if args.raw_ids and args.mod_ids:
        raise UserError("--raw-ids and --mod-ids exclude each other")
    _check_out_dir(args)
    mins = _whole_numbers("--npy-dense-min", args.npy_dense_min) if args.npy_dense_min else None
    opts = ConvertOptions(
        DataSchema(),  # replaced below, once the inputs are known
        input_format=args.format,
        row_group_size=args.row_group_size or 65536,
        skip_bad_lines=args.skip_bad_lines,
        compression=args.compression,
        npy_dense_min=mins,
        ids=_criteo_ids(args.ids),
        ids_stated=args.ids is not None,
    )
    inputs = resolve_inputs(args.inputs, opts)  # text paths, or TorchRec days with their companions
    days = [d for d in inputs if isinstance(d, npy.NpyDay)]
    if days and args.ids is not None:
        raise UserError("--ids is for text: TorchRec's .npy/.npz days hold their ids as numbers")
    if mins and not days:
        raise UserError("--npy-dense-min is for TorchRec .npy days only")
    if days and args.raw_dense and not mins:
        raise UserError("--raw-dense on TorchRec .npy days needs --npy-dense-min (to undo their log)")
    hots = npy.multi_hot_sizes(days[0], 26) if days else [1] * 26
    multi = bool(days) and days[0].multi_hot
    if args.table_sizes:
        sizes = _whole_numbers("--table-sizes", args.table_sizes, lo=1)
    else:
        table_set = args.tables or ("mlperf-dcnv2" if multi else "criteo-kaggle")
        sizes = [t.num_embeddings for t in get_table_set(table_set).tables]
    dense = DENSE_RAW if args.raw_dense else DENSE_LOG1P
    if days and not mins:
        dense = DENSE_TORCHREC
    categorical = CAT_RAW if args.raw_ids else CAT_MOD if (args.mod_ids or multi) else CAT_HASH
    dense_names, sparse_names = NAME_PRESETS[args.names]
    opts.schema = criteo_schema(
        sizes,
        dense_names=dense_names,
        sparse_names=sparse_names,
        multi_hot=[h > 1 for h in hots],
        dense_transform=dense,
        categorical=categorical,
    )
    if opts.ids == "decimal":
        opts.schema.extra["ids"] = "decimal"  # the categorical fields were read as decimal, not hex
    summary = convert(inputs, args.out, opts, jobs=args.jobs, show_progress=_progress(args), overwrite=args.overwrite)
    summary["out_dir"] = out  # not the local copy of a bucket's
    if summary["digits_only_inputs"]:
        first = summary["digits_only_inputs"][0]
        print(
            f"tpurec data convert: notice: the categorical fields of {first} hold no hex letter: they were read as hex "
            "(Criteo's ids); if they are decimal numbers, convert again with --ids decimal (--ids hex: no notice)",
            file=sys.stderr,
        )
    if args.json:
        print(strict_json.dumps(summary, indent=2))
        return 0
    _print_summary(summary)
    if dense == DENSE_TORCHREC:
        print(
            "dense values kept as TorchRec wrote them (log(x - min + 2), min of each day file); "
            "--npy-dense-min gives tpurec's log(max(x, 0) + 1), as from the text"
        )
    return 0


def _criteo_ids(text: str | None) -> str:
    """Criteo text's categorical fields: hex (Criteo's own, the default) or decimal, for all 26."""
    if text in (None, "hex", "decimal"):
        return text or "hex"
    raise UserError(
        f"--ids {text!r}: Criteo text (label, 13 dense, 26 categorical by position) takes --ids hex or --ids decimal; "
        "strings or per-column kinds need a column mapping (a header line and --label/--dense/--sparse or --columns)"
    )


@reader_gone_ok
def run_synth(args: argparse.Namespace) -> int:
    from tpurec.data.staging import staged_output

    out = args.out  # a bucket's --out is written locally, then uploaded (tpurec/data/staging.py)
    with staged_output(out, args.overwrite) as args.out:
        code = _synth(args, out)
    return code


def _synth(args: argparse.Namespace, out: str) -> int:
    from tpurec.data.synth import synthesize
    from tpurec.data.synth_bounds import rows_problem

    _check_out_dir(args)
    args.tables = args.tables or "dlrm-tiny"
    if args.id_space is not None and not args.raw_ids:
        raise UserError("--id-space is for --raw-ids data (table rows come from --table-set)")
    too_many = rows_problem("--rows", args.rows, args.out, args.tables, compression=args.compression)
    if too_many:  # before anything is written
        raise UserError(too_many)

    summary = synthesize(
        args.rows,
        args.out,
        seed=args.seed,
        table_set=args.tables,
        rows_per_file=args.rows_per_file,
        row_group_size=args.row_group_size,
        compression=args.compression,
        show_progress=_progress(args),
        overwrite=args.overwrite,
        raw_ids=args.raw_ids,
        **({"id_space": args.id_space} if args.id_space else {}),
    )
    summary["out_dir"] = out
    if args.json:
        print(strict_json.dumps(summary, indent=2))
        return 0
    print(
        f"wrote {summary['rows']:,} rows ({summary['table_set']}, seed {summary['seed']}) in "
        f"{summary['files']} file(s) to {out} in {summary['seconds']} s"
    )
    print(f"label rate {summary['label_rate']:.4f}, oracle_auc {summary['oracle_auc']:.4f}")
    return 0


@reader_gone_ok
def run_inspect(args: argparse.Namespace) -> int:
    from tpurec.data.inspect import format_report, inspect_dataset
    from tpurec.data.mapped import open_source, unread_files_note
    from tpurec.data.mapping import spec_from_args

    source = open_source(args.path, spec_from_args(args))  # None: tpurec's own data (no mapping given)
    if args.mapping:
        if source is None:
            raise UserError(f"{args.path}: tpurec's own data needs no column mapping (drop --mapping)")
        print(source.mapping.to_yaml(), end="")
        return 0
    if source is None:
        report = inspect_dataset(args.path)
    else:
        from tpurec.data.inspect_mapped import inspect_mapped

        report = inspect_mapped(source)
    unread = unread_files_note(args.path, source.metadata() if source is not None else {})
    if unread:
        print(unread, file=sys.stderr)
    if args.json:
        print(strict_json.dumps(report, indent=2))
        return 0
    print(format_report(report))
    if source is not None:
        print("\ncolumn mapping (save it and pass --columns FILE to train/inspect/stats; --mapping prints only this):")
        print(source.mapping.to_yaml(), end="")
    return 0
