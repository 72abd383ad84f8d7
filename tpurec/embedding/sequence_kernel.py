"""Unpooled (sequence) lookups on the SparseCore kernel: every id its own bag of one, gain 1.

An EmbeddingCollection returns one embedding per id, not one per bag. The SparseCore op only
pools, so unpooled lookups are expressed with it the way torchrec's TPU path
(`experimental/torch_tpu/datasets/input_preprocessing.py`, unpooled mode: offsets 0, 1, ..., N, N,
..., N) and jax-tpu-embedding's sequence features do: feature k's N_k ids become samples 0..N_k-1
of a batch of C samples (C >= every N_k; samples no id names are empty bags and look up zeros), so
each pooled output row of feature k IS the embedding of one of its ids. Which sample: the SparseCore
op gives each of its P SparseCores a contiguous C / P of the samples, so the j-th id takes sample
(j mod P) x C / P + j div P (`slots`), dealing a feature's ids round the SparseCores; torchrec's TPU
path and jax-tpu-embedding put it at sample j, which fills the first SparseCores' samples and leaves
the last ones idle until a batch reaches the capacity (a batch of N ids: ceil(N / P) on every
SparseCore here, min(N, C / P) on the first one there). Preprocessing, id limits,
the CSR layout, the TorchTPU adapter and the fused update are the pooled kernel's, unchanged:
backward hands each id's output gradient to its row, and rows hit twice sum their gradients, as
a dense `nn.Embedding` does.

C follows each batch on CPU (the largest feature, rounded up to the SparseCore count). On a TPU
every buffer shape must stay fixed (a new shape recompiles), so C is fixed like the id limits:
`max_ids_per_feature` when given (or measured by `tpurec data stats`), else twice the first batch's
largest feature, 8-aligned. A later batch over it is neither refused nor cut: its features' ids are
cut into blocks of C (ids 0..C-1 of every feature, then C..2C-1, ...), each block an ordinary
fixed-shape lookup whose output rows follow the previous block's, and the step's fused update is
one over all blocks, every row once with its whole gradient (SparseCoreKernel.preprocess_blocks,
multipass.stacked_blocks): the same outputs and tables as one lookup of capacity >= the batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.constraints import SEGMENT_ALIGN, round_up
from tpurec.embedding.kernel import SparseCoreKernel
from tpurec.embedding.kjt_checks import check_kjt
from tpurec.embedding.sequence_inputs import SequenceInputs, slots
from tpurec.embedding.settings import TableLimits
from tpurec.errors import UserError
from tpurec.runtime import host_copies

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# SequenceInputs and slots live in sequence_inputs.py (a leaf: the kernel protocol and the sharded
# lookups name them without importing this kernel); kept importable from here.
__all__ = ["SequenceInputs", "SparseCoreSequenceKernel", "slots"]


class SparseCoreSequenceKernel(SparseCoreKernel):
    """A SparseCoreKernel whose forward returns one embedding per id: [total ids, dim].

    The KeyedJaggedTensor's keys are the kernel's features in order (positional); the output rows
    follow its values (feature-major, as `KeyedJaggedTensor.values()`). Every table has the same
    dim, as in TorchRec's EmbeddingCollection and its sequence lookups.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """SparseCoreKernel's arguments; the capacity is KernelSettings.max_ids_per_feature (or that
        keyword)."""
        kwargs["positional"] = True
        kwargs["is_weighted"] = False  # EmbeddingCollection ignores weights (torchrec's does too)
        super().__init__(*args, **kwargs)
        dims = {t.embedding_dim for t in self.tables}
        if len(dims) > 1:
            raise UserError(
                f"sequence tables must share one embedding dim (as in TorchRec's EmbeddingCollection); "
                f"got {sorted(dims)} for {[t.name for t in self.tables]}"
            )
        if any(t.pooling is not PoolingType.SUM for t in self.tables):
            raise UserError("sequence tables are not pooled; build their KernelTables with pooling 'sum'")
        self.dim = dims.pop() if dims else 0
        # the demand of the batch as given (ids per sample and per feature, as `tpurec data stats` counts
        # a sequence table), not of the one-id bags it becomes (`preprocess_sequence`)
        self.inputs.demand_counted_by_kernel = True
        max_ids_per_feature = self.settings.max_ids_per_feature
        if max_ids_per_feature is None:
            max_ids_per_feature = self._measured_capacity(self.settings.id_limits)
        self.max_ids_per_feature = max_ids_per_feature
        self._capacity: int | None = None if max_ids_per_feature is None else self._aligned(max_ids_per_feature)
        if self.settings.id_limits and self.settings.max_ids_per_partition is None and self._capacity is not None:
            self._limits_of_the_capacity(self._capacity)

    def _limits_of_the_capacity(self, capacity: int) -> None:
        """Fixed id limits for measured tables: what a SparseCore slice of these one-id bags can hold.

        `tpurec data stats` measures a table's ids per partition as a pooled kernel lays them out (each
        SparseCore slice the ids of its share of the samples), and those figures (`stack_bound`) do not
        bound this layout: a slice's C / P bags hold up to C / P of each feature's ids whatever the
        batch size (`slots`; measured, when the ids filled the bags from the front: every batch of an EC
        of 8-id histories over 2048 ids ran in passes). A slice holds at most C / P ids per feature of the
        stack, and no more distinct ids in a partition than the partition's rows: limits no batch
        within the capacity exceeds (a batch over it runs in blocks of the same limits)."""
        per_slice = -(-capacity // self.num_sc)
        for i, plan in enumerate(self.stacks):
            ids = round_up(max(len(plan.features), 1) * per_slice, SEGMENT_ALIGN)
            uniq = min(ids, round_up(max(plan.layout.rows_per_partition, 1), SEGMENT_ALIGN))
            self.inputs._stack_limits[i] = (ids, uniq)

    def _measured_capacity(self, id_limits: Mapping[str, TableLimits] | None) -> int | None:
        """The largest measured ids per feature of this kernel's tables (`tpurec data stats`,
        `TableLimits.max_ids_per_feature`), when every table has one; None otherwise."""
        if not id_limits:
            return None
        found = [id_limits.get(t.source or t.name) for t in self.tables]
        capacities = [f.max_ids_per_feature for f in found if f is not None and f.max_ids_per_feature is not None]
        if not found or len(capacities) < len(found):
            return None
        return max(capacities)

    def _aligned(self, n: int) -> int:
        # a multiple of the SparseCores (`slots` deals the ids round them), and 8-aligned when fixed
        return round_up(max(n, 1), math.lcm(SEGMENT_ALIGN, self.num_sc) if self.fixed_limits else self.num_sc)

    def capacity(self, ids_per_feature: torch.Tensor) -> int:
        """C: samples per feature in the SparseCore batch for these per-feature id counts (a batch
        whose largest feature is over a fixed C runs in blocks of C)."""
        largest = int(ids_per_feature.max()) if ids_per_feature.numel() else 0
        if not self.fixed_limits:
            return self._aligned(largest) if self._capacity is None else max(self._capacity, self._aligned(largest))
        if self._capacity is None:
            self._capacity = self._aligned(2 * largest)
        return self._capacity

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """features: KeyedJaggedTensor with the kernel's features as keys, in order.
        Returns [total ids, dim] float32, rows in the order of `features.values()` (TorchRec's sequence
        lookup output, as the sharded EmbeddingCollection needs it)."""
        pieces = self.forward_per_feature(features)
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.zeros(0, self.dim)

    def forward_per_feature(self, features: KeyedJaggedTensor) -> list[torch.Tensor]:
        """Feature k's rows [N_k, dim], from the lookup's fixed [blocks x capacity, features * dim]
        output: its samples put back in id order (`slots` undone: one transpose of a fixed shape), so
        its rows are a prefix and no gather is needed. On a TPU the lookup's shape is fixed by the
        capacity, and slicing a prefix compiles nothing, where a gather of the batch's id count was a
        new program for every count (torchrec's TPU EmbeddingCollection slices too, `feat_emb[:actual_num_ids]`)."""
        inputs = self.preprocess_sequence(features)
        pooled = self.lookup(inputs.inputs, inputs.capacity)
        counts, n, p, cap = inputs.counts, inputs.counts.numel(), inputs.sparsecores, inputs.capacity
        # [blocks, P, cap / P, n, dim]: sample (a, i) of a block holds id i x P + a
        dealt = pooled.view(inputs.blocks, p, cap // p, n, self.dim)
        per_feature = dealt.permute(3, 0, 2, 1, 4).reshape(n, inputs.blocks * cap, self.dim)  # id order
        return [per_feature[k, : int(c)] for k, c in enumerate(counts.tolist())]

    def forward_padded(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The lookup's whole output, [rows, dim] (rows = capacity x features: a fixed shape on a
        TPU while no feature is over the capacity), and on the host, per id in `features.values()`
        order, its row there (`SequenceInputs.id_rows`). Rows no id names are
        zeros (empty bags). The sharded EmbeddingCollection gathers from it with host-computed
        indices, so that no device tensor takes the batch's id count as its shape."""
        inputs = self.preprocess_sequence(features)
        return self.lookup_sequence(inputs), inputs.id_rows()

    def preprocess_sequence(self, features: KeyedJaggedTensor) -> SequenceInputs:
        """`forward_padded`'s host half (data-dependent, eager ahead of a compiled step)."""
        features = host_copies.to_host(features, "ids")  # host preprocessing (see SparseCoreKernel.preprocess)
        check_kjt(features)
        keys = features.keys()
        if len(keys) != len(self.feature_order):  # positional: key k feeds the k-th feature slot
            raise KeyError(f"expected {len(self.feature_order)} features in table order, got keys {keys}")
        self.inputs.record_demand(features)
        n = len(keys)
        batch = features.stride()
        counts = features.lengths().view(n, batch).sum(1) if n and batch else torch.zeros(n, dtype=torch.long)
        cap = self.capacity(counts)
        largest = int(counts.max()) if n else 0
        blocks = max(1, -(-largest // cap))
        values = features.values()
        p = self.num_sc
        if blocks == 1:
            inputs = self.preprocess(self._one_id_bags(keys, values, counts, cap, p))
        else:
            # over the capacity: ids q*C .. (q+1)*C - 1 of every feature form block q
            position = torch.arange(values.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            block_of = position // cap
            chunks = [
                self._one_id_bags(keys, values[block_of == q], (counts - q * cap).clamp(0, cap), cap, p)
                for q in range(blocks)
            ]
            inputs = self.preprocess_blocks(chunks)
        return SequenceInputs(inputs, counts, cap, blocks, p)

    def lookup_sequence(self, inputs: SequenceInputs) -> torch.Tensor:
        """`forward_padded`'s device half: [blocks x capacity x features, dim] (traceable by torch.compile
        when the inputs are one block within fixed id limits)."""
        pooled = self.lookup(inputs.inputs, inputs.capacity)  # [blocks x cap, n * dim]
        return pooled.reshape(inputs.rows(), self.dim)

    @staticmethod
    def _one_id_bags(
        keys: list[str], values: torch.Tensor, counts: torch.Tensor, cap: int, sparsecores: int
    ) -> KeyedJaggedTensor:
        """Feature k's counts[k] ids as bags of one id in a batch of `cap`, id j at sample `slots(j)`
        (the others empty); `values` feature-major, each feature's ids in order."""
        id_of_sample = torch.arange(cap).view(cap // sparsecores, sparsecores).t().reshape(-1)  # slots undone
        used = id_of_sample.unsqueeze(0) < counts.unsqueeze(1)  # [features, cap]
        # each feature's ids in sample order: feature k's first id plus the id's index, per used sample
        first = torch.cumsum(counts, 0) - counts
        order = (first.unsqueeze(1) + id_of_sample.unsqueeze(0))[used]
        return KeyedJaggedTensor(
            keys=keys,
            values=values[order] if order.numel() else values,
            lengths=used.to(torch.int32).reshape(-1),
            stride=cap,
        )
