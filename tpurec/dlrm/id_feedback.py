"""What a training run saw of its id limits: each table's demand, the batches run in several passes,
the ids dropped; written as a limits file (`--limits-out`) so the next run can start from it.

Every SparseCore kernel of the run, an EmbeddingCollection's sequence lookups' too, counts its
tables' demand per training batch as `tpurec data stats` does (tpurec.embedding.demand), on this
rank's shards; the ranks' figures are merged (the maximum over shards) and the recommended limits
derived the same way (tpurec.planner.id_limits), a sequence table's capacity (`max_ids_per_feature`)
among them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from tpurec import strict_json
from tpurec.embedding.constraints import round_up
from tpurec.planner.id_limits import FORMAT, table_entry

if TYPE_CHECKING:
    from torch import nn

# per table: max ids, unique ids (partition), max ids, unique ids (slice), ids of a sample, batches, ids of a feature
_FIGURES = 7


def record(dmp: nn.Module, on: bool) -> None:
    """Count the tables' demand in the batches from now on (training), or stop (evaluation)."""
    for k in every_kernel(dmp):
        if on:
            k.table_demand = getattr(k, "_kept_demand", None) or {}
            k._kept_demand = k.table_demand
        else:
            k.table_demand = None


def every_kernel(dmp: nn.Module) -> list:
    """Every SparseCore kernel of this rank, sequence (EmbeddingCollection) lookups' too."""
    from tpurec.sharding.sharded_state import SparseCoreShardedMixin

    sharded = [m for m in dmp.modules() if isinstance(m, SparseCoreShardedMixin)]
    return [lookup.kernel for m in sharded for lookup in m.sparsecore_lookups()]


def summary(dmp: nn.Module) -> dict:
    """This rank's kernels (every lookup's): stack inputs run in several passes, ids dropped."""
    ks = every_kernel(dmp)
    return {
        "multipass_batches": sum(k.multipass_batches for k in ks),
        "dropped_ids": sum(k.dropped_id_count for k in ks),
    }


def merged(dmp: nn.Module, world: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """({table: the `_FIGURES`}, {table: [multipass batches, dropped ids]}) over every rank's shards:
    the maximum of each demand figure, the sum of the counts (a shard's stack on each rank)."""
    mine: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
    for k in every_kernel(dmp):
        _merge(mine, (getattr(k, "_kept_demand", None) or {}, k.table_passes))
    if world == 1 or not dist.is_initialized():
        return mine
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    out: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
    for part in everyone:
        _merge(out, part)
    return out


def _merge(
    into: tuple[dict[str, list[int]], dict[str, list[int]]], part: tuple[dict[str, list[int]], dict[str, list[int]]]
) -> None:
    demand, passes = into
    for name, d in part[0].items():
        demand[name] = [max(a, b) for a, b in zip(demand.get(name, [0] * _FIGURES), d)]
    for name, c in part[1].items():
        passes[name] = [a + b for a, b in zip(passes.get(name, [0, 0]), c)]


def per_table(demand: dict[str, list[int]], passes: dict[str, list[int]]) -> dict[str, dict]:
    """What a run saw of each table: the result line's and the metrics' figures."""
    return {
        name: {
            "max_ids": d[0],
            "max_unique_ids": d[1],
            "max_ids_per_slice": d[2],
            "max_unique_ids_per_slice": d[3],
            "max_ids_per_sample": d[4],
            "max_ids_per_feature": d[6],
            "batches": d[5],
            # its stack's: the tables of one stack share its passes and drops
            "multipass_batches": passes.get(name, [0, 0])[0],
            "dropped_ids": passes.get(name, [0, 0])[1],
        }
        for name, d in sorted(demand.items())
    }


def limits_document(demand: dict[str, list[int]], layout: dict, source: str, zch: dict | None = None) -> dict:
    """The limits file of a run's demand; `zch`: the run's remap (--zch), recorded as `data stats --zch`
    records it, so the file is taken only by a run with the same remap."""
    per_slice = round_up(layout["batch_size_per_device"] * layout["world_size"], layout["sparsecores_per_device"])
    per_slice //= layout["sparsecores_per_device"]
    tables = {}
    for name, (*figures, batches, per_feature) in sorted(demand.items()):
        # the most ids of one feature: a sequence table's capacity, recorded for every table as `data stats` does
        tables[name] = table_entry(*figures, per_slice=per_slice, per_feature=per_feature)
        tables[name]["observed"]["batches"] = batches
    doc = {"format": FORMAT, "version": 1, "layout": layout, "data": source}
    return doc | ({"zch": zch} if zch is not None else {}) | {"tables": tables}


def write(path: str, doc: dict, flag: str | None = "--limits-out") -> None:
    """The limits file, whole or not at all (UserError naming the path when it cannot be written)."""
    from tpurec.outputs import write_atomic

    write_atomic(path, strict_json.dumps(doc, indent=1) + "\n", flag)
