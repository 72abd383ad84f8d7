"""`tpurec data synth --model-module MOD:FN`: synthetic data for the features of a user's own model.

As TorchRec's RandomRecDataset takes a model's shape (dense count, each feature's table rows and ids
per sample), this reads it off the model (tpurec/planner/model_module.py) and writes tpurec's data
format (tpurec.data.synth, with its known best AUC), which `tpurec train --model-module` reads: a
column per feature, named as the feature; `dense_in_features` dense columns (or --num-dense).

The flags join `tpurec data synth`'s own parser (tpurec/data/cli.py), whose layer may not load a model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tpurec import strict_json
from tpurec.argtypes import nonnegative_int
from tpurec.errors import UserError


def register(actions: argparse._SubParsersAction) -> None:
    s = actions.choices["synth"]
    s.add_argument(
        "--model-module",
        metavar="MOD:FN",
        help="data for your own model's features instead of a table set: a column per feature (ids in "
        "its table's rows, its pooling factor ids per sample), its dense_in_features dense columns",
    )
    s.add_argument(
        "--num-dense",
        type=nonnegative_int,
        default=None,
        help="with --model-module: dense columns, for a model without a dense_in_features attribute",
    )
    plain = s.get_default("run")
    s.set_defaults(run=lambda args: run(args, plain))


def run(args: argparse.Namespace, plain: Callable[[argparse.Namespace], int]) -> int:
    if not args.model_module:
        if args.num_dense is not None:
            raise UserError("--num-dense is for --model-module (a table set has its own 13 dense columns)")
        return plain(args)
    given = [f for f, v in (("--table-set", args.tables), ("--raw-ids", args.raw_ids)) if v]
    if given:
        raise UserError(f"{given[0]}: not with --model-module (the model's tables give the features and their rows)")
    from tpurec.outputs import check_outputs
    from tpurec.planner import model_module

    model_module.parse_target(args.model_module)  # a typo told before torch loads
    check_outputs([("--out", args.out, "dir")])
    model, constraints = model_module.load_model(args.model_module)
    features = model_module.model_features(model, constraints)
    said = model_module.dense_in_features(model)
    if said is not None and args.num_dense is not None and said != args.num_dense:
        raise UserError(f"--num-dense {args.num_dense}: --model-module {args.model_module} takes {said} dense features")
    dense = args.num_dense if args.num_dense is not None else said
    if dense is None:
        raise UserError(
            f"--model-module {args.model_module}: the model does not say how many dense features it takes "
            "(a dense_in_features attribute); give --num-dense N"
        )
    from tpurec.data.synth import features_schema, synthesize
    from tpurec.data.synth_bounds import rows_problem

    own = features_schema(dense, [(f.name, f.rows, f.ids_per_sample) for f in features], model_module=args.model_module)
    too_many = rows_problem("--rows", args.rows, args.out, None, compression=args.compression, own_schema=own)
    if too_many:  # before anything is written
        raise UserError(too_many)
    summary = synthesize(
        args.rows,
        args.out,
        seed=args.seed,
        table_set=None,
        rows_per_file=args.rows_per_file,
        row_group_size=args.row_group_size,
        compression=args.compression,
        show_progress=not args.quiet and sys.stderr.isatty(),
        overwrite=args.overwrite,
        own_schema=own,
    )
    summary["model_module"] = args.model_module
    if args.json:
        print(strict_json.dumps(summary, indent=2))
        return 0
    hot = [f"{f.name} x{f.ids_per_sample}" for f in features if f.ids_per_sample > 1]
    print(
        f"wrote {summary['rows']:,} rows for {args.model_module} ({dense} dense, {len(features)} sparse features"
        + (f"; multi-hot: {', '.join(hot)}" if hot else "")
        + f"; seed {summary['seed']}) in {summary['files']} file(s) to {summary['out_dir']} in {summary['seconds']} s"
    )
    print(f"label rate {summary['label_rate']:.4f}, oracle_auc {summary['oracle_auc']:.4f}")
    return 0
