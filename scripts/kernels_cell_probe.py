"""Cells of the CPU kernels matrix run in sequence in one process, as the matrix runs them, each with
the process's transparent huge pages after building both sides (docs/results.md, session 38).

The matrix's worst cell (SGD, pooling 100, small) measured 1.03x FBGEMM inside the matrix and 1.1-1.3x
alone: FBGEMM's step there ranged 66-96 ms between runs, tpurec's 62-73. Run a cell alone, after the
cells the matrix runs before it, or under THP_MEM_ALLOC_ENABLE=1 (torch's allocator advises every
allocation onto huge pages):

    python scripts/kernels_cell_probe.py sgd/100/small
    python scripts/kernels_cell_probe.py sgd/1/small sgd/20/small sgd/100/small
    THP_MEM_ALLOC_ENABLE=1 python scripts/kernels_cell_probe.py sgd/100/small

One JSON line per cell: the cell's ratio (median of its rounds, as the matrix reports it), its rounds'
ratios and who ran first in each, both sides' median step, and the process's AnonHugePages in MB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def huge_pages_mb() -> int:
    """This process's anonymous memory on transparent huge pages, MB (-1 where Linux does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return -1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cells", nargs="+", help="optimizer/pooling/shape, e.g. sgd/100/small, in the order to run")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="the matrix's tiny shapes (a smoke run)")
    args = p.parse_args(argv)

    import torch

    from tpurec.bench import contenders, matrix

    torch.set_num_threads(1)
    shapes = matrix.QUICK_SHAPES if args.quick else matrix.SHAPES
    seen: dict[str, int] = {}

    def build(*a, **k):
        sides = contenders.build(*a, **k)
        seen["huge_mb"] = huge_pages_mb()
        return sides

    for spec in args.cells:
        opt, pooling, shape = spec.split("/")
        c = matrix.run_cell(
            opt,
            pooling if pooling == "var" else int(pooling),
            shape,
            shapes[shape],
            rounds_=args.rounds,
            nbatches=2,
            build=build,
            order_seed=1,
        )
        keys = ("ratio_vs_fbgemm", "round_ratios", "first_in_round", "tpurec_step_ms", "peer_step_ms")
        print(json.dumps({"cell": spec, **{k: c[k] for k in keys}, "huge_pages_mb": seen["huge_mb"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
