"""One emulated TPU rank trains a tpurec-DMP model on the device twice from the same seed: TorchRec's
eager step (DMP's forward, DDP, torch.optim.SGD) and `CompiledStep` under TorchTPU's backend ("tpu",
tpurec/emulation/compiled.py), batch for batch; it writes what it saw as JSON to OUT.rank<R>.json.

Run by tests/emulation/test_emulated_compiled_step.py in a process made an emulated rank (one rank),
or on every rank of a slice by `tpurec launch --emulate-tpu v5p-8 THIS_FILE ...`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import tpurec  # an emulated rank: the device and the "tpu" backend are installed here

REPO = Path(__file__).resolve().parents[2]
BATCH, DENSE_LR, TABLE_LR = 32, 0.05, 0.1


def _small_dlrm() -> tuple[Any, Any]:
    """TorchRec's DLRMTrain over four tables of 200 x 8 (tests/sharding/dlrm_case.py), row-wise Adagrad."""
    from tests.sharding.dlrm_case import dlrm_train

    return dlrm_train(table_lr=TABLE_LR), None


def _small_dlrm_host_tier() -> tuple[Any, Any]:
    """The small DLRM with table t0 on the host tier (fused_uvm_caching, half its rows cached)."""
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams

    from tests.sharding.dlrm_case import dlrm_train

    half = CacheParams(load_factor=0.5)
    return dlrm_train(table_lr=TABLE_LR), {
        "t0": ParameterConstraints(compute_kernels=["fused_uvm_caching"], cache_params=half)
    }


def _dlrm_tiny_every_sharding_type() -> tuple[Any, Any]:
    """tpurec's dlrm-tiny (26 tables, its DLRMTrain and table optimizer) with the constraints of
    tests/emulation/every_sharding_type.py: TW, CW, TWCW and RW in one plan."""
    from tests.emulation.every_sharding_type import dlrm_tiny
    from tpurec.dlrm.configs import get_config
    from tpurec.dlrm.model import build_model

    _, constraints = dlrm_tiny()
    return build_model(get_config("dlrm-tiny")), constraints


def _two_ebcs() -> tuple[Any, Any]:
    """Two sharded EBCs, each fed a KJT field of its own (tests/helpers/two_ebcs.py)."""
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tests.helpers.two_ebcs import TwoEBCs

    model = TwoEBCs("split")
    apply_optimizer_in_backward(
        RowWiseAdagrad, [*model.items.parameters(), *model.users.parameters()], {"lr": TABLE_LR}
    )
    return model, None


# "seq", "seq-mask": tests/helpers/sequence_model.py's EC and EBC model (built there), pooling
# its sequences by a total (no lengths read) or by a mask from the offsets (on the device)
MODELS = {"small": _small_dlrm, "dlrm-tiny": _dlrm_tiny_every_sharding_type, "two-ebcs": _two_ebcs, "seq": None}
MODELS["small-host"] = _small_dlrm_host_tier
MODELS["seq-mask"] = None


def _dmp(model_name: str) -> Any:
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    if model_name.startswith("seq"):  # an EC (fixed limits on the device) beside an EBC
        from tests.helpers.sequence_model import sequence_dmp

        return sequence_dmp(True, device="tpu", pool="mask" if model_name == "seq-mask" else "total")
    torch.manual_seed(0)
    make = MODELS[model_name]
    assert make is not None
    model, constraints = make()
    return tpurec.DistributedModelParallel(
        model,
        device="tpu",
        batch_size=BATCH,
        constraints=constraints,
        # fixed limits every batch fits (one pass: a compiled step refuses more): a table-wise shard of
        # dlrm-tiny takes a feature's ids of the whole global batch
        sharders=[SparseCoreEBCSharder(max_ids_per_partition=64 if model_name.startswith("small") else 256)],
    )


def _batches(dmp: Any, n: int, rank: int, world: int) -> list:
    """One id per feature and sample, uniform over each table's rows, labels at random; this rank's
    slice of each global batch. Dense features and labels on the device, the ids on the host (as the
    emulated trainer keeps them, tpurec.runtime.host_copies)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if hasattr(dmp.module, "ec"):  # the EC model: its batches, dense features and labels on the device
        from tests.helpers.sequence_model import sequence_batches

        return [
            replace(b, dense_features=b.dense_features.to("tpu"), labels=b.labels.to("tpu"))
            for b in sequence_batches(n, seed=rank)
        ]
    if not hasattr(dmp.module, "model"):  # the two EBCs: dlrm_case's ids, f2 and f3 in a field of their own
        from tests.helpers.dlrm_step import disjoint_batches
        from tests.helpers.two_ebcs import TwoFields

        two = []
        for b in disjoint_batches(n, BATCH, rank, world):
            items, users = b.sparse_features.split([2, 2])
            two.append(TwoFields(b.dense_features.to("tpu"), items, users, b.labels.to("tpu")))
        return two
    ebc = dmp.module.model.sparse_arch.embedding_bag_collection
    configs = ebc._embedding_bag_configs  # TorchRec keeps them on the sharded module
    keys = [f for c in configs for f in c.feature_names]
    rows = torch.tensor([c.num_embeddings for c in configs for _ in c.feature_names])
    dense_in = dmp.module.model.dense_arch.model._mlp[0]._linear.in_features
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = (torch.rand(len(keys), BATCH * world, generator=gen) * rows[:, None]).long()
        dense = torch.randn(BATCH * world, dense_in, generator=gen)
        labels = torch.randint(0, 2, (BATCH * world,), generator=gen).float()
        lo, hi = rank * BATCH, (rank + 1) * BATCH
        kjt = KeyedJaggedTensor(
            keys=keys, values=ids[:, lo:hi].reshape(-1), lengths=torch.ones(len(keys) * BATCH, dtype=torch.long)
        )
        out.append(Batch(dense_features=dense[lo:hi].to("tpu"), sparse_features=kjt, labels=labels[lo:hi].to("tpu")))
    return out


def _host_tier_counters(dmp: Any) -> dict[str, dict[str, int]]:
    """Each host-tier table's cache counters (hits, misses, evictions) in `dmp`'s kernels."""
    out = {}
    owners = [module for module in dmp.modules() if hasattr(module, "sparsecore_lookups")]
    for lookup in [m for owner in owners for m in owner.sparsecore_lookups()]:
        for name, c in (getattr(lookup.kernel, "host_tier", None) or {}).items():
            out[name] = {"hits": c.counters.hits, "misses": c.counters.misses, "evictions": c.counters.evictions}
    return out


def _tables(dmp: Any) -> dict[str, torch.Tensor]:
    """This rank's table shards, read back to the host."""
    out = {}
    for key, value in dmp.state_dict().items():
        if ("embedding_bags" in key or "embeddings." in key) and sum(s.tensor.numel() for s in value.local_shards()):
            out[key] = torch.cat([s.tensor.flatten().cpu() for s in value.local_shards()])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    parser.add_argument("--host-tensor-check", action="store_true")
    # the eager step's dense gradient average: DDP's (its buckets), or the graph's (one bucket, one all-reduce)
    parser.add_argument("--oracle", choices=["ddp", "allreduce"], default="ddp")
    args = parser.parse_args()

    import torch.distributed as dist
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from tpurec.emulation import compiled, device, handshake
    from tpurec.sharding.step.compiled import CompiledStep
    from tpurec.strict_json import dumps

    eager, twin = _dmp(args.model), _dmp(args.model)
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = _tables(eager)
    same_start = all(torch.equal(initial[k], v) for k, v in _tables(twin).items())
    dense = [p for _, p in in_backward_optimizer_filter(eager.named_parameters())]
    twin_dense = [p for _, p in in_backward_optimizer_filter(twin.named_parameters())]
    sgd = torch.optim.SGD(dense, lr=DENSE_LR)
    step = CompiledStep(twin, DENSE_LR, backend="tpu")
    eager_losses, compiled_losses, per_step_programs = [], [], []
    for batch in _batches(eager, args.steps, rank, world):
        if args.oracle == "ddp":
            loss = eager(batch)[0]
            loss.backward()
        else:  # DMP's module without DDP, the dense gradients averaged in one bucket, as the graph does
            loss = eager.module(batch)[0]
            loss.backward()
            have = [p for p in dense if p.grad is not None]
            if have and world > 1:
                flat = torch.cat([g.reshape(-1) for p in have if (g := p.grad) is not None]) / world
                dist.all_reduce(flat)
                for p, part in zip(have, torch.split(flat, [p.numel() for p in have])):
                    p.grad = part.view_as(p)
        sgd.step()
        sgd.zero_grad()
        eager_losses.append(float(loss.detach()))
        before = set(device.RECORD.programs)
        out = step.step(batch)
        per_step_programs.append(sorted({(kind, op) for kind, op, _ in set(device.RECORD.programs) - before}))
        compiled_losses.append(float(out))
    after, twin_after = _tables(eager), _tables(twin)
    counts = compiled.graph_counts()  # before explain, which compiles again
    found: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "same_start": same_start,
        "eager": eager_losses,
        "compiled": compiled_losses,
        "table_diff": max(float((after[k] - twin_after[k]).abs().max()) for k in after),
        "tables_moved": min(float((after[k] - initial[k]).abs().max()) for k in after),
        "dense_diff": max(
            float((p - q).detach().abs().max()) for p, q in zip(dense, twin_dense, strict=True) if p.numel()
        ),
        "dense_on_device": all(str(p.device) == "tpu:0" for p in twin_dense),
        "new_programs_by_step": per_step_programs,
        "compiled_programs": sorted([op, str(key)] for kind, op, key in device.RECORD.programs if kind == "compiled"),
        "graphs": len(compiled.COMPILED),
        "programs_per_run": [dict(Counter(kind for kind, _, _ in graph)) for graph in compiled.COMPILED],
        "all_reduces_per_run": [
            sum(op == "_c10d_functional::all_reduce" for kind, op, _ in graph) for graph in compiled.COMPILED
        ],
        "graph_collectives": sorted(
            {op for graph in compiled.COMPILED for kind, op, _ in graph if kind == "collective"}
        ),
        "plan": sorted({ps.sharding_type for mp in twin.plan.plan.values() for ps in mp.values()}),
        "host_tier": _host_tier_counters(twin),
        **counts,
        **handshake.figures(),
    }
    explained = step.explain(_batches(eager, 1, rank, world)[0])
    found["explain"] = {
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
        "ops": explained.op_count,
        "reasons": [str(r.reason)[:300] for r in explained.break_reasons],
    }
    if args.host_tensor_check:
        # the dense features left on the host: the compiled step's trace meets the device's rule
        batch = _batches(eager, 1, rank, world)[0]
        host = replace(batch, dense_features=batch.dense_features.cpu())
        try:
            step.step(host)
            found["host_tensor_error"] = None
        except Exception as e:  # Dynamo wraps the rule's RuntimeError
            found["host_tensor_error"] = f"{type(e).__name__}: {e}"[:600]
    Path(f"{args.out}.rank{rank}.json").write_text(dumps(found))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # tests.* from the repository, as under pytest
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
