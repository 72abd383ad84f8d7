"""`tpurec bench balance`: how evenly ids fall on the SparseCore partitions, per storage layout.

tpurec stores tables in natural row order and renames ids so that the SparseCore's MOD partitioning
finds them there (`tpurec/embedding/layout.py`): partition p then holds the natural rows
[p*C, (p+1)*C). The alternative, partition-major storage of natural ids ("MOD"), puts row r on
partition r mod P. Which is better balanced depends on where the hot ids are, so this counts ids
per partition for both, with Zipf(1.05) ids either hashed over the table (a fixed permutation, as
hashed Criteo ids are) or frequency-sorted (low ids hot), and reports max / mean per partition (1.0
is perfect; the SparseCore's id limits and time follow the fullest partition). Counting only: no
timing, so the figures do not depend on machine load.
"""

from __future__ import annotations

import argparse

from tpurec import strict_json
from tpurec.argtypes import positive_int


def _partition_loads(stacked_ids, layout, scheme: str):
    import numpy as np
    import torch

    p = layout.num_partitions
    ids = torch.from_numpy(stacked_ids)
    renamed = ids % p if scheme == "mod" else layout.sparsecore_ids(ids) % p
    counts = np.bincount(renamed.numpy(), minlength=p)
    return float(counts.max() / counts.mean())


def _poolings(tables, pooling) -> list:
    """pooling: ids per sample, one for all tables or one per table."""
    return list(pooling) if isinstance(pooling, (list, tuple)) else [pooling] * len(tables)


def _ids(tables, hashed: bool, batch: int, pooling, seed: int) -> list:
    """Each table's ids, drawn from a generator seeded afresh: the same for every partition count (drawn
    once for both: a hashed table's permutation of up to 40M rows takes most of the run's time)."""
    import numpy as np

    from tpurec.bench.workloads import zipf_ids

    rng = np.random.default_rng(seed)
    return [
        zipf_ids(rng, batch * k, rows, scatter_seed=seed if hashed else None)
        for (_, rows), k in zip(tables, _poolings(tables, pooling))
    ]


def _case(tables, partitions, local, pooling) -> dict:
    """local: each table's ids (`_ids`). "placed": natural-order storage with the stack's tables placed
    by their pooling factors (tpurec/embedding/stack_order.py)."""
    import numpy as np

    from tpurec.embedding.layout import build_stacks

    pooling = _poolings(tables, pooling)
    specs = [(name, rows, 8) for name, rows in tables]
    (stack,) = build_stacks(specs, partitions, pad_to=1)
    (placed,) = build_stacks(
        specs, partitions, pad_to=1, expected_ids={n: float(k) for (n, _), k in zip(tables, pooling)}
    )
    out = {}
    for scheme, lay in (("mod", stack), ("natural", stack), ("placed", placed)):
        stacked = np.concatenate([ids + lay.table(name).offset for (name, _), ids in zip(tables, local)])
        out[scheme] = round(_partition_loads(stacked, lay, "mod" if scheme == "mod" else "natural"), 3)
    return out


def run(batch: int = 2048, pooling: int = 20, seed: int = 0) -> dict:
    from tpurec.data.catalog import MLPERF_DCNV2_MULTI_HOT, get_table_set

    tiny = [(t.name, t.num_embeddings) for t in get_table_set("dlrm-tiny").tables]
    mlperf = [(t.name, t.num_embeddings) for t in get_table_set("mlperf-dcnv2").tables]
    workloads = {
        "one 1M-row table": ([("t", 1_000_000)], pooling),
        "26 dlrm-tiny tables, stacked": (tiny, pooling),
        # its own ids per sample per table: 3, 2, 1, ..., 100, 27, ... (214 in all)
        "MLPerf DCNv2 stack, multi-hot": (mlperf, list(MLPERF_DCNV2_MULTI_HOT)),
    }
    rows = []
    for name, (tables, pf) in workloads.items():
        ids = {hashed: _ids(tables, hashed, batch, pf, seed) for hashed in (True, False)}
        for partitions in (4, 8):
            for hashed in (True, False):
                loads = _case(tables, partitions, ids[hashed], pf)
                rows.append(
                    {
                        "tables": name,
                        "partitions": partitions,
                        "ids": "hashed" if hashed else "frequency-sorted",
                        "max_over_mean_mod": loads["mod"],
                        "max_over_mean_natural": loads["natural"],
                        "max_over_mean_natural_placed": loads["placed"],
                    }
                )
    return {"workload": {"batch": batch, "ids_per_sample_per_table": pooling, "zipf_a": 1.05}, "rows": rows}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("balance", help="ids per SparseCore partition: natural-order storage vs MOD")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.add_argument("--batch-size", type=positive_int, default=2048, help="batch size per device (default 2048)")
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    result = run(batch=args.batch_size)
    if args.json:
        print(strict_json.dumps(result, indent=2))
        return 0
    print(f"max/mean ids per partition, Zipf(1.05), batch {args.batch_size} x 20 ids per table (MLPerf: its own)")
    for r in result["rows"]:
        print(
            f"{r['tables']:30} P={r['partitions']} {r['ids']:17} "
            f"MOD {r['max_over_mean_mod']:.2f}  natural {r['max_over_mean_natural']:.2f}  "
            f"natural, placed by pooling {r['max_over_mean_natural_placed']:.2f}"
        )
    return 0
