"""Room for a checkpoint, checked before training starts: `--checkpoint-dir` on a disk that cannot
hold one checkpoint of this model is refused in one line naming the directory, the bytes a
checkpoint needs and the bytes free, instead of failing at the first save after minutes of training.

A checkpoint holds every table and fused-optimizer state (ShardedTensors: their whole size, each
shard written once by the rank that holds it) and the dense weights and their optimizer state (DCP
writes a replicated tensor once). Files beside them (meta.json, rank-R.json, CHECKSUMS.json, DCP's
.metadata) are a few KiB. The check asks for room for one more checkpoint: older ones are pruned
(`--keep`) only after the new one is complete, and their space is already in use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tpurec.errors import UserError
from tpurec.outputs import free_disk_bytes
from tpurec.runtime import storage

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer


def state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of every tensor in a (nested) state dict, ShardedTensors at their whole size."""
    import torch

    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if hasattr(state, "local_shards") and hasattr(state, "metadata"):  # ShardedTensor
        meta = state.metadata()
        return meta.size.numel() * meta.tensor_properties.dtype.itemsize
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return 0


def check_room(root: str | os.PathLike, dmp: nn.Module, optimizer: Optimizer) -> None:
    """UserError unless `root`'s filesystem has room for one checkpoint of `dmp` and `optimizer`
    (a bucket has no free space to ask for: not checked)."""
    if storage.is_uri(root):
        return
    need = state_bytes({"model": dmp.state_dict(), "optim": optimizer.state_dict()})
    free = free_disk_bytes(root)
    if free is not None and need > free:
        raise UserError(
            f"--checkpoint-dir {root}: a checkpoint of this model needs about {need:,} bytes "
            f"({need / 2**20:,.1f} MiB: tables, optimizer state, dense weights) but only {free:,} bytes are free "
            "there; free some space or give another --checkpoint-dir"
        )
