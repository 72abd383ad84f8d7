"""Embedding dims that are not multiples of 8 (TorchRec accepts any): stored 8 wide, used at their own.

Oracles: TorchRec's EmbeddingBagCollection for the forward, FBGEMM's CPU TBE for the fused updates
(its row-wise Adagrad averages g*g over the table's own dim, which the padded storage must match).
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

DIMS = (4, 12, 20)
TABLES = [
    EmbeddingBagConfig(name=f"t{d}", embedding_dim=d, num_embeddings=30 + d, feature_names=[f"f{d}"]) for d in DIMS
]


def _batch(gen, batch=6):
    lengths = torch.randint(0, 4, (len(DIMS) * batch,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(n),), generator=gen)
            for t, n in zip(TABLES, lengths.view(len(DIMS), batch).sum(1))
        ]
    )
    return KeyedJaggedTensor(keys=[t.feature_names[0] for t in TABLES], values=values, lengths=lengths)


@pytest.mark.parametrize("pad_dims", [False, True])
def test_forward_equals_torchrec_at_dims_4_12_20(pad_dims):
    from torchrec.optim import RowWiseAdagrad

    sc = SparseCoreEmbeddingBagCollection(TABLES, RowWiseAdagrad, {"lr": 0.1}, num_sparsecores=4, pad_dims=pad_dims)
    ebc = EmbeddingBagCollection(TABLES)
    ebc.load_state_dict(sc.state_dict())
    assert {k: tuple(v.shape) for k, v in sc.state_dict().items()} == {
        f"embedding_bags.t{d}.weight": (30 + d, d) for d in DIMS
    }
    kjt = _batch(torch.Generator().manual_seed(0))
    torch.testing.assert_close(sc(kjt).values(), ebc(kjt).values(), rtol=0, atol=1e-6)
    assert sc(kjt).length_per_key() == list(DIMS)


@pytest.mark.parametrize(
    "fbgemm_optim,optim,kwargs",
    [
        (EmbOptimType.EXACT_SGD, torch.optim.SGD, {"lr": 0.3}),
        (EmbOptimType.EXACT_ROWWISE_ADAGRAD, None, {"lr": 0.3, "eps": 1e-6}),
    ],
)
@pytest.mark.parametrize("pad_dims", [False, True])  # True: stored 8 wide, as on a TPU
def test_fused_updates_equal_fbgemm_at_dims_4_12_20(fbgemm_optim, optim, kwargs, pad_dims):
    if optim is None:
        from torchrec.optim import RowWiseAdagrad as optim
    sc = SparseCoreEmbeddingBagCollection(TABLES, optim, kwargs, num_sparsecores=2, pad_dims=pad_dims)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in TABLES],
        optimizer=fbgemm_optim,
        learning_rate=kwargs["lr"],
        eps=kwargs.get("eps", 1e-8),
        pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        for w, t in zip(tbe.split_embedding_weights(), TABLES):
            w.copy_(sc.table_weight(t.name))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        kjt = _batch(gen)
        upstream = torch.randn(6, sum(DIMS), generator=gen)
        (sc(kjt).values() * upstream).sum().backward()
        out = tbe(kjt.values(), kjt.offsets())
        (out * upstream).sum().backward()
    for w, t in zip(tbe.split_embedding_weights(), TABLES):
        torch.testing.assert_close(sc.table_weight(t.name), w, rtol=1e-5, atol=1e-6)
    # the storage padding stayed zero
    for i, plan in enumerate(sc.kernel.stacks):
        width = plan.layout.storage_dim
        assert torch.count_nonzero(sc.kernel.stack_weight(i)[:, plan.layout.dim : width]) == 0
