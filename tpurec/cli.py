"""The `tpurec` command.

Each subcommand lives in its own module, which exposes `register(subparsers)` (builds its argparse
parser without importing anything heavy, so `tpurec --help` is instant) and `run(args) -> int`.
A subcommand appears in the help only once its module is listed below.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tpurec import __version__

# name -> module implementing it. Add a line here when a subcommand lands.
SUBCOMMANDS: dict[str, str] = {
    "env": "tpurec.env_report",
    "data": "tpurec.data.cli",
    "bench": "tpurec.bench.cli",
    "plan": "tpurec.planner.cli",
    "selftest": "tpurec.selftest.cli",
    "train": "tpurec.dlrm.cli",
    "launch": "tpurec.launch.cli",
}


# Actions of a subcommand implemented in a higher layer than the subcommand's own module:
# module holding the subcommand's `actions` subparsers -> module implementing the action.
SUB_ACTIONS: dict[str, tuple[str, ...]] = {
    "tpurec.data.cli": (
        "tpurec.planner.limits_cli",  # `tpurec data stats`: limits for a plan's layout
        "tpurec.dlrm.zch_stats",  # its --zch: the ids after `tpurec train --zch`'s remap
        "tpurec.planner.model_synth",  # `tpurec data synth --model-module`: data for a user's model
    ),
}


def build_parser() -> argparse.ArgumentParser:
    from tpurec.arg_parser import SuggestingParser  # one-line errors, "did you mean" (every subcommand)

    parser = SuggestingParser(
        prog="tpurec",
        description="TorchRec on TPU: SparseCore embedding kernels, sharding planner, DLRM pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"tpurec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    for owner, modules in SUB_ACTIONS.items():
        for module in modules:  # in order: a later one may add to an earlier one's action
            importlib.import_module(module).register(importlib.import_module(owner).actions)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (tpurec.errors.UserError, or an OSError: a path missing or
    unwritable, a full disk) prints as one line and exits 2; any other exception is a bug and
    propagates with its traceback."""
    from tpurec.errors import EXIT_USER_ERROR, UserError
    from tpurec.runtime import interrupts
    from tpurec.runtime.gc_tuning import collect_less

    collect_less()  # before a command imports torch

    args = None
    with interrupts.handled():
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "run", None):
                parser.print_help()
                return 0 if args.command is None else 2
            return int(args.run(args) or 0)
        except (UserError, OSError) as e:
            print(f"{error_prefix(args)}: {e}", file=sys.stderr)
            code = EXIT_USER_ERROR
        except KeyboardInterrupt as e:  # Ctrl-C: one line, not a traceback (tpurec/runtime/interrupts.py)
            words = sys.argv[1:] if argv is None else argv
            command = next((f"tpurec {w}" for w in words if not str(w).startswith("-")), "tpurec")
            print(interrupts.line(command, e), file=sys.stderr)
            code = interrupts.EXIT_INTERRUPTED
    import gc

    # The failed work's frames (pyarrow's CSV reader among them) freed now, not at interpreter exit,
    # where pyarrow can abort the process (exit 134).
    gc.collect()
    return code


def error_prefix(args: argparse.Namespace | None) -> str:
    """`tpurec COMMAND: error` (argparse's form), or the command's own (`set_defaults(error_prefix=...)`)."""
    if args is None or not getattr(args, "command", None):
        return "tpurec: error"
    return getattr(args, "error_prefix", None) or f"tpurec {args.command}: error"


if __name__ == "__main__":
    sys.exit(main())
