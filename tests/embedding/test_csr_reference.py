"""The CSR-reading reference (`lookup_csr`, `row_gradients_csr`, numba loops) against the same
semantics in plain torch over decoded entries (`decode`, `lookup`, `row_gradients`): bit for bit, in
the op's layout and in the kernel's batch-major one, on inputs with ragged bags, repeated ids,
weights, padded batches, id dropping and low-precision tables."""

import pytest
import torch

from tpurec.embedding import reference as R
from tpurec.embedding.optimizers.base import add_to_rows
from tpurec.embedding.preprocess import preprocess

CASES = [
    # rows, features, batch, SparseCores, weighted, table dtype, max ids per partition (dropping)
    (1000, 3, 30, 4, True, torch.float32, None),
    (37, 2, 16, 2, False, torch.float32, None),
    (64, 2, 10, 1, True, torch.float16, None),
    (500, 4, 13, 4, True, torch.bfloat16, None),
    (200, 3, 21, 2, True, torch.float32, 8),
]


def _input(rows, features, batch, num_sc, weighted, max_ids, seed):
    g = torch.Generator().manual_seed(seed)
    padded = batch + (-batch) % num_sc
    lengths = torch.randint(0, 12, (features * batch,), generator=g)
    seg = torch.repeat_interleave(torch.arange(features * batch), lengths)
    # the kernel's stacked batch: SparseCore c holds samples c*per..(c+1)*per-1 of every feature
    per, k, b = padded // num_sc, seg // batch, seg % batch
    samples = (b // per) * features * per + k * per + b % per
    hot = torch.randint(0, 4, (samples.numel(),), generator=g)  # repeats inside and across bags
    ids = torch.where(
        torch.rand(samples.numel(), generator=g) < 0.4, hot, torch.randint(0, rows, hot.shape, generator=g)
    )
    gains = torch.rand(ids.numel(), generator=g) if weighted else torch.ones(ids.numel())
    csr, _ = preprocess(
        ids,
        samples,
        gains,
        device_batch_size=features * padded,
        num_sc_per_device=num_sc,
        max_ids_per_partition=max_ids,
        allow_id_dropping=max_ids is not None,
    )
    return csr, padded, g


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_csr_reference_equals_the_decoded_reference_bit_for_bit(case, seed):
    rows, nf, batch, num_sc, weighted, dtype, max_ids = case
    csr, padded, g = _input(rows, nf, batch, num_sc, weighted, max_ids, seed)
    B, dim = nf * padded, 16
    table = torch.randn(rows + (-rows) % num_sc, dim, generator=g).to(dtype)
    head = (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)
    decoded = R.decode(*head, table.shape[0] // num_sc, B, num_sc, num_sc)

    expected = R.lookup(decoded, table, B)
    assert torch.equal(R.lookup_csr(*head, table, B, num_sc, num_sc), expected)
    # un-interleaved as torchrec's TPU module does (`_unstack_activation`): [S, features, per, dim]
    per_feature = expected.view(num_sc, nf, padded // num_sc, dim).transpose(0, 1).reshape(nf, padded, dim)
    batch_major = per_feature[:, :batch].transpose(0, 1).reshape(batch, nf * dim)
    assert torch.equal(R.lookup_csr(*head, table, B, num_sc, num_sc, batch_major=(nf, batch, dim)), batch_major)

    grad = torch.randn(batch, nf * dim, generator=g)
    grad_op = torch.zeros(nf, padded, dim)
    grad_op[:, :batch] = grad.view(batch, nf, dim).transpose(0, 1)
    grad_op = grad_op.view(nf, num_sc, padded // num_sc, dim).transpose(0, 1).reshape(B, dim)  # interleave
    rows0, g0 = R.row_gradients(decoded, grad_op)
    for given in (grad_op, R.batch_major_grad(grad, nf)):
        rows1, g1 = R.row_gradients_csr(*head, table, given, B, num_sc, num_sc)
        assert torch.equal(rows1, rows0) and torch.equal(g1, g0)


def test_batch_major_gradient_may_be_a_column_slice_and_pads_storage_columns():
    csr, padded, g = _input(300, 2, 12, 2, True, None, 3)
    B, dim, width = 2 * padded, 4, 8
    table = torch.randn(300, width, generator=g)
    head = (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)
    wide = torch.randn(12, 3 + 2 * dim, generator=g)
    grad = wide[:, 3:]  # a column slice, as a cat's backward hands it over
    rows, sums = R.row_gradients_csr(*head, table, R.batch_major_grad(grad, 2), B, 2, 2)
    grad_op = torch.zeros(2, padded, width)
    grad_op[:, :12, :dim] = grad.reshape(12, 2, dim).transpose(0, 1)
    grad_op = grad_op.view(2, 2, padded // 2, width).transpose(0, 1).reshape(B, width)  # interleave
    rows0, sums0 = R.row_gradients(R.decode(*head, 150, B, 2, 2), grad_op)
    assert torch.equal(rows, rows0) and torch.equal(sums, sums0) and not sums[:, dim:].any()


def test_an_unsorted_partition_is_refused():
    csr, _, _ = _input(1000, 1, 32, 1, False, None, 0)
    emb = csr.embedding_ids.clone()
    end = int(csr.row_pointers[0])
    assert end >= 2 and emb[0] != emb[end - 1]
    emb[0], emb[end - 1] = emb[end - 1].clone(), emb[0].clone()
    with pytest.raises(ValueError, match="not sorted"):
        R.row_gradients_csr(
            csr.row_pointers, emb, csr.sample_ids, csr.gains, torch.zeros(1000, 4), torch.zeros(32, 4), 32, 1, 1
        )


def test_float32_row_update_equals_index_add():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 8, generator=g)
    rows, step = torch.tensor([3, 7, 7, 49, 0]), torch.randn(5, 8, generator=g)
    expected = table.clone().index_add_(0, rows, step)
    add_to_rows(table, rows, step)
    assert torch.equal(table, expected)
