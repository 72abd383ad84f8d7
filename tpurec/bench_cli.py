"""`tpurec bench ...`: one sub-command per benchmark.

Each benchmark module exposes `register(subparsers)` (argparse only; nothing heavy imported at module
top, so `tpurec --help` stays instant) and sets `run(args) -> int` with set_defaults, like the
top-level subcommands. Add a benchmark with one line below.
"""
from __future__ import annotations

import importlib

# name -> module implementing `tpurec bench NAME`.
BENCHES: dict[str, str] = {
    "data": "tpurec.data.bench",
    "kernels": "tpurec.embedding.bench_kernels",
    "preprocess": "tpurec.embedding.bench_preprocess",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (" + ", ".join(BENCHES) + ")")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).register(bsub)
    p.set_defaults(run=lambda args: _no_bench(p))


def _no_bench(parser) -> int:
    parser.print_help()
    return 2
