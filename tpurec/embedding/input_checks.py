"""Inputs of the SparseCore kernel's Python API outside their domain, refused with one line.

`preprocess()` / `preprocess_tables()` take a batch's ids, the sample of the device batch each id
belongs to and its gain; the ops (`torch.ops.tpurec.*`, registered in ops.py and by the optimizers)
take the CSR buffers preprocessing made. Out of their domain these were not refused: a sample index
outside the batch was wrapped into another sample's row (negative) or clamped onto the last one,
float ids were truncated, the op dropped an entry of sample 1000 without a word, and a zero batch or
SparseCore count ended in IndexError or ZeroDivisionError.

Every check is a reduction over data read anyway (numpy min/max) or, for the op's sample ids, one
compiled pass (`csr_kernels.first_bad_sample`), so the hot path pays a few percent of preprocessing
at most (measured: docs/kernels_preprocess.md). Each message names the argument, the value and the
valid range.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from tpurec.errors import UserError


def whole(name: str, value: object, lo: int = 1) -> None:
    """A count: a whole number >= lo (a bool or a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise UserError(f"{name}={value!r} must be a whole number >= {lo}")


def _integer(where: str, name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{where}: {name} must be an integer tensor, got {t.dtype} (cast it with .long())")


def _within(where: str, name: str, t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Every value of `t` in [lo, hi) (`what` spells hi), else a UserError showing the values' range."""
    if t.numel():
        least, most = (int(x) for x in torch.aminmax(t))
        if least < lo or most >= hi:
            raise UserError(f"{where}: {name} must be in [{lo}, {what}), got {least}..{most}")


def check_batch(
    table: str, ids: torch.Tensor, sample_index: torch.Tensor, gains: torch.Tensor, device_batch_size: int
) -> None:
    """One table's (ids, sample_index, gains) of a device batch: integer ids and samples, one of each
    per id. Their values are `check_ranges`' (on the arrays preprocessing makes anyway)."""
    where = f"table {table!r}"
    _integer(where, "ids", ids)
    _integer(where, "sample_index", sample_index)
    if not ids.numel() == sample_index.numel() == gains.numel():
        raise UserError(
            f"{where}: ids, sample_index and gains must have one entry per id, got "
            f"{ids.numel()}, {sample_index.numel()} and {gains.numel()}"
        )


def check_ranges(
    names: list[str], lengths: list[int], ids: np.ndarray, samples: np.ndarray, device_batch_size: int
) -> None:
    """Ids in [0, 2^31) (int32 on the SparseCore) and sample indices in [0, device_batch_size), over
    the tables' ids and samples concatenated (`lengths` each): two numpy max() over data the next
    steps read anyway (as unsigned, a negative value is above any valid one, so one max checks both
    ends; numpy's reductions on int64 are several times faster than torch's here). The table at
    fault is looked for only on failure."""
    if not ids.size:
        return
    if ids.view(np.uint64).max() < 2**31 and samples.view(np.uint64).max() < device_batch_size:
        return
    start = 0
    for name, n in zip(names, lengths):
        part = slice(start, start + n)
        start += n
        for what, a, hi, spelled in (
            ("ids", ids[part], 2**31, "2^31) (int32 on the SparseCore"),
            ("sample_index", samples[part], device_batch_size, f"device_batch_size={device_batch_size}"),
        ):
            if a.size and (a.min() < 0 or a.max() >= hi):
                raise UserError(f"table {name!r}: {what} must be in [0, {spelled}), got {a.min()}..{a.max()}")


def check_csr(
    op: str,
    row_pointers: torch.Tensor,
    embedding_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    gains: torch.Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
) -> None:
    """A SparseCore input as an op receives it: the buffers' shapes agree with the counts, every row
    pointer lies inside its SparseCore's slots (the compiled loops read there unchecked), and every
    entry's sample is in [0, device_batch_size / num_sc_per_device), its SparseCore's slice."""
    for name, t in (("row_pointers", row_pointers), ("embedding_ids", embedding_ids), ("sample_ids", sample_ids)):
        if t.dtype != torch.int32:  # TorchTPU's op schemas; the compiled loops read them as int32
            raise TypeError(f"{op}: {name} must be an int32 tensor (the SparseCore's buffers), got {t.dtype}")
    whole(f"{op}: num_sc_per_device", num_sc_per_device)
    whole(f"{op}: num_partitions", num_partitions)
    whole(f"{op}: device_batch_size", device_batch_size)
    if device_batch_size % num_sc_per_device:
        raise UserError(
            f"{op}: device_batch_size={device_batch_size} is not a multiple of num_sc_per_device={num_sc_per_device}"
        )
    n = embedding_ids.numel()
    if n % num_sc_per_device or sample_ids.numel() != n or gains.numel() != n:
        raise UserError(
            f"{op}: embedding_ids, sample_ids and gains must have the same size, a multiple of "
            f"num_sc_per_device={num_sc_per_device}; got {n}, {sample_ids.numel()} and {gains.numel()}"
        )
    width = row_pointers.numel() // num_sc_per_device
    if row_pointers.numel() % num_sc_per_device or width < num_partitions:
        raise UserError(
            f"{op}: row_pointers has {row_pointers.numel()} entries; it needs num_sc_per_device={num_sc_per_device} "
            f"x at least num_partitions={num_partitions}"
        )
    slots = n // num_sc_per_device
    _within(op, "row_pointers", row_pointers, 0, slots + 1, f"{slots}] (the COO slots per SparseCore")
    per_sc = device_batch_size // num_sc_per_device
    from tpurec.embedding import csr_kernels

    emb, smp = embedding_ids.detach().contiguous().numpy(), sample_ids.detach().contiguous().numpy()
    bad = csr_kernels.first_bad_sample(emb, smp, per_sc)
    if bad >= 0:
        raise UserError(
            f"{op}: sample_ids[{bad}]={int(smp[bad])} is outside [0, {per_sc}) (device_batch_size={device_batch_size} "
            f"/ num_sc_per_device={num_sc_per_device} samples per SparseCore)"
        )


def check_distinct_ids(
    embedding_ids: torch.Tensor,
    row_pointers: torch.Tensor,
    num_sc_per_device: int,
    num_partitions: int,
    max_unique_ids_per_partition: int,
) -> None:
    """No (SparseCore, partition) segment holds more distinct ids than `max_unique_ids_per_partition`:
    the TensorCore update sizes the rows it touches by that limit (update_jax.distinct_rows_bound), so
    an input over it would lose rows' updates. Checked where the JAX programs run on CPU (torch_ops.py),
    so every path that builds an update's input is held to its limit by the tests; one sort of the slots."""
    from tpurec.embedding.constraints import PADDING_ID

    emb = embedding_ids.detach().contiguous().numpy().astype(np.int64).reshape(num_sc_per_device, -1)
    ends = row_pointers.detach().contiguous().numpy().astype(np.int64).reshape(num_sc_per_device, -1)
    slots = emb.shape[1]
    part = np.stack(
        [np.searchsorted(ends[s, :num_partitions], np.arange(slots), side="right") for s in range(len(emb))]
    )
    segment = np.arange(num_sc_per_device)[:, None] * num_partitions + part
    valid = (emb != PADDING_ID) & (emb >= 0) & (part < num_partitions)
    keys = np.unique(segment[valid] * 2**32 + emb[valid])
    counts = np.bincount(keys >> 32, minlength=num_sc_per_device * num_partitions)
    if counts.size and counts.max() > max_unique_ids_per_partition:
        sc, p = divmod(int(counts.argmax()), num_partitions)
        raise UserError(
            f"update: SparseCore {sc}, partition {p} holds {int(counts.max())} distinct ids > "
            f"max_unique_ids_per_partition={max_unique_ids_per_partition} (the limits the input was built with)"
        )
