"""`tpurec bench kernels`: the embedding layer's training step, tpurec vs FBGEMM's CPU TBE, cell by cell.

A step is forward + backward + the fused update (preprocessing included for tpurec). Cells,
contenders, the equal-work check and the statistics are `tpurec.bench.matrix`'s:

* `--matrix`: 4 optimizers x 4 poolings x 3 shapes (`matrix.SHAPES`), 48 cells;
* default: the issue's original workload, 26 tables x 100k rows x dim 64, batch 2048, Zipf(1.05)
  ids scattered over each table (`matrix.CRITEO26`), every optimizer at pooling 1 and 20 (choose
  with --optimizer / --pooling), plus the machine's random-gather roofline (torch.index_select of
  64-float rows from a 2.6M-row table, uniform and Zipf ids), since lookups are memory-bound.

Earlier versions also timed 26 nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad against row-wise
Adagrad: element-wise against row-wise, unequal work, so that column is gone; torch's sparse
optimizer is now the peer only where FBGEMM has none (Adam: torch.optim.SparseAdam, the same lazy
update). All contestants run with the same torch thread count (1 by default: FBGEMM's fused
backward is single-threaded).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tpurec import strict_json
from tpurec.argtypes import positive_int
from tpurec.bench import timer, workloads

NUM_TABLES, ROWS, DIM = 26, 100_000, 64


def _pooling(text: str) -> int | str:
    if text == "var":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a pooling factor >= 1 or 'var'")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    from tpurec.bench.contenders import OPTIMIZERS

    p = sub.add_parser("kernels", help="embedding training step: tpurec CPU reference vs FBGEMM CPU TBE, per cell")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds (a smoke run, not a measurement)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--markdown", action="store_true", help="print every cell as a Markdown table")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every contestant (default 1: FBGEMM's fused backward is single-threaded, "
        "and idle spinning threads distort timings on a shared 2-core machine)",
    )
    p.add_argument(
        "--matrix",
        action="store_true",
        help="every cell of optimizers x poolings (1 20 100 var) x shapes (small, large, hot): 48 cells",
    )
    p.add_argument(
        "--optimizer", nargs="+", choices=list(OPTIMIZERS), default=None, help="optimizers to run (default all)"
    )
    p.add_argument(
        "--pooling",
        type=_pooling,
        nargs="+",
        default=None,
        help="pooling factors, or 'var' (bag lengths 0..40) (default 1 20; --matrix 1 20 100 var)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="timed rounds per cell, in random order, the median reported (default 7, --quick 2)",
    )
    p.add_argument(
        "--weight-decay",
        action="store_true",
        help="instead: what weight decay costs tpurec's step, each decay against its undecayed twin "
        "(tpurec/bench/decay.py)",
    )
    p.add_argument(
        "--sequence",
        action="store_true",
        help="instead: an EmbeddingCollection (unpooled) training step, tpurec vs stock TorchRec's EC "
        "(tpurec/bench/sequence.py)",
    )
    p.set_defaults(run=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    if args.sequence:
        from tpurec.bench.sequence import format_sequence, run_sequence

        result = run_sequence(quick=args.quick, rounds=args.rounds)
        print(strict_json.dumps(result, indent=2) if args.json else format_sequence(result))
        return 0
    if args.weight_decay:
        from tpurec.bench import decay

        r = decay.run(
            quick=args.quick,
            poolings=args.pooling or decay.POOLINGS,
            rounds_=args.rounds,
            say=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
        print(strict_json.dumps(r, indent=2) if args.json else decay.format_decay(r))
        return 0
    result = run(
        quick=args.quick, matrix=args.matrix, optimizers=args.optimizer, poolings=args.pooling, rounds=args.rounds
    )
    if args.markdown:
        from tpurec.bench.matrix import format_markdown

        print(format_markdown(result))
    else:
        print(strict_json.dumps(result, indent=2) if args.json else format_table(result))
    if result["refused"]:
        print(f"tpurec bench kernels: error: {len(result['refused'])} cell(s) refused: unequal work", file=sys.stderr)
        return 1
    return 0


def run(
    quick: bool = False,
    matrix: bool = False,
    optimizers: Sequence[str] | None = None,
    poolings: Sequence[int | str] | None = None,
    rounds: int | None = None,
    shapes: dict[str, Any] | None = None,
    say: Callable[[str], None] | None = None,
) -> dict:
    """The matrix (`matrix=True`) or the issue's workload; see the module docstring."""
    from tpurec.bench import matrix as m
    from tpurec.bench.contenders import OPTIMIZERS

    if shapes is None and not matrix:
        shapes = {"tiny": m.QUICK_SHAPES["hot"]} if quick else {"criteo26": m.CRITEO26}
    result = m.run_matrix(
        quick=quick,
        shapes=shapes,
        optimizers=optimizers or tuple(OPTIMIZERS),
        poolings=poolings or (m.POOLINGS if matrix else (1, 20)),
        rounds_=rounds,
        say=say or (lambda msg: print(msg, file=sys.stderr, flush=True)),
    )
    if not matrix:
        rows = sum(s["tables"] * s["rows"] for s in result["shapes"].values())
        result["roofline"] = gather_roofline(repeats=2 if quick else 5, rows=rows, n=min(1_000_000, 20 * rows))
    return result


def gather_roofline(repeats: int = 5, rows: int = NUM_TABLES * ROWS, n: int = 1_000_000) -> dict:
    """Rows/s of torch.index_select on a 2.6M x 64 f32 table (uniform and Zipf ids): the memory-bound ceiling."""
    import numpy as np
    import torch

    table = torch.randn(rows, DIM)
    rng = np.random.default_rng(0)
    out = {}
    for name, ids in (
        ("uniform", rng.integers(0, table.shape[0], n)),
        ("zipf", workloads.zipf_ids(rng, n, table.shape[0], scatter_seed=workloads.SCATTER_SEED)),
    ):
        idx = torch.from_numpy(ids)
        runs = timer.repeat(functools.partial(table.index_select, 0, idx), warmup=1, repeats=repeats)
        out[f"gather_rows_per_s_{name}"] = n / runs.median
    out["gather_gb_per_s_uniform"] = out["gather_rows_per_s_uniform"] * DIM * 4 * 2 / 1e9  # read + write
    return out


def format_table(r: dict) -> str:
    from tpurec.bench.matrix import format_matrix

    lines = [format_matrix(r)]
    rf = r.get("roofline")
    if rf:
        lines.append(
            f"roofline: index_select {rf['gather_rows_per_s_uniform'] / 1e6:.1f} M rows/s uniform "
            f"({rf['gather_gb_per_s_uniform']:.1f} GB/s), {rf['gather_rows_per_s_zipf'] / 1e6:.1f} M rows/s zipf"
        )
    return "\n".join(lines)
