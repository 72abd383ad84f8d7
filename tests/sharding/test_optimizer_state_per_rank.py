"""`model.fused_optimizer` at world > 1 against stock TorchRec's DMP (FBGEMM's fused kernel) on the
same model, plan and batches: each rank keys only the tables it holds a shard of, with stock's
param and state keys, ShardedTensor global metadata (every shard's offsets, sizes and placement),
local shards, and values after training.

Kept differences, both for torch.distributed.checkpoint (tpurec/sharding/sharded_optimizer.py):
SGD tables get no empty state entry (stock's `{}` entry is a tensor-less leaf in dcp.load's pre-2.4
re-flattening, which a rank lacking some table's shard triggers: `dcp_with_dense_optimizer` shows
stock failing there), and a rank whose own tables leave it no state tensor (none held, or SGD only)
keys the other tables' state without local shards (stock keys none; tests/sharding/
test_dmp_checkpoint.py). Adam: stock cannot run it on CPU, so its
states are checked against the rule stock applies (pointwise, the table's own sharding).
"""

from __future__ import annotations

import pytest
import torch

from . import optstate_cases as c
from .multiprocess import run_ranks

SHARDINGS = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
OPTIMS = ["sgd", "rowwise_adagrad", "adam"]


def _metadata(d: dict) -> tuple:
    return d["size"], d["global"], [(o, s) for o, s, _ in d["local"]]


def _assert_values_close(ours: dict, stock: dict, what: str) -> None:
    assert len(ours["local"]) == len(stock["local"]), what
    for (o1, _, a), (o2, _, b) in zip(ours["local"], stock["local"]):
        assert o1 == o2, what
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def _check(ranks: list[dict], shardings: list[str]) -> int:
    """Assert tpurec's per-rank fused optimizer is stock's; returns how many local shards were compared."""
    compared = 0
    for rank, results in enumerate(ranks):
        for sharding in shardings:
            for name in OPTIMS:
                ours = results[(sharding, name, False)]
                where = f"rank {rank} {sharding} {name}"
                if name == "adam":
                    # stock's rule: held tables only; momentum1 and exp_avg_sq shaped and sharded as the
                    # table (the weight ShardedTensor of stock's own model under the same plan)
                    stock_tables = results[(sharding, "sgd", True)]["tables"]
                    held = [k for k, v in stock_tables.items() if v["local"]]
                    assert sorted(ours["params"]) == sorted(held), where
                    for key in held:
                        t = key.split(".")[1]
                        entry = ours["state"][key]
                        assert sorted(entry) == sorted([f"{t}.momentum1", f"{t}.exp_avg_sq", f"{t}.step"]), where
                        for s in ("momentum1", "exp_avg_sq"):
                            assert _metadata(entry[f"{t}.{s}"]) == _metadata(stock_tables[key]), f"{where} {t}.{s}"
                            compared += len(entry[f"{t}.{s}"]["local"])
                    continue
                stock = results[(sharding, name, True)]
                assert ours["params"] == stock["params"], where
                assert stock["params"], f"{where}: stock holds no table here (nothing compared)"
                for key in stock["params"]:
                    assert _metadata(ours["weights"][key]) == _metadata(stock["weights"][key]), f"{where} {key}"
                    _assert_values_close(ours["weights"][key], stock["weights"][key], f"{where} {key}")
                if name == "sgd":  # the kept difference: no empty entries
                    assert all(v == {} for v in stock["state"].values()) and len(stock["state"]) == len(stock["params"])
                    assert ours["state"] == {}, where
                    continue
                assert list(ours["state"]) == list(stock["state"]), where
                for key, entry in stock["state"].items():
                    assert sorted(ours["state"][key]) == sorted(entry), f"{where} {key}"
                    for k, v in entry.items():
                        assert _metadata(ours["state"][key][k]) == _metadata(v), f"{where} {k}"
                        _assert_values_close(ours["state"][key][k], v, f"{where} {k}")
                        compared += len(v["local"])
    return compared


@pytest.mark.multiprocess
def test_fused_optimizer_state_per_rank_is_stocks_at_two_ranks():
    ranks = run_ranks(c.fused_state, 2, SHARDINGS, OPTIMS, 2)
    # table-wise: rank 0 holds t0 and t2, rank 1 t1; the others: a shard of every table on each rank
    assert ranks[0][("table_wise", "rowwise_adagrad", False)]["params"] == [
        "embedding_bags.t0.weight",
        "embedding_bags.t2.weight",
    ]
    assert ranks[1][("table_wise", "rowwise_adagrad", False)]["params"] == ["embedding_bags.t1.weight"]
    assert _check(ranks, SHARDINGS) >= 2 * 3 * 3


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fused_optimizer_state_per_rank_is_stocks_at_four_ranks():
    ranks = run_ranks(c.fused_state, 4, SHARDINGS, OPTIMS, 2)
    # table-wise over 4 ranks: rank 3 holds no table, and so keys every table without local shards
    ours = ranks[3][("table_wise", "rowwise_adagrad", False)]
    assert not ranks[3][("table_wise", "rowwise_adagrad", True)]["params"]
    assert sorted(ours["params"]) == [f"embedding_bags.t{i}.weight" for i in range(3)]
    assert all(not v["local"] for e in ours["state"].values() for v in e.values())
    _check(ranks, ["row_wise", "column_wise", "table_row_wise"])
    held = [r[("table_wise", "rowwise_adagrad", False)]["params"] for r in ranks[:3]]
    assert held == [["embedding_bags.t0.weight"], ["embedding_bags.t1.weight"], ["embedding_bags.t2.weight"]]


@pytest.mark.slow  # two spawns, ~20 s
@pytest.mark.multiprocess
def test_dcp_load_next_to_a_dense_optimizer_where_stocks_empty_sgd_entries_fail(tmp_path):
    """Stock keys its SGD table t0 with an empty entry; dcp.load then fails on rank 0 (its state_dict
    lacks t1's shard, so DCP re-flattens the pre-2.4 way, where `{}` is a key of its own)."""
    ours = run_ranks(c.dcp_with_dense_optimizer, 2, str(tmp_path / "ours"), False)
    stock = run_ranks(c.dcp_with_dense_optimizer, 2, str(tmp_path / "stock"), True)
    assert [r["load"] for r in ours] == ["ok", "ok"]
    assert "Missing key in checkpoint state_dict: optim.state.embedding_bags.t0.weight" in stock[0]["load"]
    assert ours[0]["keys"] == ["embedding_bags.t2.weight"] and stock[0]["keys"] == [
        "embedding_bags.t0.weight",
        "embedding_bags.t2.weight",
    ]
    assert [r["keys"] for r in ours[1:]] == [r["keys"] for r in stock[1:]] == [["embedding_bags.t1.weight"]]


def _groups_on(held: list[str], specs: dict[str, str]) -> list[tuple[str | None, list[str]]]:
    """`optimizer_groups` of a table-wise sharded module over 4 ranks, on the rank holding `held`
    (each table in a kernel module of its own optimizer); specs: table -> its fused optimizer."""
    from types import SimpleNamespace

    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from tpurec.embedding.optimizers.registry import spec_from_fused_params
    from tpurec.sharding.sharded_optimizer import optimizer_groups

    kinds = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD}
    fused = {t: {"optimizer": kinds[k], "learning_rate": 0.1} for t, k in specs.items()}
    modules = {}
    for t, k in specs.items():
        modules[k] = SimpleNamespace(kernel=SimpleNamespace(optimizer=spec_from_fused_params(fused[t], t)))
    infos = [SimpleNamespace(embedding_config=SimpleNamespace(name=t), fused_params=fused[t]) for t in specs]
    sharded = SimpleNamespace(
        _sc_shards=lambda: [(t, f"{t}/0", None, modules[specs[t]]) for t in held],
        sharding_type_to_sharding_infos={"table_wise": infos},
        _sc_tables=list(specs),
        module_sharding_plan={t: SimpleNamespace(sharding_type="table_wise") for t in specs},
    )
    return [(type(spec).__name__ if spec else None, tables) for spec, tables in optimizer_groups(sharded)]


def test_each_rank_keys_its_own_tables_and_a_rank_without_state_keys_the_others():
    adagrad = {"t0": "rowwise_adagrad", "t1": "rowwise_adagrad", "t2": "rowwise_adagrad"}
    assert _groups_on(["t1"], adagrad) == [("RowWiseAdagradSpec", ["t1"])]
    assert _groups_on(["t0", "t2"], adagrad) == [("RowWiseAdagradSpec", ["t0", "t2"])]
    # rank 3 of 4 holds no table: it keys every table (their state without local shards), for DCP
    assert _groups_on([], adagrad) == [("RowWiseAdagradSpec", ["t0", "t1", "t2"])]
    # a rank holding only an SGD table keys the tables with state besides it
    mixed = {"t0": "sgd", "t1": "rowwise_adagrad", "t2": "rowwise_adagrad"}
    assert _groups_on(["t0"], mixed) == [("SGDSpec", ["t0"]), ("RowWiseAdagradSpec", ["t1", "t2"])]
    assert _groups_on(["t1"], mixed) == [("RowWiseAdagradSpec", ["t1"])]
