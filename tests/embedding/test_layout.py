import pytest
import torch

from tpurec.embedding.constraints import check_dim, csr_buffer_bytes, padded_rows
from tpurec.embedding.layout import build_stacks


def test_mod_layout_matches_definition():
    # 2 tables of dim 8 stacked over P=4 partitions: natural stacked id r -> partition r % 4, row r // 4.
    (stack,) = build_stacks([("a", 37, 8), ("b", 5, 8)], num_partitions=4)
    assert [t.padded_rows for t in stack.tables] == [64, 32]  # multiples of P*8 = 32
    assert [t.offset for t in stack.tables] == [0, 64]
    assert stack.rows_per_partition == 24
    natural = torch.arange(96 * 8, dtype=torch.float32).view(96, 8)
    phys = stack.to_physical(natural)
    for r in (0, 1, 5, 37, 64, 95):
        assert torch.equal(phys[(r % 4) * 24 + r // 4], natural[r])
        assert int(stack.physical_rows(torch.tensor([r]))) == (r % 4) * 24 + r // 4
    assert torch.equal(stack.to_natural(phys), natural)
    # 1-D (row-wise optimizer state) round-trips too
    v = torch.arange(96.0)
    assert torch.equal(stack.to_natural(stack.to_physical(v)), v)


def test_read_write_table_roundtrip_keeps_other_tables():
    (stack,) = build_stacks([("a", 37, 8), ("b", 5, 8)], num_partitions=2)
    phys = torch.zeros(stack.total_rows, 8)
    a = torch.randn(37, 8)
    b = torch.randn(5, 8)
    stack.write_table(phys, "a", a)
    stack.write_table(phys, "b", b)
    assert torch.equal(stack.read_table(phys, "a"), a) and torch.equal(stack.read_table(phys, "b"), b)
    assert int((phys.abs().sum(1) > 0).sum()) == 42  # padding rows stay zero
    with pytest.raises(ValueError, match="expected shape"):
        stack.write_table(phys, "a", torch.zeros(36, 8))


def test_stacking_groups_by_dim_in_order():
    stacks = build_stacks([("a", 10, 8), ("b", 10, 16), ("c", 10, 8)], num_partitions=2)
    assert [[t.name for t in s.tables] for s in stacks] == [["a", "c"], ["b"]]
    unstacked = build_stacks([("a", 10, 8), ("b", 10, 16), ("c", 10, 8)], num_partitions=2, stack=False)
    assert [[t.name for t in s.tables] for s in unstacked] == [["a"], ["b"], ["c"]]


def test_dim_must_be_multiple_of_8_with_clear_error():
    with pytest.raises(ValueError, match=r"table 'x': embedding_dim=12 .* multiple of 8.*use 16"):
        check_dim("x", 12)
    with pytest.raises(ValueError, match="embedding_dim=12"):
        build_stacks([("x", 10, 12)], 2)


def test_buffer_and_padding_arithmetic():
    assert padded_rows(1, 4) == 32 and padded_rows(32, 4) == 32 and padded_rows(33, 4) == 64
    # 4 SCs, 1 device, max 10 ids/partition: per SC 8 row pointers + 16*4 COO slots of 12 bytes
    assert csr_buffer_bytes(10, 4) == 4 * (4 * 8 + 12 * 16 * 4)
