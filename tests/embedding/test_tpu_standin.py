"""The TorchTPU stand-in (tpurec/emulation/torchtpu_ops.py) computes what tpurec's reference ops compute, with
TorchTPU's conventions: no SparseCore count in the call, new tensors returned, limits enforced."""

from __future__ import annotations

import pytest
import torch

import tpurec.embedding.ops  # noqa: F401  (torch.ops.tpurec.*)
from tpurec.embedding.preprocess import preprocess
from tpurec.emulation import torchtpu_ops as tpu_standin

B, ROWS, DIM, NUM_SC = 8, 64, 8, 2


@pytest.fixture
def case():
    st = tpu_standin.install(sparsecores=NUM_SC)
    g = torch.Generator().manual_seed(3)
    ids, samples = torch.randint(0, ROWS, (40,), generator=g), torch.randint(0, B, (40,), generator=g)
    csr, stats = preprocess(ids, samples, torch.rand(40, generator=g), device_batch_size=B, num_sc_per_device=NUM_SC)
    head = (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)
    limits = (stats.max_ids_per_partition, stats.max_unique_ids_per_partition)
    return st, head, limits, torch.randn(ROWS, DIM, generator=g), torch.randn(B, DIM, generator=g)


def test_lookup_equals_tpurec_op(case):
    st, head, limits, table, _ = case
    theirs = torch.ops.tpu._sparse_dense_matmul(*head, table, B, *limits)
    ours = torch.ops.tpurec.sparse_dense_matmul(*head, table, B, NUM_SC, NUM_SC, *limits)
    assert torch.equal(theirs, ours)
    assert len(st.compile_keys()) == 1


def test_updates_return_new_tensors_equal_to_tpurec_in_place_updates(case):
    _, head, limits, table, grad = case
    lr = torch.tensor(0.1)
    new = torch.ops.tpu._sparse_dense_matmul_grad_with_sgd(*head, table, grad, lr, B, *limits, "t")
    ours = table.clone()
    torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd(*head, ours, grad, 0.1, B, NUM_SC, NUM_SC, *limits)
    assert torch.equal(new, ours) and not torch.equal(new, table)  # the input table is left as it was
    acc = torch.full((ROWS,), 0.1)
    new, new_acc = torch.ops.tpu._sparse_dense_matmul_grad_with_adagrad(
        *head, table, acc, grad, lr, 1e-8, B, *limits, "t"
    )
    ours, ours_acc = table.clone(), acc.clone()
    torch.ops.tpurec.sparse_dense_matmul_grad_with_adagrad(
        *head, ours, ours_acc, grad, 0.1, 1e-8, B, NUM_SC, NUM_SC, *limits
    )
    assert torch.equal(new, ours) and torch.equal(new_acc, ours_acc) and torch.equal(acc, torch.full((ROWS,), 0.1))
    m, v = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    new, new_m, new_v = torch.ops.tpu._sparse_dense_matmul_grad_with_adam(
        *head, table, m, v, grad, lr, 0.9, 0.999, 1e-8, B, *limits, "t"
    )
    ours, om, ov = table.clone(), m.clone(), v.clone()
    torch.ops.tpurec.sparse_dense_matmul_grad_with_adam(
        *head, ours, om, ov, grad, 0.1, 0.9, 0.999, 1e-8, B, NUM_SC, NUM_SC, *limits
    )
    assert torch.equal(new, ours) and torch.equal(new_m, om) and torch.equal(new_v, ov)


def test_float_hyperparameters_and_limits_are_compile_keys_learning_rates_are_not(case):
    st, head, limits, table, grad = case
    for lr in (0.1, 0.2, 0.3):  # a tensor: one program
        torch.ops.tpu._sparse_dense_matmul_grad_with_sgd(*head, table, grad, torch.tensor(lr), B, *limits, "t")
    assert len(st.compile_keys()) == 1
    for eps in (1e-8, 2e-8):  # a float: one program each
        torch.ops.tpu._sparse_dense_matmul_grad_with_adagrad(
            *head, table, torch.zeros(ROWS), grad, torch.tensor(0.1), eps, B, *limits, "t"
        )
    assert len(st.compile_keys()) == 3


def test_a_partition_over_its_limit_is_an_error(case):
    _, head, limits, table, _ = case
    with pytest.raises(RuntimeError, match="more than max_ids_per_partition=1"):
        torch.ops.tpu._sparse_dense_matmul(*head, table, B, 1, limits[1])


def test_preprocess_with_a_zero_buffer_suggestion_drops_silently():
    tpu_standin.install(sparsecores=1)
    ids = torch.arange(200, dtype=torch.int32)
    offsets = torch.tensor([0, 100, 200], dtype=torch.int32)
    out = torch.ops.tpu.preprocess_sparse_dense_matmul_input(ids, offsets, 256, 256, 0, 2, "sum", 1, 1, 1, False, "t")
    assert int(out["dropped_id_count"].sum()) == 200 - tpu_standin.DEFAULT_COO_BUFFER
    out = torch.ops.tpu.preprocess_sparse_dense_matmul_input(ids, offsets, 256, 256, 256, 2, "sum", 1, 1, 1, False, "t")
    assert int(out["dropped_id_count"].sum()) == 0
