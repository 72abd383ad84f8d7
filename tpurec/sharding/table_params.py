"""A sharded module's tables in `named_parameters()`, under TorchRec's names and shapes.

TorchRec's sharded EBC/EC on a fused kernel registers, per table, `embedding_bags.<table>.weight`
(EC: `embeddings.<table>.weight`): this rank's part of the table as a parameter over the kernel's
storage (`TableBatchedEmbeddingSlice`), marked `_in_backward_optimizers`, or an empty parameter
marked with an `EmptyFusedOptimizer` where this rank holds no shard. Those names are also what
TorchRec's composable API (`shard`, `shard_modules`) checks the sharded module against: sharding
may not change a module's parameter FQNs. TorchRec leaves `customized_kernel` tables out of that
registration, so tpurec does it here, with `tpurec.embedding.table_params`'s slots (the sharded
module keeps publishing ShardedTensors in state_dict).

Several column shards of one table on this rank (CW, TWCW) are one parameter in TorchRec,
[shards x rows, cols], since FBGEMM stores them end to end. tpurec's kernel pads each shard's rows
to its SparseCore partitions, so that view exists only when no padding falls between them; with
padding the parameter is [shards, rows, cols] over the same storage (same elements, still the live
table), and where the shards do not lie evenly in one storage (different widths, reordered by
pooling factors) a copy, said in a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torchrec.optim.fused import EmptyFusedOptimizer

from tpurec.embedding.table_params import TableSlot, add_slot, table_parameter

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def local_view(views: list[torch.Tensor]) -> torch.Tensor | None:
    """This rank's shards of one table (natural-order views, in the plan's shard order) as one
    tensor over the live storage; None when no single view holds them."""
    first = views[0]
    if len(views) == 1:
        return first
    storage = first.untyped_storage().data_ptr()
    if any(
        v.shape != first.shape or v.stride() != first.stride() or v.untyped_storage().data_ptr() != storage
        for v in views
    ):
        return None
    step = views[1].storage_offset() - first.storage_offset()
    if step <= 0 or any(v.storage_offset() - first.storage_offset() != j * step for j, v in enumerate(views)):
        return None
    rows, cols = first.shape
    if step == rows * first.stride(0):  # end to end: TorchRec's [shards x rows, cols]
        return first.as_strided((len(views) * rows, cols), first.stride())
    return first.as_strided((len(views), rows, cols), (step, *first.stride()))


def publish(module: Any, in_backward_optimizers: Callable[[str], list]) -> None:  # Any: sharded_state imports us
    """Register every SparseCore table of `module` (a `SparseCoreShardedMixin`) under
    `<STATE_PREFIX>.<table>.weight`, marked with `in_backward_optimizers(table)` (a list the module
    fills with the table's fused optimizer once it has one)."""
    views: dict[str, list[torch.Tensor]] = {}
    on_host: set[str] = set()  # tables on the host tier (docs/host_tier.md): their views are host tensors
    for table, kname, _, kmod in module._sc_shards():
        views.setdefault(table, []).append(kmod.kernel.read_weight(kname))
        if kname in (getattr(kmod.kernel, "host_tier", None) or {}):
            on_host.add(table)
    slots = getattr(module, module.STATE_PREFIX)
    for table in module._sc_tables:
        if table not in views:  # no shard here: TorchRec's empty parameter
            weight = torch.nn.Parameter(torch.empty(0, device=module._device))
            weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
            add_slot(slots, table, TableSlot(weight))
            continue
        view = local_view(views[table])
        if view is None:
            logger.warning(
                "tpurec: table %r: its %d shards on this rank do not lie evenly in one storage; "
                "named_parameters() lists a copy of them (its size is right, its values are not the live table's)",
                table,
                len(views[table]),
            )
            view = torch.cat([v.reshape(-1) for v in views[table]])
        add_slot(
            slots, table, TableSlot(table_parameter(view, in_backward_optimizers(table)), on_host=table in on_host)
        )
