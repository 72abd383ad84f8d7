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

All passes have the shapes of the fixed limits: on a TPU they reuse the step's programs, however
many passes a batch needs. So does the update's gradient gather: each update pass's gradient is its
own [device batch + 1, width] tensor, summed from its entries in chunks of a fixed size (a pass
buffer's slots, `gather_chunk`), each chunk a separate tensor (no slice whose offset follows the
pass count), padding entries adding 0 into the spare last row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from tpurec.embedding.constraints import SEGMENT_ALIGN, round_up
from tpurec.embedding.preprocess import SparseCoreInput, preprocess


@dataclass
class MultiPassInput:
    """One stack's input when the batch is over its limits: what `lookup` and the fused update run."""

    forward: list[SparseCoreInput]  # lookups, summed
    updates: list[SparseCoreInput]  # fused updates, one entry per row, each row in exactly one
    # Per update pass, its entries in chunks of one fixed size: (samples (rows of the output
    # gradient), slots (0..device_batch_size; the spare slot device_batch_size for padding), gains
    # (0 for padding)); the pass's gradient is their scatter-sum.
    gather: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
    device_batch_size: int
    # Per forward pass, the output block it adds into (stacked_blocks); None: one block
    forward_blocks: list[int] | None = None
    # Per update pass, [device_batch_size] SparseCore ids: each slot's row (an empty slot repeats one
    # of the pass's rows; an empty pass has none). Weight decay gathers and scales rows by them
    # (tpurec/embedding/optimizers/weight_decay.py).
    update_ids: list[torch.Tensor] = field(default_factory=list)
    # Per update pass, its rows as entries (SparseCore ids, slots; host tensors): what weight decay's
    # L2 entries are built from on the TPU path (kernel_input.KernelInput._row_slots).
    update_rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Weight decay on the TPU path (optimizers/weight_decay.DecayInput, in the shapes of a batch within
    # the limits): L2, one per update pass; decoupled, one, the batch's rows scaled before the passes.
    decays: list[Any] | None = None

    @property
    def passes(self) -> int:
        return max(len(self.forward), len(self.updates))

    @property
    def blocks(self) -> int:
        return max(self.forward_blocks) + 1 if self.forward_blocks else 1

    def update_gradient(self, p: int, grad: torch.Tensor) -> torch.Tensor:
        """[device_batch_size, width]: update pass p's gradient, the slot of each of its rows holding
        the row's full gradient. Every op has shapes fixed by the limits: padding entries (gain 0) add
        into one spare row past the end, cut off here."""
        size = self.device_batch_size
        out = grad.new_zeros(size + 1, grad.shape[1])
        for samples, slots, gains in self.gather[p]:
            out.index_add_(0, slots, grad.index_select(0, samples) * gains[:, None])
        return out[:size]

    def to(self, device: torch.device) -> MultiPassInput:
        return replace(
            self,
            forward=[c.to(device) for c in self.forward],
            updates=[c.to(device) for c in self.updates],
            gather=[[tuple(t.to(device) for t in chunk) for chunk in chunks] for chunks in self.gather],  # type: ignore[misc]
            update_ids=[u.to(device) for u in self.update_ids],
            decays=[d.to(device) for d in self.decays] if self.decays is not None else None,
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
    updates, update_ids, update_rows = [], [], []
    for p in range(num_updates):
        mask = row_pass == p
        update_ids.append(_slot_ids(rows[mask], row_slot[mask], device_batch_size))
        update_rows.append((torch.from_numpy(rows[mask]), torch.from_numpy(row_slot[mask])))
        updates.append(
            preprocess(
                torch.from_numpy(rows[mask]),
                torch.from_numpy(row_slot[mask]),
                torch.ones(int(mask.sum()), dtype=torch.float32),
                **limits,
            )[0]
        )
    # The gather/scatter of each update pass's gradient runs on the device, in chunks of a fixed size
    # (padding: sample 0, gain 0, into the spare slot), so every batch reuses one program per op.
    chunk = gather_chunk(device_batch_size, num_sc, max_ids_per_partition)
    entry_pass = row_pass[entry_row]
    order = np.argsort(entry_pass, kind="stable")
    bounds = np.searchsorted(entry_pass[order], np.arange(num_updates + 1))
    smp_all, gains_all = samples.to(torch.int64), gains.to(torch.float32)
    slots_all = torch.from_numpy(row_slot[entry_row])
    gather = []
    for p in range(num_updates):
        mine = torch.from_numpy(order[bounds[p] : bounds[p + 1]])
        gather.append(
            [
                (
                    _padded(smp_all[idx], chunk, 0),
                    _padded(slots_all[idx], chunk, device_batch_size),
                    _padded(gains_all[idx], chunk, 0.0),
                )
                for idx in mine.split(chunk)
            ]
        )
    return MultiPassInput(
        forward=passes,
        updates=updates,
        gather=gather,
        device_batch_size=device_batch_size,
        update_ids=update_ids,
        update_rows=update_rows,
    )


def gather_chunk(device_batch_size: int, num_sc_per_device: int, max_ids_per_partition: int) -> int:
    """Entries per chunk of an update pass's gradient gather: the COO slots of one SparseCore input
    at these limits (every SparseCore's buffer, round_up(max ids, 8) per partition), at least the
    device batch. Fixed by the limits, so the gather's programs are too."""
    buffer = num_sc_per_device * num_sc_per_device * round_up(max(max_ids_per_partition, 1), SEGMENT_ALIGN)
    return max(buffer, device_batch_size)


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


def _padded(t: torch.Tensor, size: int, value: float) -> torch.Tensor:
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
