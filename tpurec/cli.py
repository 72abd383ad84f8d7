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
    "plan": "tpurec.sharding.plan_cli",
    "selftest": "tpurec.selftest.cli",
    "train": "tpurec.dlrm.cli",
    "launch": "tpurec.launch_cli",
}


# Actions of a subcommand implemented in a higher layer than the subcommand's own module:
# module holding the subcommand's `actions` subparsers -> module implementing the action.
SUB_ACTIONS: dict[str, str] = {
    "tpurec.data.cli": "tpurec.sharding.limits_cli",  # `tpurec data stats`: limits for a plan's layout
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpurec",
        description="TorchRec on TPU: SparseCore embedding kernels, sharding planner, DLRM pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"tpurec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).register(sub)
    for owner, module in SUB_ACTIONS.items():
        importlib.import_module(module).register(importlib.import_module(owner).actions)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tpurec import interrupts

    with interrupts.handled():
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "run", None):
                parser.print_help()
                return 0 if args.command is None else 2
            return int(args.run(args) or 0)
        except KeyboardInterrupt as e:  # Ctrl-C: one line, not a traceback (tpurec/interrupts.py)
            words = sys.argv[1:] if argv is None else argv
            command = next((f"tpurec {w}" for w in words if not str(w).startswith("-")), "tpurec")
            print(interrupts.line(command, e), file=sys.stderr)
    import gc

    gc.collect()  # the interrupted work's frames (pyarrow's CSV reader among them) freed now, not at exit
    return interrupts.EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
