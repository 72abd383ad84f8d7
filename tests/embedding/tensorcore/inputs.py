"""SparseCore inputs built by tpurec's own preprocessing, for comparing the JAX kernels with the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpurec.embedding.constraints import padded_rows, round_up
from tpurec.embedding.preprocess import SparseCoreInput, preprocess

MAX_BAG = 8  # ids per bag at most


@dataclass(frozen=True)
class Case:
    num_sc: int = 2
    devices: int = 1  # global_device_count: num_partitions = num_sc * devices
    features: int = 3
    batch: int = 10
    rows: int = 300
    pooling: str = "sum"  # sum / mean / sqrtn (through the gains), or weighted (random per-id weights)
    dtype: torch.dtype = torch.float32
    width: int = 16

    @property
    def partitions(self) -> int:
        return self.num_sc * self.devices

    @property
    def padded_batch(self) -> int:
        return self.batch + (-self.batch) % self.num_sc

    @property
    def device_batch_size(self) -> int:
        return self.features * self.padded_batch


def csr_input(case: Case, gen: torch.Generator) -> SparseCoreInput:
    """A stacked batch of ragged bags: empty bags, an id repeated inside a bag and across bags
    (hot ids 0..3 drawn 40% of the time), samples interleaved per SparseCore as the kernel lays them."""
    nf, batch = case.features, case.batch
    lengths = torch.randint(0, MAX_BAG + 1, (nf * batch,), generator=gen)
    lengths[::4] = 0  # empty bags
    seg = torch.repeat_interleave(torch.arange(nf * batch), lengths)
    per, k, b = case.padded_batch // case.num_sc, seg // batch, seg % batch
    samples = (b // per) * nf * per + k * per + b % per
    hot = torch.randint(0, 4, (samples.numel(),), generator=gen)
    cold = torch.randint(0, case.rows, hot.shape, generator=gen)
    ids = torch.where(torch.rand(samples.numel(), generator=gen) < 0.4, hot, cold)
    bag_len = lengths[seg].to(torch.float32)
    gains = {
        "sum": torch.ones(ids.numel()),
        "mean": 1.0 / bag_len,
        "sqrtn": bag_len.rsqrt(),
        "weighted": torch.rand(ids.numel(), generator=gen) + 0.5,
    }[case.pooling]
    csr, _ = preprocess(
        ids,
        samples,
        gains,
        device_batch_size=case.device_batch_size,
        num_sc_per_device=case.num_sc,
        global_device_count=case.devices,
        # room for every id of the largest batch in one partition: padded slots in every segment, no
        # dropping, and the same buffer sizes for every batch of a case (one compiled program)
        max_ids_per_partition=round_up(nf * batch * MAX_BAG + 1, 8),
    )
    return csr


def table(case: Case, gen: torch.Generator) -> torch.Tensor:
    """A table of the stack's physical rows (the vocabulary padded to the partitions)."""
    return torch.randn(padded_rows(case.rows, case.partitions), case.width, generator=gen).to(case.dtype)


def head(csr: SparseCoreInput) -> tuple[torch.Tensor, ...]:
    return (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)


def tail(csr: SparseCoreInput) -> tuple[int, ...]:
    return (
        csr.device_batch_size,
        csr.num_sc_per_device,
        csr.num_partitions,
        csr.max_ids_per_partition,
        csr.max_unique_ids_per_partition,
    )
