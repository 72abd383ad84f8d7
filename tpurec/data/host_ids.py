"""Batches whose ids stay on the host when the batch moves to a TPU.

SparseCore preprocessing (building each partition's CSR buffers) is host work: its shapes depend on
the ids. TorchRec's `Batch.to(device)` moves the KeyedJaggedTensor to the device with the dense
features, so under `DistributedModelParallel` the input all-to-all would run on the TPU and every
SparseCore lookup would copy its ids back, one device->host synchronisation per step. A
`HostIdsBatch` moves only the dense features and labels: the ids go from the reader to TorchRec's
input all-to-all on the host (over the process group's gloo half, `cpu:gloo,tpu:tpu_dist`) and on
to preprocessing, and the only ids that reach the TPU are the CSR buffers. torchrec's SparseCore
loader (`torchrec/experimental/torch_tpu/datasets/dataloader.py`) and jax-tpu-embedding keep the
ids on the host the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torchrec.datasets.utils import Batch

from tpurec.runtime import host_copies
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def _move(t: torch.Tensor, device: torch.device, non_blocking: bool, emulated: bool) -> torch.Tensor:
    moved = t.to(device=device, non_blocking=non_blocking)
    if emulated:
        moved = moved.view_as(moved)  # its own tensor object, so the host original stays unmarked
        host_copies.mark_on_device(moved)
    return moved


@dataclass
class HostIdsBatch(Batch):
    def to(self, device: torch.device, non_blocking: bool = False) -> HostIdsBatch:
        from tpurec.runtime.device import emulated_slice

        device = torch.device(device)
        emulated = device.type == DeviceKind.CPU and emulated_slice() is not None
        return HostIdsBatch(
            dense_features=_move(self.dense_features, device, non_blocking, emulated),
            sparse_features=self.sparse_features,
            labels=_move(self.labels, device, non_blocking, emulated),
        )

    def pin_memory(self) -> HostIdsBatch:
        return HostIdsBatch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features,
            labels=self.labels.pin_memory(),
        )


def keep_ids_on_host(batch: Batch) -> HostIdsBatch:
    """`batch` as a HostIdsBatch (the same tensors)."""
    if isinstance(batch, HostIdsBatch):
        return batch
    return HostIdsBatch(batch.dense_features, batch.sparse_features, batch.labels)


def mark_plain_batch_moves() -> None:
    """Emulation only: TorchRec's own `Batch.to(device)` marks what it moves (ids included) as a
    real TPU rank would hold it on its TPU, so a program that moves its ids to the device is seen
    copying them back."""
    if getattr(Batch.to, "_tpurec_marks", False):
        return
    original = Batch.to

    def to(self: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
        moved = original(self, device, non_blocking)
        if torch.device(device).type == DeviceKind.CPU:
            moved = Batch(
                dense_features=_move(moved.dense_features, torch.device("cpu"), False, True),
                sparse_features=_marked_kjt(moved.sparse_features),
                labels=_move(moved.labels, torch.device("cpu"), False, True),
            )
        return moved

    to._tpurec_marks = True  # type: ignore[attr-defined]
    Batch.to = to  # type: ignore[method-assign]


def _marked_kjt(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values, lengths = kjt.values().view_as(kjt.values()), kjt.lengths().view_as(kjt.lengths())
    host_copies.mark_on_device(values)
    host_copies.mark_on_device(lengths)
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=values,
        lengths=lengths,
        weights=kjt.weights_or_none(),
        stride=kjt.stride(),
    )
