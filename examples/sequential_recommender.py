"""A sequential recommender on SparseCore sequence embeddings: a transformer over each user's item
history, trained through tpurec.DistributedModelParallel, scored against the best AUC the data allows.

    .venv/bin/python examples/sequential_recommender.py               # CPU: the SparseCore reference kernels
    .venv/bin/python examples/sequential_recommender.py --device tpu  # a TPU VM (after tpurec selftest --device tpu)
    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/sequential_recommender.py   # 2 ranks (gloo on CPU)
    .venv/bin/tpurec launch --emulate-tpu v5p-8 examples/sequential_recommender.py --device tpu  # an emulated slice

The model is plain TorchRec and torch: an EmbeddingCollection (one table of items, looked up
unpooled for the history and the candidate: one embedding per id), a transformer encoder layer over
the history, and an MLP that predicts whether the user clicks the candidate. tpurec shards the
EmbeddingCollection onto its SparseCore kernel with the optimizer fused into backward.

The data has a known signal. Items fall into CLUSTERS clusters (item % CLUSTERS); each user prefers
one cluster, and 70% of their history comes from it. The candidate is a click with probability 0.85
when it is in the user's cluster, 0.15 otherwise. The best possible score is the exact Bayes
posterior of a click given the history and candidate (computed from the generative model), so the
example reports the model's AUC next to that ceiling (`bayes_auc`); no model can beat it.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import tpurec

ITEMS, CLUSTERS, MAX_LEN, DIM = 1000, 10, 20, 32
P_HISTORY_IN_CLUSTER, P_CANDIDATE_IN_CLUSTER = 0.7, 0.5
P_CLICK_IN, P_CLICK_OUT = 0.85, 0.15


class SequentialRanker(torch.nn.Module):
    """Item embeddings (unpooled) -> transformer over the history -> masked mean -> MLP with the candidate."""

    def __init__(self) -> None:
        super().__init__()
        items = EmbeddingConfig(
            name="item", embedding_dim=DIM, num_embeddings=ITEMS, feature_names=["history", "candidate"]
        )
        self.ec = EmbeddingCollection(tables=[items], device=torch.device("meta"))  # sharded later
        self.encoder = torch.nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=64, batch_first=True, dropout=0.0)
        self.head = torch.nn.Sequential(torch.nn.Linear(3 * DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        emb = self.ec(sparse)  # {"history": JaggedTensor [ids, DIM], "candidate": ...}
        # Shapes fixed by MAX_LEN, whatever the batch's id count (on a TPU each new shape is a new
        # program). The lengths and offsets are beside the values (on the TPU path the sharded EC
        # copies them to the device, and values() is padded to a fixed capacity past the ids' rows:
        # docs/sequence.md), so the mask and the rows are built there.
        hist, lengths = emb["history"].values(), emb["history"].lengths()
        batch = lengths.numel()
        steps = torch.arange(MAX_LEN, device=lengths.device).unsqueeze(0)
        mask = steps < lengths.unsqueeze(1)  # True: a real item
        rows = torch.where(mask, emb["history"].offsets()[:-1].unsqueeze(1) + steps, 0).reshape(-1)
        if hist.shape[0] == 0:  # a batch without any history
            hist = hist.new_zeros(1, DIM)
        weights = mask.float().unsqueeze(2)
        padded = hist.index_select(0, rows).view(batch, MAX_LEN, DIM) * weights
        # the attention's math kernel on every device: a TPU decomposes it so, and torch's CPU flash kernel
        # sums in another order, so CPU and TPU runs could not be compared exactly
        with sdpa_kernel(SDPBackend.MATH):
            encoded = self.encoder(padded, src_key_padding_mask=~mask & mask.any(1, keepdim=True))
        user = (encoded * weights).sum(1) / weights.sum(1).clamp(min=1)
        candidate = emb["candidate"].values()[:batch]  # one id per sample
        return self.head(torch.cat([user, candidate, user * candidate], dim=1)).squeeze(1)


def batch(gen: torch.Generator, size: int):
    """(KJT of history and candidate, labels, Bayes-optimal click probability)."""
    preferred = torch.randint(0, CLUSTERS, (size,), generator=gen)
    lengths = torch.randint(0, MAX_LEN + 1, (size,), generator=gen)
    owner = torch.repeat_interleave(torch.arange(size), lengths)
    history = _draw(gen, preferred[owner], P_HISTORY_IN_CLUSTER)
    candidate = _draw(gen, preferred, P_CANDIDATE_IN_CLUSTER)
    p_click = torch.where(candidate % CLUSTERS == preferred, P_CLICK_IN, P_CLICK_OUT)
    labels = (torch.rand(size, generator=gen) < p_click).float()
    sparse = KeyedJaggedTensor(
        keys=["history", "candidate"],
        values=torch.cat([history, candidate]),
        lengths=torch.cat([lengths, torch.ones(size, dtype=torch.long)]),
    )
    return sparse, labels, _bayes_click_probability(history, owner, lengths, candidate)


def _draw(gen, cluster, p_in):
    """An item per entry: from `cluster` with probability p_in, else uniform over all items."""
    n = cluster.numel()
    in_cluster = torch.randint(0, ITEMS // CLUSTERS, (n,), generator=gen) * CLUSTERS + cluster
    anywhere = torch.randint(0, ITEMS, (n,), generator=gen)
    return torch.where(torch.rand(n, generator=gen) < p_in, in_cluster, anywhere)


def _bayes_click_probability(history, owner, lengths, candidate):
    """P(click | history, candidate) under the generative model: the posterior over the preferred
    cluster (uniform prior, each history item and the candidate as evidence), then the click rates."""
    size = candidate.numel()
    in_hist = torch.zeros(size, CLUSTERS).index_put_(
        (owner, history % CLUSTERS), torch.ones(owner.numel()), accumulate=True
    )
    per_cluster = ITEMS // CLUSTERS

    def log_lik(p_in, count_in, count):
        return count_in * torch.log(torch.tensor(p_in / per_cluster + (1 - p_in) / ITEMS)) + (
            count - count_in
        ) * torch.log(torch.tensor((1 - p_in) / ITEMS))

    cand_in = torch.nn.functional.one_hot(candidate % CLUSTERS, CLUSTERS).float()
    log_post = log_lik(P_HISTORY_IN_CLUSTER, in_hist, lengths.unsqueeze(1).float()) + log_lik(
        P_CANDIDATE_IN_CLUSTER, cand_in, 1.0
    )
    p_same = (torch.softmax(log_post, dim=1) * cand_in).sum(1)
    return P_CLICK_OUT + (P_CLICK_IN - P_CLICK_OUT) * p_same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or tpu")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--quick", action="store_true", help="200 steps (CI)")
    args = p.parse_args()
    steps = 200 if args.quick else args.steps

    torch.manual_seed(0)
    model = SequentialRanker()
    apply_optimizer_in_backward(torch.optim.Adam, model.ec.parameters(), {"lr": 0.03})  # fused into backward
    model = tpurec.DistributedModelParallel(model, device=args.device, batch_size=args.batch_size)
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    # fused: one op per step whose step count is a tensor (TorchTPU has the kernel). The unfused Adam's
    # bias corrections are Python floats, on a TPU new constants, so new programs, every step.
    dense_opt = KeyedOptimizerWrapper(dense_params, lambda params: torch.optim.Adam(params, lr=0.003, fused=True))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_opt])

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own users
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    emulated = _emulated_rank()
    for _ in range(steps):
        if emulated is not None:
            emulated.begin("train")
        sparse, labels, _ = batch(gen, args.batch_size)
        loss = loss_fn(model(sparse), labels.to(model.device))  # the ids stay on the host
        optimizer.zero_grad()
        loss.backward()  # the item table is updated here, inside backward
        optimizer.step()
        losses.append(float(loss.detach()))

    # Evaluated in training-sized batches: on a TPU each batch shape is a compiled program, with buffers
    # (id limits, sequence capacity) fixed from the first training batch.
    eval_gen = torch.Generator().manual_seed(7 + rank)
    parts = [batch(eval_gen, args.batch_size) for _ in range(max(1, 2048 // args.batch_size))]
    labels, bayes = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
    if emulated is not None:
        emulated.begin("eval")
    with torch.no_grad():
        scores = torch.cat([model(p[0]).cpu() for p in parts])
    from torchmetrics.functional.classification import binary_auroc

    auc = float(binary_auroc(scores, labels.long()))
    bayes_auc = float(binary_auroc(bayes, labels.long()))
    if world > 1:  # the mean over ranks (each evaluated its own users)
        both = torch.tensor([auc, bayes_auc])
        dist.all_reduce(both)
        auc, bayes_auc = (both / world).tolist()
    if rank == 0:
        report = {}
        if emulated is not None:  # an emulated TPU rank (tpurec launch --emulate-tpu): rank 0's device
            report = {
                "recompiles_after_warmup": emulated.recompiles_after_warmup(),
                "device_to_host_copies_per_step": sum(emulated.train_copies().values()) / max(1, steps - 2),
            }
        print(
            json.dumps(
                report
                | {
                    "steps": steps,
                    "world_size": world,
                    "first_loss": round(sum(losses[:20]) / 20, 4),
                    "last_loss": round(sum(losses[-20:]) / 20, 4),
                    "last_step_loss": losses[-1],  # full precision: runs compared for equality
                    "auc": round(auc, 4),
                    "bayes_auc": round(bayes_auc, 4),  # the ceiling: the exact posterior of the data
                    "auc_over_bayes": round(auc / bayes_auc, 4),
                    "plan": {t: ps.sharding_type for t, ps in model.plan.plan["ec"].items()},
                }
            )
        )


def _emulated_rank():
    """This process's emulated TPU rank under `tpurec launch --emulate-tpu`, else None."""
    from tpurec.runtime.device import emulated_slice

    if not emulated_slice():
        return None
    from tpurec.emulation.rank import current

    return current()


if __name__ == "__main__":
    # Ends without the interpreter's teardown, where a gloo worker thread of a multi-rank CPU run can
    # abort the process ("terminate called without an active exception", SIGABRT): exit handlers run,
    # output is flushed, then os._exit (tpurec/runtime/rank_exit.py; tpurec launch does the same).
    from tpurec.runtime.rank_exit import run_and_exit

    run_and_exit(main, wait_for_threads=True)
