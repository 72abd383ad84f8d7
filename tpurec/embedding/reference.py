"""CPU reference of the SparseCore ops: the same inputs, layout and optimizer math.

The ops read the CSR-wrapped COO buffers exactly as a SparseCore does: for local SparseCore s,
`row_pointers[s]` gives the end of each partition's 8-aligned segment inside s's slice of the COO
buffers; an entry (local id c, sample j, gain g) in partition p's segment contributes
g * table[p * rows_per_partition + c] to output row s * (batch / num_sc) + j.

Backward-with-update sums each row's gradient over all its entries (all slices, all samples), then
applies the optimizer once per touched row; rows not in the batch are left alone (as on SparseCore
and in FBGEMM's fused kernels: Adam is "lazy"). `row_gradients` below is that shared first half; each
optimizer's update math (its `reference_update`) lives with its spec in `tpurec.embedding.optimizers`
(formulas in docs/kernels.md).

`lookup_csr` and `row_gradients_csr` are what the ops run: compiled loops (`csr_kernels.py`) take
the bags of torch's `embedding_bag` straight from the CSR, with no decode and no sort; the forward
can write the kernel's [batch, features * dim] output directly. `decode` / `lookup` /
`row_gradients` are the same semantics in plain torch over decoded (row, sample, gain) entries,
with the same sums bit for bit: the tests' independent reading of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tpurec.embedding.constraints import PADDING_ID

if TYPE_CHECKING:
    import numpy as np


@dataclass
class DecodedInput:
    """The valid entries of a SparseCore input, as physical table rows and device-batch samples."""

    rows: torch.Tensor  # int64 physical row per entry
    samples: torch.Tensor  # int64 sample in the device batch per entry
    gains: torch.Tensor  # float32


def decode(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    rows_per_partition: int,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
) -> DecodedInput:
    num_sc, parts = num_sc_per_device, num_partitions
    slots = embedding_ids.numel() // num_sc
    per_sc = device_batch_size // num_sc
    pos = (embedding_ids != PADDING_ID).nonzero().squeeze(1)
    sc = pos // slots
    # Segment ends of every SparseCore, shifted into one increasing sequence over the whole buffer:
    # the number of ends <= pos is then (SparseCore, partition) of the entry at pos.
    ends = row_pointers.view(num_sc, -1)[:, :parts].to(torch.int64)
    ends = (ends + torch.arange(num_sc, device=ends.device).unsqueeze(1) * slots).reshape(-1)
    seg = torch.searchsorted(ends, pos, right=True)
    part = seg - sc * parts
    rows = part * rows_per_partition + embedding_ids[pos].to(torch.int64)
    samples = sc * per_sc + sample_ids[pos].to(torch.int64)
    return DecodedInput(rows, samples, gains[pos])


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def lookup(d: DecodedInput, table: torch.Tensor, device_batch_size: int) -> torch.Tensor:
    """Pooled activations [device_batch_size, dim], f32.

    Entries arrive ordered by (SparseCore, row); one stable sort by sample turns them into bags, and
    torch's fused embedding_bag gathers, scales and sums without materialising [entries, dim].
    A FP16/BF16 table is read into float32 first (the touched rows only) and summed with float32
    gains, as FBGEMM's CPU TBE accumulates FP16 weights into a float32 output.
    """
    order = torch.sort(d.samples, stable=True).indices
    offsets = _offsets(torch.bincount(d.samples, minlength=device_batch_size))
    rows = d.rows.index_select(0, order)
    if table.dtype != torch.float32:
        table, rows = table.index_select(0, rows).to(torch.float32), torch.arange(rows.numel(), device=rows.device)
    return torch.nn.functional.embedding_bag(
        rows,
        table,
        offsets,
        mode="sum",
        per_sample_weights=d.gains.index_select(0, order).to(torch.float32),
        include_last_offset=True,
    )


def row_gradients(d: DecodedInput, activations_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique physical rows, summed gradient per row) — never a dense gradient of the table.

    Sorted by row, the entries are bags over the activation gradient (the transpose of the forward),
    so one embedding_bag sums every row's gradient without materialising [entries, dim].
    """
    rows_sorted, order = torch.sort(d.rows, stable=True)
    rows, counts = torch.unique_consecutive(rows_sorted, return_counts=True)
    grad = torch.nn.functional.embedding_bag(
        d.samples.index_select(0, order),
        activations_grad.to(torch.float32),
        _offsets(counts),
        mode="sum",
        per_sample_weights=d.gains.index_select(0, order),
        include_last_offset=True,
    )
    return rows, grad


def _numpy(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    return tuple(t.detach().contiguous().numpy() for t in tensors)


def _pool(rows: np.ndarray, table: torch.Tensor, offsets: np.ndarray, weights: np.ndarray) -> torch.Tensor:
    """Sum of weight * table[row] per bag, float32 (FP16/BF16 tables: their touched rows read into float32)."""
    rows_t, offsets_t = torch.from_numpy(rows), torch.from_numpy(offsets)
    if table.dtype != torch.float32:
        table, rows_t = table.index_select(0, rows_t).to(torch.float32), torch.arange(rows_t.numel())
    return torch.nn.functional.embedding_bag(
        rows_t, table, offsets_t, mode="sum", per_sample_weights=torch.from_numpy(weights), include_last_offset=True
    )


@torch.no_grad()
def lookup_csr(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    table: torch.Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    batch_major: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Pooled activations (float32), bags read straight from the CSR.

    Default: [device_batch_size, width], the op's result. batch_major=(features, batch, dim): the
    device batch is the kernel's stacked batch of `features` features, interleaved per SparseCore
    (`kernel_input.stacked_samples`), and the result is [batch, features * dim], feature k's sample j in
    row j, columns k*dim.. (the kernel's output; samples past `batch` are padding and hold no ids).
    """
    from tpurec.embedding import csr_kernels

    nk, nj, dim = batch_major if batch_major is not None else (1, device_batch_size, table.shape[1])
    rp, emb, smp, gns = _numpy(row_pointers, embedding_ids, sample_ids, gains)
    rows, weights, offsets = csr_kernels.bag_order(
        rp,
        emb,
        smp,
        gns,
        table.shape[0] // num_partitions,
        table.shape[0],
        num_sc_per_device,
        num_partitions,
        device_batch_size // nk,
        nk,
        nj,
        batch_major is not None,
    )
    out = _pool(rows, table, offsets, weights)  # [nj * nk, width]
    if batch_major is None:
        return out
    if dim == table.shape[1]:
        return out.view(nj, nk * dim)
    return out.view(nj, nk, -1)[:, :, :dim].reshape(nj, nk * dim)  # storage padding columns cut


def batch_major_grad(grad: torch.Tensor, features: int) -> torch.Tensor:
    """The kernel's [batch, features * dim] output gradient as the [features, batch, dim] view
    `row_gradients_csr` (and so the update ops on CPU) accept in place of [device_batch_size, width]."""
    batch = grad.shape[0]
    # the width from the shape, not -1: an empty batch (0 samples) has no elements to infer it from
    return grad.reshape(batch, features, grad.shape[1] // max(features, 1)).transpose(0, 1)


@torch.no_grad()
def row_gradients_csr(
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    table: torch.Tensor,
    activations_grad: torch.Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique physical rows in increasing order, summed float32 gradient per row, [rows, width]),
    bags read straight from the CSR. activations_grad: [device_batch_size, width], or
    `batch_major_grad`'s [features, batch, dim] view (columns past dim count as zero)."""
    from tpurec.embedding import csr_kernels

    rp, emb, smp, gns = _numpy(row_pointers, embedding_ids, sample_ids, gains)
    parts, num_sc, width = num_partitions, num_sc_per_device, table.shape[1]
    rows, offsets, order = csr_kernels.row_runs(rp, emb, table.shape[0] // parts, num_sc, parts)
    grad = activations_grad.to(torch.float32)
    if grad.dim() == 3:  # batch-major memory: row j * features + k of a [batch * features, dim] table
        nk, nj, dim = grad.shape
        grad_table = grad.transpose(0, 1).reshape(nj * nk, dim)
    else:
        nk, nj, dim = 1, device_batch_size, grad.shape[1]
        grad_table = grad.contiguous()
    idx, weights = csr_kernels.entry_bags(
        order, smp, gns, num_sc, emb.size // num_sc, device_batch_size // nk, nk, nj, grad.dim() == 3
    )
    out = _pool(idx, grad_table, offsets, weights)
    if dim < width:  # a table stored wider than its dim: the padding columns get zero gradients
        out = torch.nn.functional.pad(out, (0, width - dim))
    return torch.from_numpy(rows), out
