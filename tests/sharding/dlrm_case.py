"""A DLRM trained under tpurec.DistributedModelParallel with TorchRec's TrainPipelineSparseDist."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FEATURES, ROWS, DIM, DENSE = 4, 200, 8, 5


def batches(n: int, batch: int, rank: int, world_size: int, seed: int = 0):
    """Synthetic clicks: the label is a fixed function of the ids, so the model can learn it."""
    gen = torch.Generator().manual_seed(seed)
    score_of_id = torch.randn(FEATURES, ROWS, generator=torch.Generator().manual_seed(123))
    out = []
    for _ in range(n):
        ids = torch.randint(0, ROWS, (FEATURES, batch * world_size), generator=gen)
        dense = torch.randn(batch * world_size, DENSE, generator=gen)
        logit = score_of_id.gather(1, ids).sum(0)
        labels = (logit > 0).float()
        lo, hi = rank * batch, (rank + 1) * batch
        kjt = KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(FEATURES)],
            values=ids[:, lo:hi].reshape(-1),
            lengths=torch.ones(FEATURES * batch, dtype=torch.long),
        )
        out.append(Batch(dense_features=dense[lo:hi], sparse_features=kjt, labels=labels[lo:hi]))
    return out


def eager_step(model, optimizer, batch) -> float:
    """TorchRec's eager training step of a DLRMTrain (its forward returns (loss, ...)): the oracle
    the compiled and pipelined steps are compared with, in TrainPipelineSparseDist's order: zero_grad()
    first, which hands the fused optimizer's scheduled lr to the tables' update, as stock's does. The loss."""
    optimizer.zero_grad()
    loss = model(batch)[0]
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def table_configs(n: int, pooling: str = "SUM", rows: int = ROWS) -> list[EmbeddingBagConfig]:
    """Tables t0.. of `rows` x DIM, table ti read by feature fi, pooled by `pooling` (a PoolingType name)."""
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"], pooling=PoolingType[pooling]
        )
        for i in range(n)
    ]


def dlrm_train(pooling: str = "SUM", table_lr: float = 0.1) -> Any:
    """TorchRec's DLRMTrain over FEATURES tables of ROWS x DIM (on the meta device: DMP places them),
    pooled by `pooling`, its tables under a fused RowWiseAdagrad at `table_lr`."""
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ebc = EmbeddingBagCollection(table_configs(FEATURES, pooling), device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE,
            dense_arch_layer_sizes=[16, DIM],
            over_arch_layer_sizes=[16, 1],
        )
    )
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": table_lr})
    return model


def train_dlrm(rank, world_size, steps):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import tpurec

    torch.manual_seed(0)
    model = dlrm_train()
    dmp = tpurec.DistributedModelParallel(model, device="cpu", batch_size=32)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=0.1)
    )
    opt = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
    pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
    it = iter(batches(steps, 32, rank, world_size))
    losses = []
    for _ in range(steps):
        out = pipeline.progress(it)  # DLRMTrain returns (loss, (loss, logits, labels))
        loss = out[0]
        losses.append(float(loss))
    kernels = sorted({ps.compute_kernel for mp in dmp.plan.plan.values() for ps in mp.values()})
    return {"losses": losses, "kernels": kernels}
