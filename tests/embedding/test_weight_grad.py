"""Trainable per-id weights get d loss / d weight from the SparseCore kernel, computed from the rows
before the step's fused update (as FBGEMM's TBE does), for sum and mean pooling."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

TABLES = [
    EmbeddingBagConfig(name="s", embedding_dim=4, num_embeddings=20, feature_names=["a", "b"]),
    EmbeddingBagConfig(name="m", embedding_dim=12, num_embeddings=9, feature_names=["c"], pooling=PoolingType.MEAN),
]


def _reference_grad(kjt: KeyedJaggedTensor, weights: torch.Tensor, tables: dict, upstream: torch.Tensor):
    """The same pooled output built densely from the tables, differentiated by torch."""
    w = weights.detach().clone().requires_grad_(True)
    pieces, start = [], 0
    batch = kjt.stride()
    for config in TABLES:
        for feature in config.feature_names:
            jt = kjt[feature]
            n = jt.values().numel()
            samples = torch.repeat_interleave(torch.arange(batch), jt.lengths())
            rows = tables[config.name][jt.values()] * w[start : start + n, None]
            pooled = torch.zeros(batch, config.embedding_dim).index_add(0, samples, rows)
            if config.pooling == PoolingType.MEAN:
                pooled = pooled / jt.lengths().clamp(min=1)[:, None]
            pieces.append(pooled)
            start += n
    (torch.cat(pieces, 1) * upstream).sum().backward()
    return w.grad


@pytest.mark.parametrize("pad_dims", [False, True])
def test_weights_gradient_is_read_before_the_update(pad_dims):
    torch.manual_seed(0)
    sc = SparseCoreEmbeddingBagCollection(
        TABLES, torch.optim.SGD, {"lr": 10.0}, num_sparsecores=2, is_weighted=True, pad_dims=pad_dims
    )
    gen = torch.Generator().manual_seed(1)
    batch = 5
    lengths = torch.randint(0, 4, (3 * batch,), generator=gen)
    values = torch.cat(
        [torch.randint(0, rows, (int(lengths[k * batch : (k + 1) * batch].sum()),), generator=gen) for k, rows in
         enumerate([20, 20, 9])]
    )  # fmt: skip
    weights = (torch.rand(values.numel(), generator=gen) + 0.5).requires_grad_(True)
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths, weights=weights)
    before = {c.name: sc.table_weight(c.name).detach().clone() for c in TABLES}
    out = sc(kjt).values()
    upstream = torch.randn(out.shape, generator=gen)
    (out * upstream).sum().backward()
    assert not torch.equal(sc.table_weight("s"), before["s"])  # the update did happen
    torch.testing.assert_close(weights.grad, _reference_grad(kjt, weights, before, upstream), rtol=0, atol=1e-5)
