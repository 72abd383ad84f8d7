"""SequenceInputs: a sequence lookup's host half, and `slots`, where each id sits in its one-id bags.

Data only, in a leaf module: the kernel protocol (kernel_protocol.py) and the sharded sequence
lookups (tpurec/sharding/kernel_module.py) name these types without importing the SparseCore
sequence kernel (sequence_kernel.py, which says how the one-id bags are laid out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SequenceInputs:
    """A sequence lookup's host half (`SparseCoreSequenceKernel.preprocess_sequence`): the kernel's
    SparseCore inputs of the one-id bags and what places each id's row in the output."""

    inputs: Any  # the kernel's per-stack inputs (`SparseCoreKernel.preprocess` / `preprocess_blocks`)
    counts: torch.Tensor  # ids per feature (host)
    capacity: int  # C: bags per feature and block
    blocks: int  # 1 unless a feature is over C

    def rows(self) -> int:
        """Rows of the lookup's [rows, dim] output: blocks x capacity x features."""
        return self.blocks * self.capacity * self.counts.numel()

    sparsecores: int = 1  # P: the SparseCores the capacity's samples are dealt to (`slots`)

    def id_rows(self) -> torch.Tensor:
        """Per id in the KJT's values order, its row in the lookup's [rows, dim] output (host): feature k's
        j-th id, in block q = j div C, is row (q x C + slot) x features + k, slot its sample in the block
        (`slots`)."""
        counts, n = self.counts, self.counts.numel()
        if not n:
            return torch.zeros(0, dtype=torch.long)
        j = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        k = torch.repeat_interleave(torch.arange(n), counts)
        cap = self.capacity
        return ((j // cap) * cap + slots(j % cap, cap, self.sparsecores)) * n + k


def slots(j: torch.Tensor, capacity: int, sparsecores: int) -> torch.Tensor:
    """The sample of a feature's j-th id (j < capacity) in a batch of `capacity` one-id bags: the ids
    dealt round the SparseCores, each of which holds a contiguous capacity / sparsecores of the samples
    (the capacity a multiple of `sparsecores`): id j on SparseCore j mod P, as its (j div P)-th sample."""
    per_sc = capacity // sparsecores
    return (j % sparsecores) * per_sc + j // sparsecores
