"""A TorchRec ranking model trained with tpurec.DistributedModelParallel: the README example, whole.

    .venv/bin/python examples/quickstart.py                 # the TPU where there is one, else the CPU
    .venv/bin/python examples/quickstart.py --device cpu    # CPU: the SparseCore reference kernels, one process
    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/quickstart.py   # 2 ranks (gloo on CPU)
    tpurec launch --emulate-tpu v5p-16 examples/quickstart.py   # every rank of a v5p-16 on the TPU path, here

The model is plain TorchRec (an EmbeddingBagCollection built on the meta device, an MLP); the
tables' optimizer is fused into backward (apply_optimizer_in_backward), the MLP has its own. The
data is synthetic with a known signal: a click is likelier when the item id (feature f0) is even,
so a trained model reaches an AUC well above 0.5 within a few hundred steps. At the end the model
and its fused optimizer state are saved with torch.distributed.checkpoint and loaded back.

Each step moves the dense features and labels to the model's device and leaves the ids (the
KeyedJaggedTensor) on the host: tpurec's input distribution runs there (docs/tpu.md, "Ids stay on the
host"); a KJT moved to a TPU would be copied back, every step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import tpurec

NUM_FEATURES, ROWS, DIM, DENSE = 4, 1000, 16, 8


class Ranker(torch.nn.Module):
    """Embeddings of 4 sparse features + 8 dense features -> MLP -> one click logit."""

    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
            for i in range(NUM_FEATURES)
        ]
        self.ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))  # sharded later, never materialised here
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(NUM_FEATURES * DIM + DENSE, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(sparse).values()  # [batch, NUM_FEATURES * DIM]
        return self.mlp(torch.cat([dense, pooled], dim=1)).squeeze(1)


def batch(gen: torch.Generator, size: int):
    """(dense, KJT with one id per feature per sample, labels): clicks follow f0's id parity."""
    ids = torch.randint(0, ROWS, (NUM_FEATURES, size), generator=gen)
    sparse = KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(NUM_FEATURES)],
        values=ids.reshape(-1),
        lengths=torch.ones(NUM_FEATURES * size, dtype=torch.int64),
    )
    dense = torch.randn(size, DENSE, generator=gen)
    p_click = torch.where(ids[0] % 2 == 0, 0.8, 0.2)
    labels = (torch.rand(size, generator=gen) < p_click).float()
    return dense, sparse, labels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "tpu"],
        help="auto (the default): a TPU where this host has one, or an emulated TPU rank's under "
        "`tpurec launch --emulate-tpu`, else cpu",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--quick", action="store_true", help="60 steps (CI)")
    args = p.parse_args()
    steps = 60 if args.quick else args.steps

    torch.manual_seed(0)
    model = Ranker()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1})  # fused into backward
    # Plans (tpurec's TPU-aware planner) and shards the tables. Under torchrun it joins the launched ranks.
    # device=None: tpurec's choice (the TPU, real or emulated, where there is one; else the CPU)
    model = tpurec.DistributedModelParallel(model, device=None if args.device == "auto" else args.device)
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense_opt = KeyedOptimizerWrapper(dense_params, lambda params: torch.optim.Adagrad(params, lr=0.05))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_opt])  # one object for checkpoints

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    loss_fn = torch.nn.BCEWithLogitsLoss()
    first = last = None
    for _ in range(steps):
        dense, sparse, labels = batch(gen, args.batch_size)
        device = model.device
        loss = loss_fn(model(dense.to(device), sparse), labels.to(device))  # the ids stay on the host
        optimizer.zero_grad()
        loss.backward()  # the tables are updated here, inside backward
        optimizer.step()  # the MLP's Adagrad (the fused part does nothing more)
        last = float(loss.detach())
        first = last if first is None else first

    # Evaluated in training-sized batches: on a TPU each batch shape is a compiled program, with id
    # limits fixed from the first training batch.
    eval_gen = torch.Generator().manual_seed(7)
    parts = [batch(eval_gen, args.batch_size) for _ in range(max(1, 4096 // args.batch_size))]
    labels = torch.cat([p[2] for p in parts])
    with torch.no_grad():
        scores = torch.cat([model(d.to(model.device), s).cpu() for d, s, _ in parts])
    from torchmetrics.functional.classification import binary_auroc

    auc = float(binary_auroc(scores, labels.long()))

    # Checkpoint: TorchRec's usual DCP pattern (tables are ShardedTensors; any world size can load them).
    ckpt = os.environ.get("QUICKSTART_CKPT") or tempfile.mkdtemp(prefix="tpurec-quickstart-")
    if world > 1:
        holder = [ckpt]
        dist.broadcast_object_list(holder, src=0)  # every rank writes into rank 0's directory
        ckpt = holder[0]
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=ckpt)
    dcp.load(state, checkpoint_id=ckpt)  # loads in place into the live tables and state
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])

    if rank == 0:
        # AUC's ceiling here is 0.8 (clicks are 80% / 20% by f0's parity).
        print(
            json.dumps(
                {
                    "steps": steps,
                    "world_size": world,
                    "first_loss": first,
                    "last_loss": last,
                    "auc": round(auc, 4),
                    "checkpoint": ckpt,
                }
            )
        )


if __name__ == "__main__":
    # Ends without the interpreter's teardown, where a gloo worker thread of a multi-rank CPU run can
    # abort the process ("terminate called without an active exception", SIGABRT): exit handlers run,
    # output is flushed, then os._exit (tpurec/runtime/rank_exit.py; tpurec launch does the same).
    from tpurec.runtime.rank_exit import run_and_exit

    run_and_exit(main, wait_for_threads=True)
