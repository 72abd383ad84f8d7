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
import sys
import typing
from collections.abc import Callable
from typing import Any, Literal

from tpurec import strict_json
from tpurec.argtypes import fraction_above_zero, fraction_below_one, positive_float, positive_int
from tpurec.data.catalog import MODEL_NAMES, TRAINING_DEFAULTS  # plain data: keeps `tpurec --help` instant
from tpurec.errors import UserError

if typing.TYPE_CHECKING:
    from tpurec.planner.id_limits import IdLimits

# Defaults where no model config says otherwise. DistributedModelParallel's own planning batch
# (tpurec.sharding.dmp.DEFAULT_PLANNING_BATCH_SIZE, checked equal in tests) is repeated here so that
# `tpurec plan --help` imports no torch.
DMP_PLANNING_BATCH_SIZE = 512
TABLES_BATCH_SIZE = 256
TABLES_OPTIMIZER = "rowwise_adagrad"

_EPILOG = """\
examples:
  tpurec plan --model mlperf-dcnv2 --topology v5p-128
  tpurec plan --tables my_tables.yaml --topology v6e-256 --optimizer adam --format png --out plan.png
  tpurec plan --model dlrm-tiny --topology cpu-2 --format json --out plan.json   # CPU dry run
  tpurec plan --model-module my_pkg.models:build_meta_model --topology v5p-128
  tpurec plan --model dlrm-tiny --topology v5p-8 --limits limits.json   # buffers from tpurec data stats
  tpurec plan --tables big.yaml --topology v6e-1 --limits limits.json    # too big: the host tier, caches from the data
  tpurec plan --model dlrm-tiny --topology cpu-1 --host-tier t_C3:0.2:lru   # a table on the host tier
  tpurec plan show plan.json
  tpurec plan diff a.json b.json

slice names: v5p-N (N TensorCores, v5p-128 = 64 devices), v6e-N (N chips), v7x-N (N chips, 2 devices
each), 2xv5p-128 (two slices over DCN), cpu-N (N CPU ranks, dry run); only Cloud TPU slice sizes.
--tables FILE: JSON or YAML list (or {"tables": [...]}) of tables with the keys
  name, num_embeddings (or rows), embedding_dim (or dim)          required
  features (or feature): a name or a list (default: [name])      one pooled output each
  pooling: sum | mean (default sum)    pooling_factor: ids per sample, one number or one per feature
  weighted: true | false    data_type: fp32 | fp16 | bf16
  sharding_types: [table_wise, column_wise, table_column_wise, row_wise, table_row_wise]
  min_partition: narrowest column shard
  Unknown keys are refused. Sample: examples/tables.yaml; reference: docs/planner.md.
A refused plan still writes its report (fits: false, smallest_fitting_topology) and exits 2.
A `--format json` report is also a plan file: tpurec.planner.plan_io.load_plan reads it.
"""


def register(sub: argparse._SubParsersAction) -> None:
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
    src.add_argument("--tables", metavar="FILE", help="tables from a .json / .yaml file (schema below)")
    src.add_argument(
        "--model-module",
        metavar="MODULE:FN",
        help="your model: FN() returns it (built on the meta device), or (model, constraints)",
    )
    p.add_argument("--topology", metavar="SLICE", help="slice name, e.g. v5p-128, v6e-256, v7x-64, cpu-8")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help=f"batch size per device (default: --model: its training config's; --model-module: "
        f"{DMP_PLANNING_BATCH_SIZE}, as DistributedModelParallel; --tables: {TABLES_BATCH_SIZE})",
    )
    from tpurec.embedding.optimizers.registry import spec_names  # lists modules, imports no torch

    p.add_argument(
        "--optimizer",
        choices=spec_names(),
        default=None,
        help="fused embedding optimizer, for optimizer-state bytes (default: --model: its training "
        "config's; --model-module: what the model sets with apply_optimizer_in_backward, else what "
        "`tpurec train --model-module` fuses, --model's (default dlrm-tiny's) --embedding-optimizer; "
        f"--tables: {TABLES_OPTIMIZER})",
    )
    _output_flags(p, default="text")
    p.add_argument(
        "--limits",
        metavar="FILE",
        help="size SparseCore buffers from measured id limits (tpurec data stats, for this topology and "
        "batch) instead of the worst case",
    )
    p.add_argument(
        "--host-tier",
        metavar="auto|off|TABLE[:LF[:lru|lfu]],...",
        default="auto",
        help="tables in host memory behind a device cache of their rows (docs/host_tier.md): auto (default) moves "
        "the largest there when the model does not fit the slice's HBM (caches sized from --limits' hot-row "
        "curves, else 0.2 of the rows); off: none; or the tables named, each with its load factor and eviction",
    )
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
    # Its refusals and errors read `tpurec plan: ...` (no "error:"): a refusal is a result, not a usage error.
    p.set_defaults(run=run, error_prefix="tpurec plan")

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


# What a plan report is written as (`--format`).
PlanFormat = Literal["text", "json", "html", "png"]
PLAN_FORMATS: tuple[PlanFormat, ...] = typing.get_args(PlanFormat)


def _output_flags(p: argparse.ArgumentParser, default: str) -> None:  # a PlanFormat, or argparse.SUPPRESS
    p.add_argument("--format", choices=PLAN_FORMATS, default=default, help=f"output format (default {default})")
    p.add_argument(
        "--out",
        metavar="FILE",
        default=None if default == "text" else default,
        help="write here instead of stdout (png: default plan.png)",
    )


def _check_out(args: argparse.Namespace) -> None:
    """Refuse an --out that cannot be written before planning (UserError: one line, exit 2)."""
    from tpurec.outputs import check_outputs

    check_outputs([("--out", args.out or ("plan.png" if args.format == "png" else None), "file")])


def _limits(args: argparse.Namespace, batch_size: int, tables: list[str]) -> IdLimits | None:
    """--limits as IdLimits, refused unless measured for this model's `tables` (the missing and the
    extra ones named; another model's file was taken and sized none of these tables) and layout."""
    if not args.limits:
        return None
    from tpurec.planner.id_limits import plan_layout, read_limits

    return read_limits(args.limits, plan_layout(args.topology, batch_size), {"": dict.fromkeys(tables)})


def _emit(report: dict, fmt: PlanFormat, out: str | None) -> None:
    from tpurec.outputs import write_atomic
    from tpurec.planner import report as plan_report
    from tpurec.planner import report_html, report_png

    if fmt == "png":
        write_atomic(out or "plan.png", report_png.png_bytes(report), "--out")
        print(f"wrote {out or 'plan.png'}", file=sys.stderr)
        return
    text = {
        "text": plan_report.format_text,
        "html": report_html.html_page,
        "json": lambda r: strict_json.dumps(r, indent=1),
    }[fmt](report)
    if out:
        write_atomic(out, text + "\n", "--out")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)


def _plan(args: argparse.Namespace) -> int:
    if not (args.model or args.tables or args.model_module) or not args.topology:  # before torch loads: at once
        print(
            "tpurec plan: give --model, --tables or --model-module, and --topology (see tpurec plan --help)",
            file=sys.stderr,
        )
        return 2
    _check_out(args)
    from tpurec.planner import host_tier_flag
    from tpurec.planner.topology import cpu_ranks, parse_slice

    host_tier = host_tier_flag.parse(args.host_tier)  # a bad flag told before anything loads

    devices = None
    try:  # a malformed or impossible slice, or more devices than tpurec plans: refused before the heavy imports
        if args.topology.lower().startswith("cpu-"):
            devices = cpu_ranks(args.topology)
        elif not args.topology.startswith("cpu"):
            devices = parse_slice(args.topology).world_size
    except UserError as e:
        raise UserError(f"--topology: {e}") from None
    tables: list[Any] | None = None  # tables_file Entries, or a table set's TableSpecs
    if args.tables:  # a bad file, or more tables than tpurec plans, is refused before torch loads too
        from tpurec.planner.tables_file import load_tables

        tables = load_tables(args.tables, devices)
    if args.model_module:
        from tpurec.planner.model_module import parse_target

        parse_target(args.model_module)
    from tpurec.planner import report as plan_report

    trained = TRAINING_DEFAULTS.get(args.model)  # what `tpurec train --model NAME` uses
    if args.model_module:
        batch_size = args.batch_size or DMP_PLANNING_BATCH_SIZE
    else:
        batch_size = args.batch_size or (trained.batch_size if trained else TABLES_BATCH_SIZE)
    optimizer = args.optimizer or (trained.embedding_optimizer if trained else TABLES_OPTIMIZER)
    kw = dict(
        batch_size=batch_size,
        host_tier=host_tier,
        sc_gather_fraction=args.sc_gather_fraction,
        dcn_bw_per_host=args.dcn_gbps * 1e9 if args.dcn_gbps else None,
        headroom_fraction=args.headroom,
    )
    if args.model_module:
        from tpurec.planner import model_module

        model, constraints = model_module.load_model(args.model_module)
        specs = model_module.model_tables(model, constraints)
        for line in model_module.unspread_remaps(model, devices or 1):
            print(f"tpurec plan: warning: {line}", file=sys.stderr)
        from tpurec.data.catalog import model_module_optimizer
        from tpurec.planner.planners import infer_optimizer

        # as `tpurec train --model-module` trains it (not DMP's SGD for a model that sets none)
        optimizer, source = model_module_optimizer(infer_optimizer(model), args.model)
        if args.optimizer:
            optimizer, source = args.optimizer, "--optimizer"
        report = plan_report.plan_module(
            model,
            specs,
            args.topology,
            optimizer=optimizer,
            optimizer_source=source,
            constraints=constraints,
            model=args.model_module,
            limits=_limits(args, batch_size, [t.name for t in specs]),
            **kw,
        )
    else:
        if args.model:
            from tpurec.data.catalog import get_table_set

            tables = list(get_table_set(args.model).tables)
        assert tables is not None  # --model or --tables: checked first thing
        names = [t.spec.name if hasattr(t, "spec") else t.name for t in tables]
        report = plan_report.plan_tables(
            tables,
            args.topology,
            optimizer=optimizer,
            model=args.model or args.tables,
            limits=_limits(args, batch_size, names),
            **kw,
        )
    # A refused plan still writes its report (fits: false), then says why and what would fit.
    _emit(report, args.format, args.out)
    if report.get("refusal"):
        print(f"tpurec plan: {report['refusal']}", file=sys.stderr)
        print(f"tpurec plan: smallest fitting slice: {plan_report.fitting_text(report)}", file=sys.stderr)
        return 2
    return 0


def _quiet_planner(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """torchrec warns that our Topology is not built by its TopologyFactory; not actionable here."""

    @functools.wraps(fn)
    def wrapper(args: argparse.Namespace) -> int:
        import logging

        logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)
        return fn(args)

    return wrapper


def _reports(args: argparse.Namespace, want: int) -> list[dict] | None:
    from tpurec.planner import report as plan_report

    if len(args.files) != want:
        print(f"tpurec plan {args.action}: needs {want} plan file(s)", file=sys.stderr)
        return None
    return [plan_report.report_from_file(f) for f in args.files]


@_quiet_planner
def _show(args: argparse.Namespace) -> int:
    _check_out(args)
    reports = _reports(args, 1)
    if reports is None:
        return 2
    _emit(reports[0], args.format, args.out)
    return 0


@_quiet_planner
def _diff(args: argparse.Namespace) -> int:
    from tpurec.planner import report as plan_report

    reports = _reports(args, 2)
    if reports is None:
        return 2
    print(plan_report.diff_reports(*reports))
    return 0


run = _quiet_planner(_plan)  # `tpurec plan` without a sub-command
