"""A 0-row table shard on the kernel: what the planner's row-wise shards of a table with fewer rows
than ranks leave (a 3-row table over 8 ranks). It receives no id; with measured id limits the stack's
bound divided by its 0 rows per partition (ZeroDivisionError on every rank of docs/id_limits.md's
recipe on v5p-16)."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.kernel import SparseCoreKernel
from tpurec.embedding.kernel_table import KernelTable
from tpurec.embedding.optimizers.sgd import SGDSpec

LIMITS = {"big": (16, 8), "empty": (8, 8)}


def _kernel(with_empty: bool, limits, stack: bool) -> SparseCoreKernel:
    torch.manual_seed(0)
    tables = [KernelTable("big/0", 40, 16, ("f1",), source="big")]
    if with_empty:
        tables.insert(0, KernelTable("empty/0", 0, 16, ("f0",), source="empty"))
    return SparseCoreKernel(tables, SGDSpec(lr=0.1), 2, id_limits=limits, stack_tables=stack)


@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize("limits", [LIMITS, {"big": (16, 8)}, None], ids=["measured", "big-only", "none"])
def test_a_zero_row_shard_trains_beside_a_table_as_if_it_were_not_there(limits, stack):
    kernel, alone = _kernel(True, limits, stack), _kernel(False, limits, stack)
    assert torch.equal(kernel.read_weight("big/0"), alone.read_weight("big/0"))
    assert tuple(kernel.read_weight("empty/0").shape) == (0, 16)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 40, (6,), generator=gen)
        lengths = torch.tensor([2, 1, 3, 0])  # 4 samples of f1 (f0 has none: its table has no row)
        both_lengths = torch.cat([torch.zeros(4, dtype=torch.long), lengths])
        both = kernel(KeyedJaggedTensor(keys=["f0", "f1"], values=ids, lengths=both_lengths))
        one = alone(KeyedJaggedTensor(keys=["f1"], values=ids, lengths=lengths))
        assert torch.equal(both[:, :16], torch.zeros(4, 16))  # f0's bags: empty
        assert torch.equal(both[:, 16:], one)
        (both[:, 16:] * torch.arange(16.0)).sum().backward()
        (one * torch.arange(16.0)).sum().backward()
        assert torch.equal(kernel.read_weight("big/0"), alone.read_weight("big/0"))
    if limits is not None and stack:
        # measured limits bound the stack; the 0-row shard adds nothing to the bound: `big` alone in
        # 2 partitions of 24 rows, sharing the stack's partitions of 24 rows (overlap 2): 2 x (16, 8)
        assert kernel.stack_limits(0) == (32, 16)
    if limits is not None and not stack:
        assert [kernel.stack_limits(i) for i in range(2)] == [(8, 8), (16, 8)]  # a 0-row stack: the least
