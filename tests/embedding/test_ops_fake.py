"""The custom ops' registrations (schema, fake/meta kernels) and tracing without real storage."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tpurec.embedding import ops  # noqa: F401
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.optimizers import adagrad, adam, sgd  # noqa: F401  (register the update ops)
from tpurec.embedding.preprocess import preprocess

from .helpers import make_tables, random_kjt


def small_input(num_sc=2, rows=40, dim=8, batch=8):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rows, (20,), generator=gen)
    samples = torch.randint(0, batch, (20,), generator=gen)
    csr, _ = preprocess(
        ids,
        samples,
        torch.rand(20, generator=gen),
        device_batch_size=batch,
        num_sc_per_device=num_sc,
        max_ids_per_partition=16,
    )
    table = torch.randn(rows, dim)
    return csr, table


def test_opcheck_lookup_and_updates():
    csr, table = small_input()
    head = [csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains]
    tail = [csr.device_batch_size, csr.num_sc_per_device, csr.num_partitions, 16, 16]
    grad = torch.randn(csr.device_batch_size, table.shape[1])
    torch.library.opcheck(torch.ops.tpurec.sparse_dense_matmul.default, (*head, table, *tail))
    torch.library.opcheck(
        torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd.default, (*head, table.clone(), grad, 0.1, *tail)
    )
    for acc in (torch.zeros(table.shape[0]), torch.zeros_like(table)):
        torch.library.opcheck(
            torch.ops.tpurec.sparse_dense_matmul_grad_with_adagrad.default,
            (*head, table.clone(), acc, grad, 0.1, 1e-8, *tail),
        )
    torch.library.opcheck(
        torch.ops.tpurec.sparse_dense_matmul_grad_with_adam.default,
        (*head, table.clone(), torch.zeros_like(table), torch.zeros_like(table), grad, 0.01, 0.9, 0.999, 1e-8, *tail),
    )


def test_lookup_under_fake_tensor_mode_has_the_right_shape():
    csr, table = small_input()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains, table)]
        out = torch.ops.tpurec.sparse_dense_matmul(
            *fake, csr.device_batch_size, csr.num_sc_per_device, csr.num_partitions, 16, 16
        )
        assert out.shape == (csr.device_batch_size, table.shape[1]) and out.dtype == torch.float32


@pytest.mark.parametrize("optim", [torch.optim.SGD, torch.optim.Adam])
def test_module_on_meta_device_traces_forward_and_backward(optim):
    tables = make_tables()
    sc = SparseCoreEmbeddingBagCollection(tables, optim, {"lr": 0.1}, num_sparsecores=4, device="meta")
    assert all(v.is_meta for v in sc.state_dict().values())
    assert sc.state_dict()["embedding_bags.t2.weight"].shape == (50, 16)
    kjt = random_kjt(tables, 6, torch.Generator().manual_seed(0))
    out = sc(kjt)  # host preprocessing on CPU, device lookups on meta
    assert out.values().is_meta and out.values().shape == (6, 8 + 8 + 16 + 8)
    out.values().sum().backward()  # fused updates run their meta kernels
