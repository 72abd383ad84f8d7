"""`tpurec bench ...`: one sub-command per benchmark.

Each benchmark module exposes `register(subparsers)` (argparse only; nothing heavy imported at module
top, so `tpurec --help` stays instant) and sets `run(args) -> int` with set_defaults, like the
top-level subcommands. Add a benchmark with one line below.
"""

from __future__ import annotations

import argparse
import importlib

# name -> module implementing `tpurec bench NAME`.
BENCHES: dict[str, str] = {
    "data": "tpurec.bench.data",
    "kernels": "tpurec.bench.kernels",
    "preprocess": "tpurec.bench.preprocess",
    "train": "tpurec.bench.train",
    "track": "tpurec.bench.track",
    "balance": "tpurec.bench.balance",
    "plan": "tpurec.bench.plan",
    "pipeline": "tpurec.bench.pipeline",
    "stats": "tpurec.bench.stats",
    "zch": "tpurec.bench.zch",
    "tpu-kernels": "tpurec.bench.tpu_kernels",
    "tpu-train": "tpurec.bench.tpu_train",
    "host-tier": "tpurec.bench.host_tier",
}


_parser = None  # `tpurec bench`, kept to print its help when no benchmark is named


def register(sub: argparse._SubParsersAction) -> None:
    global _parser
    p = _parser = sub.add_parser("bench", help="benchmarks (" + ", ".join(BENCHES) + ")")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).register(bsub)
    for name, parser in bsub.choices.items():  # a user error reads `tpurec bench NAME: error: ...`
        parser.set_defaults(error_prefix=f"tpurec bench {name}: error")
    p.set_defaults(run=run)  # each benchmark overrides this with its own run


def run(args: argparse.Namespace) -> int:
    """`tpurec bench` without a benchmark: its help, exit 2."""
    if _parser is not None:
        _parser.print_help()
    return 2
