"""`tpurec plan`: plan a table set on a TPU slice offline, or show / diff saved plans.

Forms:
  tpurec plan --model mlperf-dcnv2 --topology v5p-128 [--format text|json|html|png] [--out FILE]
  tpurec plan show PLAN.json [--format ...] [--out FILE]
  tpurec plan diff A.json B.json
`show` and `diff` are argparse sub-commands of `plan` (each with its own -h); planning is `plan`
itself, so its flags need no sub-command. Exit code 2 when the plan does not fit. Heavy imports
happen when a command runs, so `tpurec --help` stays fast.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

from tpurec.argtypes import fraction_above_zero, fraction_below_one, positive_float, positive_int
from tpurec.catalog import MODEL_NAMES  # plain data: keeps `tpurec --help` instant

_EPILOG = """\
examples:
  tpurec plan --model mlperf-dcnv2 --topology v5p-128
  tpurec plan --tables my_tables.yaml --topology v6e-256 --optimizer adam --format png --out plan.png
  tpurec plan --model dlrm-tiny --topology cpu-2 --format json --out plan.json   # CPU dry run
  tpurec plan show plan.json
  tpurec plan diff a.json b.json

slice names: v5p-N (N TensorCores, v5p-128 = 64 devices), v6e-N (N chips), v7x-N (N chips, 2 devices
each), 2xv5p-128 (two slices over DCN), cpu-N (N CPU ranks, dry run).
--tables FILE: JSON or YAML list (or {"tables": [...]}) of {name, num_embeddings, embedding_dim,
pooling_factor (default 1), feature (default name)}.
A `--format json` report is also a plan file: tpurec.sharding.plan_io.load_plan reads it.
"""


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan embedding sharding for a TPU slice, or show / diff saved plans",
        description="Plan embedding-table sharding for a TPU slice with tpurec's HBM and time model "
        "(no TPU needed), or inspect saved plans: 'tpurec plan show PLAN.json', "
        "'tpurec plan diff A.json B.json'.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", choices=MODEL_NAMES, help="a named table set")
    src.add_argument("--tables", metavar="FILE", help="tables from a .json / .yaml file")
    p.add_argument("--topology", metavar="SLICE", help="slice name, e.g. v5p-128, v6e-256, v7x-64, cpu-8")
    p.add_argument("--batch-size", type=positive_int, default=256, help="batch size per device (default 256)")
    from tpurec.embedding.optimizers.registry import spec_names  # lists modules, imports no torch

    p.add_argument(
        "--optimizer",
        choices=spec_names(),
        default="rowwise_adagrad",
        help="fused embedding optimizer, for optimizer-state bytes (default rowwise_adagrad)",
    )
    _output_flags(p, default="text")
    p.add_argument(
        "--sc-gather-fraction",
        type=fraction_above_zero,
        default=None,
        help="assumed SparseCore gather bandwidth as a fraction of HBM bandwidth (default 0.3)",
    )
    p.add_argument(
        "--dcn-gbps",
        type=positive_float,
        default=None,
        help="assumed DCN bandwidth per host in GB/s across slices (default 25)",
    )
    p.add_argument(
        "--headroom",
        type=fraction_below_one,
        default=None,
        help="fraction of HBM kept free for runtime and fragmentation (default 0.05)",
    )
    p.set_defaults(run=run)

    # Not required: without a sub-command, `tpurec plan` plans (the flags above).
    actions = p.add_subparsers(dest="action", metavar="{show,diff}", title="saved plans (omit to plan a table set)")
    show = actions.add_parser(
        "show",
        help="re-report a saved plan (recomputed from the plan and its meta)",
        description="Re-report a saved plan file (a `tpurec plan --format json` report, "
        "or `tpurec train --save-plan`): recomputed from the plan and its meta.",
    )
    show.add_argument("files", nargs="*", metavar="PLAN.json", help="the plan file")
    # SUPPRESS: `tpurec plan --format json show P.json` keeps working (the flag given before `show`).
    _output_flags(show, default=argparse.SUPPRESS)
    show.set_defaults(run=_show)
    diff = actions.add_parser(
        "diff",
        help="compare two saved plans",
        description="Which tables moved between two saved plans, and the step time, "
        "imbalance and largest HBM use before and after.",
    )
    diff.add_argument("files", nargs="*", metavar="PLAN.json", help="two plan files: A.json B.json")
    diff.set_defaults(run=_diff)


def _output_flags(p, default) -> None:
    p.add_argument(
        "--format", choices=("text", "json", "html", "png"), default=default, help=f"output format (default {default})"
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        default=None if default == "text" else default,
        help="write here instead of stdout (png: default plan.png)",
    )


def _load_tables(path: str):
    from tpurec.catalog import TableSpec

    try:
        with open(path) as f:
            if path.endswith((".yaml", ".yml")):
                import yaml

                doc = yaml.safe_load(f)
            else:
                doc = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    except Exception as e:  # JSON or YAML syntax: say where
        raise ValueError(f"{path}: not a valid tables file ({type(e).__name__}: {e})") from None
    items = doc.get("tables") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a list of tables (or {{'tables': [...]}})")
    out, seen = [], set()
    for i, t in enumerate(items):
        name, rows, dim, pooling = _table_entry(path, i, t)
        if name in seen:
            raise ValueError(f"{path}: table #{i}: name {name!r} is used twice")
        seen.add(name)
        data_type = str(t.get("data_type", "fp32")).lower()
        if data_type not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"{path}: table #{i} ({name!r}): data_type {data_type!r} must be fp32, fp16 or bf16")
        out.append(TableSpec(name, t.get("feature", name), rows, dim, pooling, data_type))
    return out


TABLE_KEYS = {"name", "num_embeddings", "rows", "embedding_dim", "dim", "pooling_factor", "feature", "data_type"}
MAX_TABLE_ROWS = 2**40  # far above any real table; catches 1e20 and unit mistakes
MAX_EMBEDDING_DIM = 65536


def _table_entry(path: str, i: int, t) -> tuple[str, int, int, float]:
    """(name, rows, dim, pooling) of entry #i, or a ValueError naming the file, table and field."""
    if not isinstance(t, dict):
        raise ValueError(f"{path}: table #{i} is {type(t).__name__}, expected an object with name, rows, dim")
    name = t.get("name")
    where = f"{path}: table #{i}" + (f" ({name!r})" if name else "")
    unknown = sorted(set(t) - TABLE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(TABLE_KEYS)}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: needs a 'name' (a non-empty string)")

    def whole(field: str, alias: str, hi: int) -> int:
        value = t.get(field, t.get(alias))
        if value is None:
            raise ValueError(f"{where}: needs '{field}' (or '{alias}')")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{where}: {field} {value!r} is not a whole number")
        try:
            number = float(value) if not isinstance(value, int) else value
        except ValueError:
            raise ValueError(f"{where}: {field} {value!r} is not a whole number") from None
        if not math.isfinite(number) or number != int(number):
            raise ValueError(f"{where}: {field} {value!r} is not a whole number")
        if not 1 <= number <= hi:
            raise ValueError(f"{where}: {field} {value!r} must be in [1, {hi:,}]")
        return int(number)

    rows = whole("num_embeddings", "rows", MAX_TABLE_ROWS)
    dim = whole("embedding_dim", "dim", MAX_EMBEDDING_DIM)
    pooling = t.get("pooling_factor", 1.0)
    try:
        pooling = float(pooling)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: pooling_factor {pooling!r} is not a number") from None
    if not math.isfinite(pooling) or pooling <= 0:
        raise ValueError(f"{where}: pooling_factor {pooling!r} must be a finite number > 0")
    return name, rows, dim, pooling


def _emit(report: dict, fmt: str, out: str | None) -> None:
    from tpurec.sharding import inspect, render

    if fmt == "png":
        data = render.png_bytes(report)
        with open(out or "plan.png", "wb") as f:
            f.write(data)
        print(f"wrote {out or 'plan.png'}", file=sys.stderr)
        return
    text = {"text": inspect.format_text, "html": render.html_page, "json": lambda r: json.dumps(r, indent=1)}[fmt](
        report
    )
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)


def _plan(args) -> int:
    if not (args.model or args.tables) or not args.topology:  # before torch is imported: at once
        print("tpurec plan: give --model or --tables, and --topology (see tpurec plan --help)", file=sys.stderr)
        return 2
    from tpurec.sharding.topology import parse_slice

    if not args.topology.startswith("cpu"):
        parse_slice(args.topology)  # a malformed or impossible slice is refused before the heavy imports
    from tpurec.sharding import inspect

    if args.model:
        from tpurec.catalog import get_table_set

        tables, model = list(get_table_set(args.model).tables), args.model
    else:
        tables, model = _load_tables(args.tables), args.tables
    try:
        report = inspect.plan_tables(
            tables,
            args.topology,
            batch_size=args.batch_size,
            optimizer=args.optimizer,
            model=model,
            sc_gather_fraction=args.sc_gather_fraction,
            dcn_bw_per_host=args.dcn_gbps * 1e9 if args.dcn_gbps else None,
            headroom_fraction=args.headroom,
        )
    except inspect.PlanDoesNotFit as e:
        print(f"tpurec plan: {e}", file=sys.stderr)
        return 2
    _emit(report, args.format, args.out)
    return 0


def _guarded(fn):
    """User errors (bad files, bad values) become one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(args) -> int:
        import logging

        # torchrec warns that our Topology is not built by its TopologyFactory; not actionable here.
        logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
        try:
            return fn(args)
        except (ValueError, OSError) as e:
            print(f"tpurec plan: {e}", file=sys.stderr)
            return 2

    return wrapper


def _reports(args, want: int):
    from tpurec.sharding import inspect

    if len(args.files) != want:
        print(f"tpurec plan {args.action}: needs {want} plan file(s)", file=sys.stderr)
        return None
    return [inspect.report_from_file(f) for f in args.files]


@_guarded
def _show(args) -> int:
    reports = _reports(args, 1)
    if reports is None:
        return 2
    _emit(reports[0], args.format, args.out)
    return 0


@_guarded
def _diff(args) -> int:
    from tpurec.sharding import inspect

    reports = _reports(args, 2)
    if reports is None:
        return 2
    print(inspect.diff_reports(*reports))
    return 0


run = _guarded(_plan)  # `tpurec plan` without a sub-command
