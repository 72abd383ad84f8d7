"""Embedding tables listed by `named_parameters()`, as TorchRec's modules list theirs.

TorchRec's EmbeddingBagCollection lists `embedding_bags.<table>.weight` (its EmbeddingCollection
`embeddings.<table>.weight`), and so do its sharded modules on fused kernels: there each entry is a
parameter over the kernel's storage, marked with `_in_backward_optimizers` so that TorchRec's
`in_backward_optimizer_filter` keeps it out of dense optimizers, and never given a `.grad` (the
update happens in backward), so a dense optimizer handed it anyway skips it. Parameter counts,
`parameters()`, FSDP/composable checks of FQNs all rest on those names.

tpurec's kernels hold tables as buffers of stacked storage (`tpurec.embedding.layout`), so a table
is published as a parameter sharing a table's natural-order view: same storage, offset and
strides, so a write through it lands in the live table and every fused update shows in it. The
parameter sits on a `TableSlot` module under the same path as TorchRec's; the owning module keeps
publishing and loading the table through its state_dict hooks (natural order, or ShardedTensors
under sharding), so the slot itself adds nothing to state_dict and loads nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TableSlot(nn.Module):
    """`<prefix>.<table>`: holds the table's `weight` parameter, for named_parameters() only.
    `on_host`: the table is on the host tier (docs/host_tier.md): the parameter is the whole table in
    host memory, and moving the module (`.to(device)`, as DMP does before DDP) leaves it there: the
    table's cache on the device is the kernel's storage, which moves with the kernel."""

    def __init__(self, weight: nn.Parameter, on_host: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.on_host = on_host

    def _apply(self, fn: Any, recurse: bool = True) -> TableSlot:
        return self if self.on_host else super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        pass  # the owner's state_dict hook publishes the table under this very key

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # The owner's load hook has taken this table's key (or reported it missing); anything
        # left under this prefix is unknown, as for any module.
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))


def table_parameter(view: torch.Tensor, in_backward_optimizers: list) -> nn.Parameter:
    """A parameter aliasing `view` (nn.Parameter keeps its storage, offset and strides), marked as
    updated in backward by `in_backward_optimizers`, as TorchRec marks its fused tables."""
    param = nn.Parameter(view, requires_grad=True)
    param._in_backward_optimizers = in_backward_optimizers  # type: ignore[attr-defined]
    return param


def register(module: nn.Module) -> None:
    """A standalone module's tables as `<STATE_PREFIX>.<table>.weight` parameters. The module has
    `kernel` (tables named as its configs), `STATE_PREFIX` and `fused_optimizer`."""
    owner: Any = module  # kernel, STATE_PREFIX and fused_optimizer: set by the standalone module classes
    slots = nn.ModuleDict()
    on_host = owner.kernel.host_tier or {}
    for name in owner.kernel.table_names:
        weight = table_parameter(owner.kernel.read_weight(name), [owner.fused_optimizer])
        add_slot(slots, name, TableSlot(weight, on_host=name in on_host))
    module.add_module(owner.STATE_PREFIX, slots)


def add_slot(slots: nn.ModuleDict, table: str, slot: nn.Module) -> None:
    """`slots[table] = slot`, also for a table named like a ModuleDict method ("items", "keys"),
    which ModuleDict refuses as an attribute clash; its FQN `<prefix>.<table>.weight` is the same."""
    slots._modules[table] = slot
