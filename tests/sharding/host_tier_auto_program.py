"""`tpurec.DistributedModelParallel(..., host_tier="auto")` on an emulated TPU rank whose HBM is cut so
that the largest table does not fit, run by tests/sharding/test_host_tier_dmp.py under `tpurec launch
--emulate-tpu v5e-1 THIS`. Prints one JSON line: the plan's host-tier tables and their cache rows,
the losses of a few steps and those of the same model all resident (the chip's own HBM), and the
refusal without `host_tier`."""

from __future__ import annotations

import json
from typing import Any

import torch

HBM = 40 * 10**6  # bytes per device: t0 (200,000 x 64 f32 and its row-wise state: 51.4 MB) cannot fit


def _model() -> torch.nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=rows, feature_names=[f"f{i}"])
        for i, rows in enumerate((200_000, 1_000, 5_000))
    ]
    return EmbeddingBagCollection(tables, device=torch.device("meta"))


def _dmp(host_tier: str | None, hbm: int | None = HBM) -> Any:
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.planner.topology import make_topology
    from tpurec.runtime.device import DeviceKind

    torch.manual_seed(0)
    model = _model()
    apply_optimizer_in_backward(RowWiseAdagrad, model.parameters(), {"lr": 0.05})
    topology = make_topology("v5e-1", world_size=1, compute_device=DeviceKind.TPU)
    for d in topology.devices:
        d.storage.hbm = hbm or d.storage.hbm
    return tpurec.DistributedModelParallel(model, device="tpu", topology=topology, batch_size=64, host_tier=host_tier)


def main() -> None:
    from tpurec.dlrm.host_tier import planned_tables
    from tpurec.errors import UserError

    out: dict = {}
    try:
        _dmp(None)
    except UserError as e:
        out["refused"] = str(e).splitlines()[0][:200]
    dmp = _dmp("auto")
    out["host_tier"] = planned_tables(dmp.plan)
    plan = dmp.plan.plan[""]
    out["cache_load_factor"] = {t: plan[t].cache_params.load_factor for t in out["host_tier"]}
    out["losses"] = _train(dmp)
    out["resident_losses"] = _train(_dmp(None, hbm=None))  # the chip's own HBM: every table resident
    print(json.dumps(out))


def _train(dmp: Any) -> list[float]:
    """5 steps on the same batches (0-3 ids a bag, skewed to low rows): the losses."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(5):
        lengths = torch.randint(1, 4, (3 * 64,), generator=gen)
        rows = torch.tensor([200_000, 1_000, 5_000]).repeat_interleave(64).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * rows).long()
        loss = dmp(KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=lengths)).values().square().sum()
        loss.backward()
        losses.append(float(loss.detach().cpu()))
    return losses


if __name__ == "__main__":
    main()
