"""Variable batch per feature (VBE: `KeyedJaggedTensor(..., stride_per_key_per_rank=...,
inverse_indices=...)`) under tpurec.DistributedModelParallel, trained as stock TorchRec's DMP trains it
(FBGEMM's fused kernel, same plan): pooled outputs every step and tables after 3 steps, within 1e-6;
the first step's outputs also equal TorchRec's unsharded EmbeddingBagCollection's.

Each step's batch: 4 samples per rank; features f0, f1, f2 (tables of dims 4, 8, 12) carry 2, 3 and
1 distinct bags on rank 0 (3, 1 and 2 on rank 1) and inverse indices map the 4 samples to them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
from tests.sharding.multiprocess import run_ranks
from tpurec.planner.kernel_choice import COMPUTE_KERNEL
from tpurec.sharding.dmp import _ensure_process_group
from tpurec.sharding.sharder import SparseCoreEBCSharder

TABLES = [("t0", 20, 4, "f0"), ("t1", 15, 8, "f1"), ("t2", 10, 12, "f2")]  # name, rows, dim, feature
KEYS = [f for *_, f in TABLES]
# distinct bags per feature, by rank: 44 pooled floats per rank (2x4 + 3x8 + 1x12, 3x4 + 1x8 + 2x12)
BAGS = [[2, 3, 1], [3, 1, 2]]
UNEQUAL = [[2, 3, 1], [1, 1, 1]]  # 44 and 24 floats
BATCH, STEPS, LR = 4, 3, 0.05
OPTIMIZERS = {"sgd": torch.optim.SGD, "row_wise_adagrad": RowWiseAdagrad}
POOLINGS = {"s": PoolingType.SUM, "m": PoolingType.MEAN}


def _as_type(gen, sharding_type: str):
    """TorchRec's plan generator with another sharding type (it has no table_column_wise())."""
    return lambda *args, **kwargs: dataclasses.replace(gen(*args, **kwargs), sharding_type=sharding_type)


PLANS = {  # table i's placement at world size ws with compute kernel k
    "table_wise": lambda i, ws, k: table_wise(rank=i % ws, compute_kernel=k),
    "column_wise": lambda i, ws, k: column_wise(ranks=[(i + j) % ws for j in range(2)], compute_kernel=k),
    "table_column_wise": lambda i, ws, k: _as_type(
        column_wise(ranks=[(i + j) % ws for j in range(2)], compute_kernel=k), "table_column_wise"
    ),
    "row_wise": lambda i, ws, k: row_wise(compute_kernel=k),
    "table_row_wise": lambda i, ws, k: table_row_wise(host_index=0),  # takes no kernel: set below
}


class _Model(nn.Module):
    """The tables in one EBC, or (split) the SUM tables in one and the MEAN tables in another."""

    def __init__(self, poolings: str, split: bool = False, weighted: bool = False) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f], pooling=POOLINGS[p])
            for (n, r, d, f), p in zip(TABLES, poolings)
        ]
        groups = [[c for c in configs if c.pooling == p] for p in POOLINGS.values()] if split else [configs]
        self.ebcs = nn.ModuleList(
            EmbeddingBagCollection(tables=g, is_weighted=weighted, device=torch.device("meta")) for g in groups if g
        )

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = {}  # KeyedTensors, their keys in each sharded module's order: taken by name
        for ebc in self.ebcs:
            pooled.update(ebc(features).to_dict())
        return torch.cat([pooled[f] for f in KEYS], 1)


def _batches(
    rank: int, vbe: bool = True, weighted: bool = False, bags_by_rank: list[list[int]] = BAGS
) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    """(VBE KJT, loss weights [BATCH, sum of dims]) per step; bags of 0 to 3 ids. Not vbe: every
    feature has BATCH bags, an ordinary KJT. weighted: per-id weights in [0.5, 1.5)."""
    gen = torch.Generator().manual_seed(17 + rank)
    bags = bags_by_rank[rank] if vbe else [BATCH] * len(TABLES)
    out = []
    for _ in range(STEPS):
        lengths = torch.cat([torch.randint(0, 4, (b,), generator=gen) for b in bags])
        values, start = [], 0
        for (_, rows, _, _), b in zip(TABLES, bags):
            values.append(torch.randint(0, rows, (int(lengths[start : start + b].sum()),), generator=gen))
            start += b
        inverse = torch.stack([torch.randint(0, b, (BATCH,), generator=gen) for b in bags])
        ids = torch.cat(values)
        weights = torch.rand(ids.numel(), generator=gen) + 0.5 if weighted else None
        kjt = (
            KeyedJaggedTensor(
                keys=KEYS,
                values=ids,
                weights=weights,
                lengths=lengths,
                stride_per_key_per_rank=[[b] for b in bags],
                inverse_indices=(KEYS, inverse),
            )
            if vbe
            else KeyedJaggedTensor(keys=KEYS, values=ids, weights=weights, lengths=lengths)
        )
        out.append((kjt, torch.randn(BATCH, sum(d for _, _, d, _ in TABLES), generator=gen)))
    return out


def _initial(table: str, rows: int, cols: int) -> torch.Tensor:
    scale = 1 + [n for n, *_ in TABLES].index(table)
    return torch.linspace(-0.3, 0.3, rows * cols).view(rows, cols).sin() * scale


def _plan(model: _Model, sharding: str | tuple[str, ...], world_size: int, stock: bool) -> ShardingPlan:
    """One sharding type for every table, or one per table (in TABLES order)."""
    kernel = "fused" if stock else COMPUTE_KERNEL
    types = dict(zip([n for n, *_ in TABLES], (sharding,) * len(TABLES) if isinstance(sharding, str) else sharding))
    plan: dict[str, Any] = {}
    for j, ebc in enumerate(cast(list[EmbeddingBagCollection], list(model.ebcs))):
        sharder = cast(ModuleSharder[nn.Module], EmbeddingBagCollectionSharder() if stock else SparseCoreEBCSharder())
        names = [c.name for c in ebc.embedding_bag_configs()]
        per_table = {n: PLANS[types[n]]([t for t, *_ in TABLES].index(n), world_size, kernel) for n in names}
        module_plan = construct_module_sharding_plan(
            ebc, per_table, sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu"
        )
        for ps in module_plan.values():
            ps.compute_kernel = kernel
        plan[f"ebcs.{j}"] = module_plan
    return ShardingPlan(plan)


def _train(
    stock: bool,
    rank: int,
    world_size: int,
    sharding,
    optimizer: str,
    poolings: str,
    split: bool = False,
    vbe: bool = True,
    weighted: bool = False,
    bags_by_rank: list[list[int]] = BAGS,
) -> dict:
    """poolings: one letter per table, "s" SUM or "m" MEAN."""
    torch.manual_seed(0)
    module = _Model(poolings, split, weighted)
    apply_optimizer_in_backward(OPTIMIZERS[optimizer], module.ebcs.parameters(), {"lr": LR})
    dmp_class = StockDMP if stock else tpurec.DistributedModelParallel
    model = dmp_class(module, device=torch.device("cpu"), plan=_plan(module, sharding, world_size, stock))
    with torch.no_grad():  # the same tables on both sides (stock re-initialises tables it shards on CPU)
        for key, value in model.state_dict().items():
            full = _initial(key.split(".")[-2], *value.size())
            for shard in value.local_shards():
                (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r : r + nr, c : c + nc])
    outputs = []
    for kjt, loss_weights in _batches(rank, vbe, weighted, bags_by_rank):
        out = model(kjt)
        (out * loss_weights).sum().backward()
        outputs.append(out.detach().clone())
    tables: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        gathered = torch.empty(value.size()) if rank == 0 else None
        value.gather(dst=0, out=gathered)
        if gathered is not None:
            tables[key.split(".")[-2]] = gathered
    plan: Any = model.plan.plan
    kernels = {ps.compute_kernel for mp in plan.values() for ps in mp.values()}
    sharded: Any = model.module
    groups = [len(lookup._emb_modules) for ebc in sharded.ebcs for lookup in ebc._lookups]
    return {"outputs": outputs, "tables": tables, "kernels": kernels, "groups": groups}


def _unsharded_first_output(poolings: str, vbe: bool = True) -> torch.Tensor:
    """TorchRec's unsharded EmbeddingBagCollection on rank 0's first batch: it expands a VBE lookup by
    the inverse indices itself."""
    configs = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f], pooling=POOLINGS[p])
        for (n, r, d, f), p in zip(TABLES, poolings)
    ]
    ebc = EmbeddingBagCollection(tables=configs)
    with torch.no_grad():
        for key, value in ebc.state_dict().items():
            value.copy_(_initial(key.split(".")[-2], *value.size()))
        pooled = ebc(_batches(0, vbe)[0][0])
    return torch.cat([pooled[f] for f in KEYS], 1)


def _both(rank: int, world_size: int, sharding, optimizer: str, poolings: str) -> tuple[dict, dict]:
    return (
        _train(True, rank, world_size, sharding, optimizer, poolings),
        _train(False, rank, world_size, sharding, optimizer, poolings),
    )


def _assert_same(stock: dict, ours: dict) -> None:
    assert ours["kernels"] == {COMPUTE_KERNEL}
    for got, want in zip(ours["outputs"], stock["outputs"], strict=True):
        assert got.shape == (BATCH, sum(d for _, _, d, _ in TABLES))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert set(ours["tables"]) == set(stock["tables"])
    for name, want in stock["tables"].items():
        torch.testing.assert_close(ours["tables"][name], want, rtol=0, atol=1e-6, msg=name)
        assert (want - _initial(name, *want.size())).abs().max() > 1e-3  # it did train


ONE_RANK = [
    ("table_wise", "sgd", "sss"),
    ("table_wise", "row_wise_adagrad", "mmm"),
    ("column_wise", "row_wise_adagrad", "sss"),
    ("table_column_wise", "sgd", "mmm"),
    ("row_wise", "sgd", "mmm"),
    ("row_wise", "row_wise_adagrad", "sss"),
    ("table_row_wise", "row_wise_adagrad", "mmm"),
]


@pytest.mark.parametrize("sharding, optimizer, poolings", ONE_RANK)
def test_vbe_trains_as_in_stock_torchrec(sharding, optimizer, poolings):
    _ensure_process_group("cpu")
    stock, ours = _both(0, 1, sharding, optimizer, poolings)
    _assert_same(stock, ours)
    torch.testing.assert_close(ours["outputs"][0], _unsharded_first_output(poolings), rtol=0, atol=1e-6)


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_weighted_vbe_trains_as_in_stock_torchrec(sharding):
    """Per-id weights (a weighted EBC) ride along unchanged: the padding adds bags, not ids."""
    _ensure_process_group("cpu")
    stock = _train(True, 0, 1, sharding, "row_wise_adagrad", "sss", weighted=True)
    ours = _train(False, 0, 1, sharding, "row_wise_adagrad", "sss", weighted=True)
    _assert_same(stock, ours)


@pytest.mark.slow  # two ranks training both sides, 12-17 s each; the one-rank cases above run by default
@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", list(PLANS))
def test_vbe_trains_as_in_stock_torchrec_at_two_ranks(sharding):
    for stock, ours in run_ranks(_both, 2, sharding, "row_wise_adagrad", "mmm"):
        _assert_same(stock, ours)


def test_sum_and_mean_tables_in_one_lookup():
    """SUM and MEAN tables table-wise: tpurec's lookup holds two kernels and fills TorchRec's
    pre-allocated VBE output from both. Stock TorchRec cannot run that on CPU (below), so its side
    holds the SUM and the MEAN tables in two EBCs (one FBGEMM module per lookup); same numbers."""
    _ensure_process_group("cpu")
    stock = _train(True, 0, 1, "table_wise", "row_wise_adagrad", "sms", split=True)
    ours = _train(False, 0, 1, "table_wise", "row_wise_adagrad", "sms")
    assert ours["groups"] == [2] and stock["groups"] == [1, 1]
    _assert_same(stock, ours)
    torch.testing.assert_close(ours["outputs"][0], _unsharded_first_output("sms"), rtol=0, atol=1e-6)


def _unequal(rank: int, world_size: int, sharding: str) -> list[str]:
    """Each side's training on UNEQUAL, or the last line of its error."""
    out = []
    for stock in (True, False):
        try:
            _train(stock, rank, world_size, sharding, "sgd", "sss", bags_by_rank=UNEQUAL)
            out.append("ok")
        except Exception as e:  # noqa: BLE001 (the error is the result)
            out.append(str(e).strip().splitlines()[-1])
    return out


@pytest.mark.slow  # two ranks, ~25 s
@pytest.mark.multiprocess
def test_ranks_of_unequal_vbe_sizes_under_row_wise_fail_on_gloo_as_in_stock_torchrec():
    """Ranks whose VBE batches pool to different sizes (44 and 24 floats): table-wise trains (stock and
    tpurec equal, checked above with equal sizes); row-wise fails in the backward of TorchRec's
    variable-batch reduce-scatter, whose gloo all_gather takes equal sizes only, in stock TorchRec and
    tpurec alike (as TorchRec's harness shows for variable batch per rank: docs/dmp.md)."""
    assert run_ranks(_unequal, 2, "table_wise") == [["ok", "ok"]] * 2
    for errors in run_ranks(_unequal, 2, "row_wise"):
        assert len(errors) == 2 and all("ProcessGroupGloo::allgather: invalid tensor size" in e for e in errors), errors


def _split_and_ours(rank: int, world_size: int) -> tuple[dict, dict]:
    return (
        _train(True, rank, world_size, "column_wise", "row_wise_adagrad", "sms", split=True),
        _train(False, rank, world_size, "column_wise", "row_wise_adagrad", "sms"),
    )


@pytest.mark.slow  # two ranks, ~15 s
@pytest.mark.multiprocess
def test_sum_and_mean_tables_in_one_lookup_at_two_ranks():
    """Column-wise over 2 ranks: rank 0's lookup holds a SUM and a MEAN kernel, each filling its
    blocks of both ranks' batches in TorchRec's pre-allocated output."""
    results = run_ranks(_split_and_ours, 2)
    assert results[0][1]["groups"] == [2]  # rank 0's lookup: a SUM and a MEAN kernel
    for stock, ours in results:
        _assert_same(stock, ours)


def test_stock_refuses_sum_and_mean_tables_in_one_lookup():
    """Stock TorchRec groups SUM and MEAN tables into two FBGEMM modules, and with VBE its lookup then
    pre-allocates their output, which FBGEMM's CPU TBE refuses."""
    _ensure_process_group("cpu")
    with pytest.raises(AssertionError, match="pre-allocated vbe_output is not supported on CPU"):
        _train(True, 0, 1, "table_wise", "sgd", "sms")


@pytest.mark.parametrize("vbe", [True, False])
def test_row_wise_mean_beside_another_sharding_type_is_as_wrong_as_in_stock_torchrec(vbe):
    """A stock TorchRec bug tpurec inherits (its sharded EBC is TorchRec's): when an EBC holds a MEAN
    table row-wise (or table-row-wise), TorchRec's mean-pooling callback divides the pooled output by
    a divisor (`_create_mean_pooling_divisor`) set to 1 only for the SUM tables held row-wise, so
    tables held otherwise (here f0 and f2 table-wise, pooled by their kernels already) are divided by
    their bag lengths once more, VBE or not. With VBE the row-wise table's divisor is off too when the
    sharded EBC permutes its features (f0, f2 table-wise before f1): it reorders the inverse indices
    only when their key count differs from the KJT's. Pinned: tpurec equals stock TorchRec, and both
    differ from the unsharded EBC in f0 and f2 (and, with VBE, f1)."""
    _ensure_process_group("cpu")
    stock = _train(True, 0, 1, ("table_wise", "row_wise", "table_wise"), "sgd", "mmm", vbe=vbe)
    ours = _train(False, 0, 1, ("table_wise", "row_wise", "table_wise"), "sgd", "mmm", vbe=vbe)
    _assert_same(stock, ours)
    got, unsharded = ours["outputs"][0], _unsharded_first_output("mmm", vbe)
    for block in (slice(0, 4), slice(12, 24)):  # f0, f2
        assert (got[:, block] - unsharded[:, block]).abs().max() > 0.01
    f1 = (got[:, 4:12] - unsharded[:, 4:12]).abs().max()
    assert f1 > 0.01 if vbe else f1 < 1e-6


def test_vbe_is_refused_on_a_tpu_device():
    """Before any collective, in one line: TorchRec's VBE output path needs FBGEMM's
    batch_index_select_dim0 on the output device (CPU and CUDA kernels only)."""
    from types import SimpleNamespace

    from tpurec.errors import UserError
    from tpurec.sharding.sharder import ShardedSparseCoreEBC

    kjt = _batches(0)[0][0]
    with pytest.raises(UserError, match=r"VBE KeyedJaggedTensors\) is supported on a CPU device only: on tpu"):
        tpu = SimpleNamespace(type="tpu")  # a torch.device("tpu") needs TorchTPU
        ShardedSparseCoreEBC.input_dist(SimpleNamespace(_device=tpu), None, kjt)


def test_vbe_inputs_built_ahead_are_used(monkeypatch):
    """The SparseCore inputs built ahead of a lookup (`prepare`, the input pipeline's path; on the
    CSR path, TPUREC_NO_DIRECT=1) are built from the padded batch and found again by the lookup."""
    from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag

    _ensure_process_group("cpu")
    stock = _train(True, 0, 1, "table_wise", "row_wise_adagrad", "sms", split=True)
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    forward, hits = SparseCoreEmbeddingBag.forward, []

    def prepared_forward(self, features, *args, **kwargs):
        self.prepare(features)
        out = forward(self, features, *args, **kwargs)
        hits.append(self.prepared_hits)
        return out

    monkeypatch.setattr(SparseCoreEmbeddingBag, "forward", prepared_forward)
    ours = _train(False, 0, 1, "table_wise", "row_wise_adagrad", "sms")
    assert hits == [1, 1, 2, 2, 3, 3]  # two kernels (SUM, MEAN), three steps
    _assert_same(stock, ours)
