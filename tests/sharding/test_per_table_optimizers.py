"""Tables of one EBC given different in-backward optimizers, or one optimizer with different learning
rates (`apply_optimizer_in_backward` called per table), train under tpurec's DMP as under stock
TorchRec's: one kernel group and one fused optimizer per optimizer config, as stock has one FBGEMM
module and one `EmbeddingFusedOptimizer` per config. tpurec refused them ("different fused
optimizers") before.

Checked against stock TorchRec's DMP on FBGEMM's CPU kernel, same plan and same start: tables and
optimizer state after 5 steps (each param group's learning rate changed after step 2, as an LR
scheduler changes it), the fused optimizer's layout (optimizers, keys, param groups with their
learning rates) and which optimizer each table parameter names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from tests.sharding.dmp_cases import local_slice
from tests.sharding.multiprocess import run_ranks

TABLES = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}"]) for i in range(3)
]
KEYS = [f for t in TABLES for f in t.feature_names]
STEPS = 5
# optimizer class name and kwargs per table, as `apply_optimizer_in_backward` is called per table
CONFIGS = {
    "sgd_and_adagrad": {
        "t0": ("SGD", {"lr": 0.1}),
        "t1": ("SGD", {"lr": 0.1}),
        "t2": ("Adagrad", {"lr": 0.05}),
    },
    "sgd_two_lrs": {"t0": ("SGD", {"lr": 0.1}), "t1": ("SGD", {"lr": 0.02}), "t2": ("SGD", {"lr": 0.1})},
}


def _batches():
    gen = torch.Generator().manual_seed(20)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (len(KEYS) * 8,), generator=gen)
        values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
        upstream = torch.randn(8, 8 * len(KEYS), generator=gen)
        out.append((KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths), upstream))
    return out


def _state(model) -> dict:
    """{(param, state key): [(shard offsets, values)]} of the fused optimizer, tables included as
    ("table", key): every ShardedTensor's local shards on this rank."""
    out = {}
    for key, value in model.state_dict().items():
        out[("table", key)] = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in value.local_shards()]
    for param, entries in model.fused_optimizer.state_dict()["state"].items():
        for key, v in entries.items():
            out[(param, key)] = [(tuple(s.metadata.shard_offsets), s.tensor.clone()) for s in v.local_shards()]
    return out


def train(
    rank: int, world_size: int, dmp: str, config: str, sharding: str, steps: int = STEPS, keep_model: bool = False
) -> dict:
    """dmp "stock" / "tpurec" over the EBC with CONFIGS[config]; sharding "table_wise" (table i on
    rank i mod world) or "mixed" (t0 row-wise, the others table-wise). This rank's state after STEPS."""
    from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec

    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    # (not deep-copied after this: a copy's parameters lose their in-backward optimizer)
    for table, (cls, kwargs) in CONFIGS[config].items():
        weight = ebc.embedding_bags[table].weight
        assert isinstance(weight, torch.nn.Parameter)
        apply_optimizer_in_backward(getattr(torch.optim, cls), [weight], dict(kwargs))
    kernel = "fused" if dmp == "stock" else "customized_kernel"
    per_table = {}
    for i, t in enumerate(TABLES):
        rw = sharding == "mixed" and t.name == "t0"
        per_table[t.name] = (
            row_wise(compute_kernel=kernel) if rw else table_wise(rank=i % world_size, compute_kernel=kernel)
        )
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, per_table, world_size=world_size)})
    model: Any = (StockDMP if dmp == "stock" else tpurec.DistributedModelParallel)(
        ebc, device=torch.device("cpu"), plan=plan
    )
    assert {type(m).__name__ for m in model.modules()} >= {
        "ShardedSparseCoreEBC" if dmp == "tpurec" else "ShardedEmbeddingBagCollection"
    }
    with torch.no_grad():  # the same start for both (stock re-initialises the tables it shards)
        for i, t in enumerate(TABLES):
            full = torch.linspace(-0.5, 0.5, t.num_embeddings * t.embedding_dim).view(t.num_embeddings, -1) * (i + 1)
            for s in model.state_dict()[f"embedding_bags.{t.name}.weight"].local_shards():
                (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                s.tensor.copy_(full[r : r + nr, c : c + nc])
    per = 8 // world_size
    # which fused optimizer (by its learning rate, before the change below) each table parameter names
    marks = {
        n: [o.param_groups[0]["lr"] for o in getattr(p, "_in_backward_optimizers", [])]
        for n, p in model.named_parameters()
        if p.numel()
    }
    opt = model.fused_optimizer
    for step, (kjt, upstream) in enumerate(_batches()[:steps]):  # a global batch a step, each rank its samples
        pooled = model(local_slice(kjt, rank, world_size)).to_dict()
        out = torch.cat([pooled[f] for f in KEYS], 1)
        (out * upstream[rank * per : (rank + 1) * per]).sum().backward()
        if step == 1:  # as an LR scheduler would: each param group's own rate, applied by step()
            for k, group in enumerate(opt.param_groups):
                group["lr"] = group["lr"] * (0.5 + 0.25 * k)
            opt.step()
    return {
        "state": _state(model),
        "lrs": [g["lr"] for g in opt.param_groups],
        "names": [name for name, _ in opt.optimizers],
        "params": list(opt.params),
        "marks": marks,
        **({"model": model} if keep_model else {}),
    }


def _one_rank(dmp: str, config: str, sharding: str, steps: int = STEPS) -> dict:
    from tpurec.runtime.device import DeviceKind
    from tpurec.sharding.dmp import _ensure_process_group

    _ensure_process_group(DeviceKind.CPU)
    return train(0, 1, dmp, config, sharding, steps)


def _assert_same(ours: dict, stock: dict, layout: bool) -> None:
    # stock keys SGD tables with empty entries, which add no key here; tpurec leaves them out
    # (docs/dmp.md, "Fused optimizer state"), so the state keys match
    assert ours["state"].keys() == stock["state"].keys()
    for key, shards in stock["state"].items():
        assert [o for o, _ in ours["state"][key]] == [o for o, _ in shards], key
        for (_, got), (_, want) in zip(ours["state"][key], shards):
            # Adagrad's sums reach ~10: float32 rounding is 1e-6 there, hence the relative part
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")
    # each table parameter this rank holds names the fused optimizer of its config
    assert ours["marks"].keys() == stock["marks"].keys()
    for name, lrs in stock["marks"].items():
        assert ours["marks"][name] == pytest.approx(lrs), name
    if layout:  # one param group per FBGEMM module, in stock's order
        assert ours["lrs"] == pytest.approx(stock["lrs"])
        assert ours["names"] == stock["names"] and ours["params"] == stock["params"]


@pytest.mark.parametrize("sharding", ["table_wise", "mixed"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_per_table_optimizers_train_as_stock_torchrec(config, sharding):
    stock = _one_rank("stock", config, sharding)
    ours = _one_rank("tpurec", config, sharding)
    _assert_same(ours, stock, layout=True)
    # one fused optimizer per FBGEMM module: per config, and per sharding type (mixed: t0 row-wise)
    assert len(stock["lrs"]) == (2 if sharding == "table_wise" else 3)
    # the tables moved: an oracle that cannot pass by doing nothing
    start = _one_rank("stock", config, sharding, steps=0)["state"]
    for t in TABLES:
        (_, before), (_, after) = (
            start[("table", f"embedding_bags.{t.name}.weight")][0],
            stock["state"][("table", f"embedding_bags.{t.name}.weight")][0],
        )
        assert (after - before).abs().max() > 1e-3, t.name
    assert any(k[1] == "t2.momentum1" for k in stock["state"]) == (config == "sgd_and_adagrad")


@pytest.mark.slow  # two launches of two ranks each
@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", ["table_wise", "mixed"])
def test_per_table_optimizers_at_two_ranks_train_as_stock_torchrec(sharding):
    stock = run_ranks(train, 2, "stock", "sgd_and_adagrad", sharding)
    ours = run_ranks(train, 2, "tpurec", "sgd_and_adagrad", sharding)
    for o, s in zip(ours, stock):
        # a rank holding only SGD tables (rank 1: t1) also keys t2's state without local shards, which
        # DCP needs (tpurec/sharding/sharded_optimizer.py); stock's entries are compared by value
        extra = {k: v for k, v in o["state"].items() if k not in s["state"]}
        assert not any(extra.values()), "an entry stock lacks holds local shards"
        o["state"] = {k: v for k, v in o["state"].items() if k in s["state"]}
        _assert_same(o, s, layout=False)
    assert sum(len(v) for s in stock for k, v in s["state"].items() if k[1] == "t2.momentum1") == 1


def test_ec_tables_with_their_own_optimizers_train_as_stock_torchrec(monkeypatch):
    """An EmbeddingCollection (tpurec's EC sharder vs TorchRec's, table-wise, 1 rank): t0 in-backward
    SGD lr 0.1, t1 and t2 Adagrad lr 0.05; outputs every step and tables after 3 steps."""
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from tests.sharding import ec_cases
    from tpurec.runtime.device import DeviceKind
    from tpurec.sharding.dmp import _ensure_process_group

    real = ec_cases.apply_optimizer_in_backward

    def per_table(optim, params, kwargs):  # what build_sharded calls for all tables, split per table
        params = list(params)
        real(torch.optim.SGD, params[:1], {"lr": 0.1})
        real(torch.optim.Adagrad, params[1:], {"lr": 0.05})

    monkeypatch.setattr(ec_cases, "apply_optimizer_in_backward", per_table)
    _ensure_process_group(DeviceKind.CPU)
    torch.manual_seed(0)
    init = EmbeddingCollection(tables=ec_cases.tables()).state_dict()
    result = ec_cases.run_case(0, 1, "table_wise", "sgd", init, 3, True)
    for step, (got, want) in enumerate(zip(result["outs"], result["stock_outs"])):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=lambda m: f"step {step} {k}: {m}")
    for key, want in result["stock_tables"].items():
        torch.testing.assert_close(result["tables"][key], want, rtol=0, atol=1e-6, msg=lambda m: f"{key}: {m}")
        assert (want - init[key]).abs().max() > 1e-3, f"{key} did not move"


def checkpoint_round_trip(rank: int, world_size: int, path: str) -> dict:
    """Train 2 steps, save tables and fused optimizer state with torch.distributed.checkpoint, load
    them into a model trained 1 step (other values, same keys); this rank's state both times."""
    import torch.distributed.checkpoint as dcp

    def build(steps):
        return train(rank, world_size, "tpurec", "sgd_and_adagrad", "table_wise", steps, keep_model=True)

    saved = build(2)
    model = saved.pop("model")
    dcp.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, checkpoint_id=path)
    other = build(1)
    fresh = other.pop("model")
    sd = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    fresh.load_state_dict(sd["model"])
    fresh.fused_optimizer.load_state_dict(sd["optim"])
    return {"saved": saved["state"], "before": other["state"], "loaded": _state(fresh)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_per_table_optimizer_state_round_trips_through_dcp_at_two_ranks(tmp_path):
    for r in run_ranks(checkpoint_round_trip, 2, str(tmp_path / "ckpt")):
        assert r["loaded"].keys() == r["saved"].keys()
        for key, shards in r["saved"].items():
            for (o1, want), (o2, got), (_, before) in zip(shards, r["loaded"][key], r["before"][key]):
                assert o1 == o2 and torch.equal(got, want), key
                assert not torch.equal(before, want), key  # the load changed something
