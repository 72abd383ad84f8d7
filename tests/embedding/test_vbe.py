"""The standalone SparseCoreEmbeddingBagCollection on variable batch per feature (VBE) batches: as
TorchRec's unsharded EmbeddingBagCollection, each feature pooled over its own bags and expanded to the
full batch by the KJT's inverse indices; trained with the same optimizer on TorchRec's EBC (autograd
through its expansion), outputs every step and tables after 3 steps within 1e-6."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.vbe import pad_to_common_batch, to_vbe_layout

from .helpers import make_tables

BATCH = 5


def _vbe_batch(tables, gen: torch.Generator, weighted: bool) -> KeyedJaggedTensor:
    """Feature k has 1 + (k + step) % 4 bags of 0 to 3 ids (some empty); the BATCH samples map to them."""
    keys, rows = [], []
    for t in tables:
        for f in t.feature_names:
            keys.append(f)
            rows.append(t.num_embeddings)
    bags = [int(torch.randint(1, 5, (), generator=gen)) for _ in keys]
    lengths = torch.cat([torch.randint(0, 4, (b,), generator=gen) for b in bags])
    values, start = [], 0
    for r, b in zip(rows, bags):
        values.append(torch.randint(0, r, (int(lengths[start : start + b].sum()),), generator=gen))
        start += b
    inverse = torch.stack([torch.randint(0, b, (BATCH,), generator=gen) for b in bags])
    ids = torch.cat(values)
    return KeyedJaggedTensor(
        keys=keys,
        values=ids,
        lengths=lengths,
        weights=torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None,
        stride_per_key_per_rank=[[b] for b in bags],
        inverse_indices=(keys, inverse),
    )


@pytest.mark.parametrize(
    "optim, pooling, weighted",
    [
        (torch.optim.SGD, PoolingType.SUM, False),
        (torch.optim.SGD, PoolingType.MEAN, False),
        (torch.optim.Adagrad, PoolingType.SUM, True),
        (torch.optim.Adagrad, PoolingType.MEAN, False),
    ],
)
def test_vbe_batches_train_as_torchrecs_ebc(optim, pooling, weighted):
    tables = make_tables(pooling)
    ref = EmbeddingBagCollection(tables, is_weighted=weighted)
    ours = SparseCoreEmbeddingBagCollection(tables, optim, {"lr": 0.05}, num_sparsecores=2, is_weighted=weighted)
    ours.load_state_dict(ref.state_dict())
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = optim(ref.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        kjt = _vbe_batch(tables, gen, weighted)
        want, got = ref(kjt), ours(kjt)
        assert got.keys() == want.keys() and got.values().shape == (BATCH, 40)
        torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)
        g = torch.randn(want.values().shape, generator=gen)
        ref_opt.zero_grad()
        (want.values() * g).sum().backward()
        ref_opt.step()
        (got.values() * g).sum().backward()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)
        assert (value - start[key]).abs().max() > 1e-3  # the table did train


def test_vbe_layout_is_rank_major_then_feature():
    """FBGEMM's VBE output order, as TorchRec's lookups return it (its `_vbe_splits` docstring):
    rank 0's blocks (each feature's bags from that rank x its dim), then rank 1's."""
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.arange(8),
        lengths=torch.ones(8, dtype=torch.long),
        stride_per_key_per_rank=[[2, 1], [3, 2]],  # a: 2 bags from rank 0, 1 from rank 1; b: 3 and 2
    )
    padded = pad_to_common_batch(kjt)
    assert padded.stride() == 5 and padded.lengths().tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    dims = [1, 2]
    out = torch.tensor([[10.0, 20, 21], [11, 22, 23], [12, 24, 25], [0, 26, 27], [0, 28, 29]])  # [bag, a | b]
    want = [10, 11, 20, 21, 22, 23, 24, 25, 12, 26, 27, 28, 29]  # rank 0: a0 a1 b0 b1 b2; rank 1: a2 b3 b4
    assert to_vbe_layout(out, kjt, dims).tolist() == want
