import pytest
import torch

from tpurec.embedding.constraints import csr_buffer_bytes, padded_rows
from tpurec.embedding.layout import build_stacks


def test_renamed_ids_land_on_natural_rows_under_mod_partitioning():
    # 2 tables of dim 8 stacked over P=4 partitions, C=24 rows per partition. The SparseCore puts id v
    # in partition v % 4 at local row v // 4, i.e. physical row (v % 4) * 24 + v // 4; renaming must
    # make that the natural stacked row s.
    (stack,) = build_stacks([("a", 37, 8), ("b", 5, 8)], num_partitions=4)
    assert [t.padded_rows for t in stack.tables] == [64, 32]  # multiples of P*8 = 32
    assert [t.offset for t in stack.tables] == [0, 64]
    assert stack.rows_per_partition == 24
    s = torch.arange(96)
    v = stack.sparsecore_ids(s)
    assert torch.equal((v % 4) * 24 + v // 4, s)
    assert torch.equal(torch.sort(v).values, s)  # a bijection of [0, 96)
    assert int(v[25]) == 1 * 4 + 1  # row 25: partition 1 (rows 24-47), local row 1


def test_preprocessed_renamed_ids_decode_to_natural_rows():
    """Through the real preprocessing (MOD semantics, checked against jax-tpu-embedding elsewhere) and
    the reference decode: the physical rows read are the natural stacked rows."""
    from tpurec.embedding.preprocess import preprocess
    from tpurec.embedding.reference import decode

    (stack,) = build_stacks([("a", 37, 8), ("b", 5, 8)], num_partitions=4)
    rows = torch.tensor([0, 36, 64, 68, 23, 24, 95 - 27, 5])
    samples = torch.arange(8)
    csr, _ = preprocess(stack.sparsecore_ids(rows), samples, torch.ones(8), device_batch_size=8, num_sc_per_device=4)
    d = decode(csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains, stack.rows_per_partition, 8, 4, 4)
    assert sorted(zip(d.samples.tolist(), d.rows.tolist())) == list(zip(samples.tolist(), rows.tolist()))


def test_tables_are_views_of_the_storage():
    (stack,) = build_stacks([("a", 37, 8), ("b", 5, 8)], num_partitions=2)
    phys = torch.zeros(stack.total_rows, 8)
    a = torch.randn(37, 8)
    b = torch.randn(5, 8)
    stack.write_table(phys, "a", a)
    stack.write_table(phys, "b", b)
    assert torch.equal(stack.read_table(phys, "a"), a) and torch.equal(stack.read_table(phys, "b"), b)
    assert int((phys.abs().sum(1) > 0).sum()) == 42  # padding rows stay zero
    view = stack.read_table(phys, "b")
    view.fill_(7.0)  # an in-place write into the view (as DCP's load does) reaches the storage
    assert torch.equal(phys[stack.table("b").offset : stack.table("b").offset + 5], torch.full((5, 8), 7.0))
    stack.write_table(phys, "b", view)  # writing a view back onto itself is a no-op
    assert torch.equal(stack.read_table(phys, "b"), torch.full((5, 8), 7.0))
    with pytest.raises(ValueError, match="expected shape"):
        stack.write_table(phys, "a", torch.zeros(36, 8))


def test_stacking_groups_by_dim_in_order():
    stacks = build_stacks([("a", 10, 8), ("b", 10, 16), ("c", 10, 8)], num_partitions=2)
    assert [[t.name for t in s.tables] for s in stacks] == [["a", "c"], ["b"]]
    unstacked = build_stacks([("a", 10, 8), ("b", 10, 16), ("c", 10, 8)], num_partitions=2, stack=False)
    assert [[t.name for t in s.tables] for s in unstacked] == [["a"], ["b"], ["c"]]


def test_any_dim_is_stored_8_wide_and_read_at_its_own_width():
    (stack,) = build_stacks([("x", 10, 12)], 2)
    assert (stack.dim, stack.storage_dim) == (12, 16)
    phys = torch.zeros(stack.total_rows, stack.storage_dim)
    value = torch.randn(10, 12)
    stack.write_table(phys, "x", value)
    view = stack.read_table(phys, "x")
    assert view.shape == (10, 12) and torch.equal(view, value) and view.data_ptr() == phys.data_ptr()
    assert torch.equal(phys[:, 12:], torch.zeros(stack.total_rows, 4))  # padding columns stay zero
    with pytest.raises(ValueError, match=r"expected shape \(10, 12\)"):
        stack.write_table(phys, "x", torch.zeros(10, 16))
    with pytest.raises(ValueError, match="embedding_dim must be positive"):
        build_stacks([("y", 10, 0)], 2)


def test_buffer_and_padding_arithmetic():
    assert padded_rows(1, 4) == 32 and padded_rows(32, 4) == 32 and padded_rows(33, 4) == 64
    # 4 SCs, 1 device, max 10 ids/partition: per SC 8 row pointers + 16*4 COO slots of 12 bytes
    assert csr_buffer_bytes(10, 4) == 4 * (4 * 8 + 12 * 16 * 4)


def test_a_byte_cap_cuts_a_group_into_consecutive_stacks():
    # dim 8 float32: 32 bytes a row; P=2 pads each table to a multiple of 16 rows
    tables = [("a", 10, 8), ("b", 20, 8), ("c", 5, 8), ("d", 40, 8), ("e", 3, 16)]
    stacks = build_stacks(tables, num_partitions=2, max_bytes=48 * 32)
    assert [s.name for s in stacks] == ["stack_d8", "stack_d8_p1", "stack_d8_p2", "stack_d16"]
    assert [[t.name for t in s.tables] for s in stacks] == [["a", "b"], ["c"], ["d"], ["e"]]
    # a, b: 16 + 32 rows = 48 (the cap exactly); c would make 64; d (48 rows) alone; offsets restart
    assert [[t.offset for t in s.tables] for s in stacks] == [[0, 16], [0], [0], [0]]
    assert all(s.total_rows * s.storage_dim * 4 <= 48 * 32 for s in stacks)
    # a table larger than the cap alone keeps a stack of its own rather than being refused
    (alone,) = build_stacks([("big", 100, 8)], num_partitions=2, max_bytes=32)
    assert alone.name == "stack_d8" and alone.total_rows == 112
    assert len(build_stacks(tables, num_partitions=2)) == 2  # no cap: one stack per dim
