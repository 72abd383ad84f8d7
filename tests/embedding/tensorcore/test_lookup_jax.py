"""The JAX decode and lookup against the CPU reference, on inputs from tpurec's own preprocessing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jax")

from tpurec.embedding import ops  # noqa: E402
from tpurec.embedding import reference as R  # noqa: E402
from tpurec.embedding.tensorcore import csr_jax, torch_ops  # noqa: E402

from .compare import assert_close_f32  # noqa: E402
from .inputs import Case, csr_input, head, table, tail  # noqa: E402

CASES = [
    Case(num_sc=1, pooling="sum"),
    Case(num_sc=2, pooling="mean"),
    Case(num_sc=4, pooling="sqrtn"),
    Case(num_sc=4, pooling="weighted", batch=13),  # a batch padded to the SparseCores
    Case(num_sc=2, devices=2, pooling="weighted"),  # more partitions than local SparseCores
    Case(num_sc=1, devices=4, pooling="mean", rows=40),
    Case(num_sc=2, pooling="weighted", dtype=torch.bfloat16),
    Case(num_sc=4, pooling="mean", dtype=torch.bfloat16, batch=7),
    Case(num_sc=1, pooling="sum", dtype=torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_gives_the_reference_entries(case):
    gen = torch.Generator().manual_seed(3)
    csr = csr_input(case, gen)
    rows = table(case, gen).shape[0]
    want = R.decode(*head(csr), rows // case.partitions, case.device_batch_size, case.num_sc, case.partitions)
    got = csr_jax.decode(
        *(torch_ops.to_jax(t) for t in head(csr)),
        num_rows=rows,
        device_batch_size=case.device_batch_size,
        num_sc=case.num_sc,
        num_partitions=case.partitions,
    )
    valid = torch.from_dlpack(got.valid)
    assert torch.equal(torch.from_dlpack(got.rows)[valid].long(), want.rows)
    assert torch.equal(torch.from_dlpack(got.samples)[valid].long(), want.samples)
    assert torch.equal(torch.from_dlpack(got.gains)[valid], want.gains)
    # padding is out of range (dropped by every scatter) and weighs nothing
    assert bool((torch.from_dlpack(got.rows)[~valid] == rows).all())
    assert bool((torch.from_dlpack(got.samples)[~valid] == case.device_batch_size).all())
    assert bool((torch.from_dlpack(got.gains)[~valid] == 0).all())


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_lookup_equals_the_reference_op(case, seed):
    gen = torch.Generator().manual_seed(seed)
    csr = csr_input(case, gen)
    t = table(case, gen)
    assert bool(csr.gains.isnan().any()), "the input should have padded slots"
    want = ops.sparse_dense_matmul(*head(csr), t, *tail(csr))
    got = torch_ops.lookup(*head(csr), t, *tail(csr))
    assert got.shape == (case.device_batch_size, case.width) and got.dtype == torch.float32
    assert_close_f32(got, want)


def test_a_batch_of_empty_bags_looks_up_zeros():
    case = Case(num_sc=2)
    gen = torch.Generator().manual_seed(0)
    empty = torch.zeros(0, dtype=torch.int64)
    from tpurec.embedding.preprocess import preprocess

    csr, _ = preprocess(
        empty, empty, torch.zeros(0), device_batch_size=case.device_batch_size, num_sc_per_device=case.num_sc
    )
    t = table(case, gen)
    got = torch_ops.lookup(*head(csr), t, *tail(csr))
    assert torch.equal(got, ops.sparse_dense_matmul(*head(csr), t, *tail(csr)))
    assert torch.equal(got, torch.zeros(case.device_batch_size, case.width))
