"""A batch over its id limits, run as several passes that each fit: never dropped, never failed.

A SparseCore program's buffers are sized by the per-partition id limits (`max_ids_per_partition`,
`max_unique_ids_per_partition`); on a TPU they are compiled in, so a heavier batch cannot get
bigger buffers. jax-tpu-embedding's answer is minibatching (its docs, "Minibatching for SparseCore
Embedding Lookups"): ids are bucketed so that every id lands in exactly one minibatch, lookups are
accumulated over the minibatches and each minibatch's gradient is applied in turn, which equals the
full batch because no row is updated twice. A row alone can still exceed a limit there (a hot id in
more samples of one SparseCore slice than `max_ids_per_partition`).

tpurec splits forward and backward differently, so that even such a row fits:

* **forward**: the batch's (id, sample, gain) entries are cut into passes of at most
  min(max ids, max unique ids) entries per (SparseCore slice, partition); each pass is an ordinary
  SparseCore input of the fixed shapes, and the pooled output is the sum of the passes' outputs
  (the lookup is linear in the entries);
* **backward**: every row the batch touches gets one slot (a sample position) in one update pass;
  the activation gradient of that slot is the row's whole gradient, sum over its entries of gain x
  output gradient, gathered on the device into fixed-shape tensors; each update pass then holds one
  entry per row (gain 1), so the fused optimizer sees each row once with its complete gradient, and
  Adam's step count advances once for the step. Every optimizer's update equals the unsplit one's
  (up to the order of float32 additions).

All passes have the shapes of the fixed limits: on a TPU they reuse the step's programs. The update's
gradient gather is padded to a power of two of entries, so it compiles a few programs, not one per
batch size (its output grows with the number of update passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from tpurec.embedding.preprocess import SparseCoreInput, preprocess


@dataclass
class MultiPassInput:
    """One stack's input when the batch is over its limits: what `lookup` and the fused update run."""

    forward: list[SparseCoreInput]  # lookups, summed
    updates: list[SparseCoreInput]  # fused updates, one entry per row, each row in exactly one
    # Per batch entry: its sample (row of the output gradient), its row's slot over all update passes
    # (pass x device_batch_size + slot) and its gain; the update passes' gradient is their scatter-sum.
    entry_samples: torch.Tensor
    entry_slots: torch.Tensor
    entry_gains: torch.Tensor
    device_batch_size: int
    # Per forward pass, the output block it adds into (stacked_blocks); None: one block
    forward_blocks: list[int] | None = None
    # Per update pass, [device_batch_size] SparseCore ids: each slot's row (an empty slot repeats one
    # of the pass's rows; an empty pass has none). Weight decay gathers and scales rows by them
    # (tpurec/embedding/optimizers/weight_decay.py).
    update_ids: list[torch.Tensor] = field(default_factory=list)

    @property
    def passes(self) -> int:
        return max(len(self.forward), len(self.updates))

    @property
    def blocks(self) -> int:
        return max(self.forward_blocks) + 1 if self.forward_blocks else 1

    def update_gradients(self, grad: torch.Tensor) -> torch.Tensor:
        """[update passes x device_batch_size, width]: the slot of each row holds its full gradient.
        Padding entries (gain 0) add into one spare row past the end, cut off here."""
        size = len(self.updates) * self.device_batch_size
        out = grad.new_zeros(size + 1, grad.shape[1])
        out.index_add_(0, self.entry_slots, grad.index_select(0, self.entry_samples) * self.entry_gains[:, None])
        return out[:size]

    def to(self, device: torch.device) -> MultiPassInput:
        return replace(
            self,
            forward=[c.to(device) for c in self.forward],
            updates=[c.to(device) for c in self.updates],
            entry_samples=self.entry_samples.to(device),
            entry_slots=self.entry_slots.to(device),
            entry_gains=self.entry_gains.to(device),
            update_ids=[u.to(device) for u in self.update_ids],
        )


def split_into_passes(
    ids: torch.Tensor,
    samples: torch.Tensor,
    gains: torch.Tensor,
    *,
    device_batch_size: int,
    num_sc_per_device: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    table_name: str,
    forward: bool = True,
) -> MultiPassInput:
    """The passes of one stack's batch (SparseCore ids, device samples, gains) under fixed limits.
    forward=False: the update passes only (stacked_blocks builds the lookups per block)."""
    num_sc = num_sc_per_device
    parts = num_sc  # preprocess's partitions within a device (global_device_count 1)
    per_slice = device_batch_size // num_sc
    cap = min(max_ids_per_partition, max_unique_ids_per_partition)
    limits: dict[str, Any] = dict(
        device_batch_size=device_batch_size,
        num_sc_per_device=num_sc,
        max_ids_per_partition=max_ids_per_partition,
        max_unique_ids_per_partition=max_unique_ids_per_partition,
        table_name=table_name,
    )
    ids_np = ids.numpy().astype(np.int64, copy=False)
    smp_np = samples.numpy().astype(np.int64, copy=False)

    # Forward: rank each entry within its (slice, partition) segment; pass = rank // cap.
    passes: list[SparseCoreInput] = []
    if forward:
        segment = (smp_np // per_slice) * parts + ids_np % parts
        fwd_pass = _rank_within(segment) // cap
        for p in range(int(fwd_pass.max()) + 1 if fwd_pass.size else 1):
            mask = torch.from_numpy(fwd_pass == p)
            passes.append(preprocess(ids[mask], samples[mask], gains[mask], **limits)[0])

    # Backward: every distinct row gets (pass, slot); slot q lies in slice q // per_slice.
    rows, entry_row = np.unique(ids_np, return_inverse=True)
    row_part = rows % parts
    if per_slice >= parts:  # every partition of a slice gets `each` slots of it per pass
        groups, span, each = 1, parts, max(1, min(cap, per_slice // parts))
    else:  # fewer slots than partitions in a slice: partitions take turns, one slot each
        groups, span, each = -(-parts // per_slice), per_slice, 1
    rank = _rank_within(row_part)  # the row's place among its partition's rows
    slice_ = rank % num_sc
    k = rank // num_sc
    rounds = k // each
    row_pass = rounds * groups + row_part // span
    row_slot = slice_ * per_slice + (row_part % span) * each + k % each
    num_updates = int(row_pass.max()) + 1 if rows.size else 1
    updates, update_ids = [], []
    for p in range(num_updates):
        mask = row_pass == p
        update_ids.append(_slot_ids(rows[mask], row_slot[mask], device_batch_size))
        updates.append(
            preprocess(
                torch.from_numpy(rows[mask]),
                torch.from_numpy(row_slot[mask]),
                torch.ones(int(mask.sum()), dtype=torch.float32),
                **limits,
            )[0]
        )
    slots = (row_pass * device_batch_size + row_slot)[entry_row]
    # The gather/scatter of the update's gradient runs on the device: its length is rounded up to a
    # power of two (padding: sample 0, gain 0, into the spare row) so that batches of different sizes
    # share a few programs instead of compiling one per entry count.
    n = int(ids.numel())
    padded = max(1024, 1 << max(n - 1, 0).bit_length())
    spare = num_updates * device_batch_size
    return MultiPassInput(
        forward=passes,
        updates=updates,
        entry_samples=_padded(samples.to(torch.int64), padded, 0),
        entry_slots=_padded(torch.from_numpy(slots), padded, spare),
        entry_gains=_padded(gains.to(torch.float32), padded, 0.0),
        device_batch_size=device_batch_size,
        update_ids=update_ids,
    )


def _slot_ids(rows: np.ndarray, slots: np.ndarray, size: int) -> torch.Tensor:
    """[size] ids: rows[k] at slots[k], every other slot the pass's first row (empty: no ids)."""
    if rows.size == 0:
        return torch.zeros(0, dtype=torch.int64)
    out = np.full(size, rows[0], dtype=np.int64)
    out[slots] = rows
    return torch.from_numpy(out)


def stacked_blocks(
    inputs: list[SparseCoreInput | MultiPassInput],
    entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    device_batch_size: int,
    num_sc_per_device: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    table_name: str,
) -> MultiPassInput:
    """One stack's input for several blocks of one shape (a sequence batch over its capacity, cut
    into capacity-sized blocks): block j's lookups (its input, or its passes when it is over the
    limits itself) add into output block j; the update is one over every block's entries, each row
    once with its whole gradient, gathered from the stacked [blocks x device batch] gradient.

    entries: per block, its (SparseCore ids, device samples, gains), as the block's input holds them.
    """
    forward: list[SparseCoreInput] = []
    blocks: list[int] = []
    for j, csr in enumerate(inputs):
        passes = csr.forward if isinstance(csr, MultiPassInput) else [csr]
        forward += passes
        blocks += [j] * len(passes)
    ids = torch.cat([e[0] for e in entries])
    samples = torch.cat([e[1].to(torch.int64) + j * device_batch_size for j, e in enumerate(entries)])
    gains = torch.cat([e[2] for e in entries])
    update = split_into_passes(
        ids,
        samples,
        gains,
        device_batch_size=device_batch_size,
        num_sc_per_device=num_sc_per_device,
        max_ids_per_partition=max_ids_per_partition,
        max_unique_ids_per_partition=max_unique_ids_per_partition,
        table_name=table_name,
        forward=False,
    )
    return replace(update, forward=forward, forward_blocks=blocks)


def _padded(t: torch.Tensor, size: int, value) -> torch.Tensor:
    out = torch.full((size,), value, dtype=t.dtype)
    out[: t.numel()] = t
    return out


def _rank_within(keys: np.ndarray) -> np.ndarray:
    """Each element's index among the elements with its key (0, 1, ... in input order)."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]]) if keys.size else np.zeros(0, np.int64)
    run_start = np.repeat(starts, np.diff(np.r_[starts, keys.size]))
    rank = np.empty(keys.size, dtype=np.int64)
    rank[order] = np.arange(keys.size) - run_start
    return rank
