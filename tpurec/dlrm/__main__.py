"""`python -m tpurec.dlrm`: one rank of `tpurec train`, the entry point torchrun launches.

The `--nproc` launcher of `tpurec train` passes the parsed options as JSON in TPUREC_TRAIN_OPTIONS
(and no flags); a multi-host job runs this module under torchrun with the flags of `tpurec train`:

    .venv/bin/torchrun --nnodes 2 --nproc-per-node 4 ... -m tpurec.dlrm --data DIR [flags of tpurec train]
"""

from __future__ import annotations

import argparse
import os
import sys

from tpurec.runtime.gc_tuning import collect_less

collect_less()  # before the imports below bring in torch and TorchRec

from tpurec.dlrm.cli import run_worker  # noqa: E402
from tpurec.dlrm.options import OPTIONS_ENV, TrainOptions  # noqa: E402
from tpurec.runtime.rank_exit import exit_without_finalizing, run_and_exit  # noqa: E402, F401


def parse_options(argv: list[str]) -> TrainOptions:
    """The options from the launcher's JSON when it set them, else from the command line."""
    p = argparse.ArgumentParser(
        prog="python -m tpurec.dlrm", description="one rank of `tpurec train` (launch with torchrun)"
    )
    TrainOptions.add_arguments(p)
    blob = os.environ.get(OPTIONS_ENV)
    if blob is None:
        return TrainOptions.from_args(p.parse_args(argv))
    if argv:  # two sources would silently disagree
        p.error(f"give the flags or {OPTIONS_ENV}, not both")
    return TrainOptions.from_json(blob)


def main(argv: list[str] | None = None) -> int:
    from tpurec.errors import EXIT_USER_ERROR, UserError

    try:
        options = parse_options(sys.argv[1:] if argv is None else argv)
    except UserError as e:  # a bad OPTIONS_ENV: one line, as `tpurec train` says a bad flag
        print(f"tpurec train: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return run_worker(options)


if __name__ == "__main__":
    run_and_exit(main)
