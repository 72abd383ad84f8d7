"""The planner and the host tier: memory per tier, the tier chosen for a model too big for HBM, plan files."""

from __future__ import annotations

import json

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import CacheParams
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tpurec.cli import main
from tpurec.planner import plan_io
from tpurec.planner import report as R
from tpurec.planner.hit_rate import estimate
from tpurec.planner.host_tier_choice import HOST_TIER_KERNEL, host_tier_tables
from tpurec.planner.hot_rows import HotRows, curve_points
from tpurec.planner.id_limits import plan_layout
from tpurec.planner.planners import plan
from tpurec.planner.topology import make_topology


def _ebc(rows=1000, dim=16):
    cfg = EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])
    return EmbeddingBagCollection(tables=[cfg], device=torch.device("meta"))


def _on_host(load_factor, algorithm=CacheAlgorithm.LRU):
    cache = CacheParams(load_factor=load_factor, algorithm=algorithm)
    return {
        "t": ParameterConstraints(compute_kernels=[HOST_TIER_KERNEL], cache_params=cache, sharding_types=["table_wise"])
    }


def test_a_host_tier_table_counts_its_cache_on_the_device_and_itself_in_host_memory():
    """1,000 x 16, row-wise Adagrad, cache 0.1, on v6e-4 (2 SparseCores: rows padded to 16), batch 8."""
    topo = make_topology("v6e-4")
    made = plan(_ebc(), topo, batch_size=8, constraints=_on_host(0.1), optimizer="rowwise_adagrad")
    [(_, module_plan)] = made.plan.items()
    assert host_tier_tables(module_plan) == {"t": CacheParams(load_factor=0.1, algorithm=CacheAlgorithm.LRU)}
    from tpurec.data.catalog import TableSpec

    spec = TableSpec("t", "f", 1000, 16, 1.0)
    report = R.build_report(made, [spec], topo.spec, batch_size=8, optimizer="rowwise_adagrad")
    [row] = report["tables"]
    # the cache: 100 rows, padded to 112; weights 112 x 16 x 4, state 112 x 4, the same buffers (832: 32
    # samples, the worst case) and activations (2 x 32 x 16 x 4) as the resident table, and the update's
    # transient copy of the cache's weights and state
    assert row["bytes"] == 7_168 + 448 + 832 + 4_096 + (7_168 + 448) == 20_160
    # in host memory: every row and its state, unpadded: 1,000 x (16 x 4 + 4)
    assert row["host_bytes"] == 68_000
    assert (row["tier"], row["cache_rows"], row["load_factor"], row["cache_algorithm"]) == ("host", 100, 0.1, "lru")
    rank = row["ranks"][0]
    device = report["devices"][rank]
    assert device["host_tier_bytes"] == 68_000 and device["host_capacity_bytes"] == 192 * 2**30  # v6e: 1536 GiB / 8
    assert device["host_used_bytes"] == 68_000 + 48 * 2**30  # a quarter kept for the rest of the host
    # resident, the same table takes 1,008 padded rows: 64,512 + 4,032 + 832 + 4,096 + 68,544
    tw = {"t": ParameterConstraints(sharding_types=["table_wise"])}
    resident = plan(_ebc(), topo, batch_size=8, constraints=tw, optimizer="rowwise_adagrad")
    rrow = R.build_report(resident, [spec], topo.spec, batch_size=8, optimizer="rowwise_adagrad")["tables"][0]
    assert rrow["bytes"] == 142_016 and rrow["tier"] == "hbm" and "host_bytes" not in rrow
    # what TorchRec's partitioner is given: HBM the cache, host DDR the table (estimators.shard_storage)
    from tpurec.planner.estimators import TpuStorageEstimator
    from tpurec.planner.planners import TpuEnumerator, planning_sharders

    est = TpuStorageEstimator(topo, None, "rowwise_adagrad", host_tier={"t": CacheParams(load_factor=0.1)})
    options = TpuEnumerator(topology=topo, batch_size=8, estimator=[est]).enumerate(_ebc(), planning_sharders())
    tw = next(o for o in options if o.sharding_type == "table_wise")
    assert (tw.shards[0].storage.hbm, tw.shards[0].storage.ddr) == (20_160, 68_000)


def test_on_cpu_ranks_both_tiers_share_the_ranks_memory():
    """A cpu-1 rank (4 emulated SparseCores: rows padded to 32, no transient): its cache and its host
    rows are both in the rank's one memory."""
    topo = make_topology("cpu-1")
    made = plan(_ebc(), topo, batch_size=8, constraints=_on_host(0.1), optimizer="rowwise_adagrad")
    from tpurec.data.catalog import TableSpec

    r = R.build_report(
        made,
        [TableSpec("t", "f", 1000, 16, 1.0)],
        topo.spec,
        batch_size=8,
        optimizer="rowwise_adagrad",
        compute_device="cpu",
    )
    [row], [device] = r["tables"], r["devices"]
    # the cache: 100 rows padded to 128 (4 SparseCores x 8): weights 8,192 and state 512; the buffers of 8
    # samples' worst case (8 ids a partition: per SparseCore 8 row pointers x 4 + 32 COO slots x 12 = 416,
    # x 4 = 1,664); activations 2 x 8 x 16 x 4 = 1,024; no transient (updated in place)
    assert row["bytes"] == 8_192 + 512 + 1_664 + 1_024 == 11_392
    assert row["host_bytes"] == 68_000
    assert device["hbm_used_bytes"] == 11_392 + 68_000  # both tiers in the rank's memory (no reservation here)
    assert device["host_capacity_bytes"] == device["hbm_capacity_bytes"]


# Five 128-wide tables, row-wise Adagrad (516 bytes a row; twice on a TPU with the update's transient).
BIG = [("t0", 24_000_000), ("t1", 12_000_000), ("t2", 6_000_000), ("t3", 3_000_000), ("t4", 1_500_000)]


def _big_tables(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps([{"name": n, "rows": r, "dim": 128} for n, r in BIG]))
    return path


def _zipf_curve(rows: int, a: float = 1.05) -> HotRows:
    """The continuous Zipf law tpurec data synth draws from: the top k rows get
    ((k + 1)^(1 - a) - 1) / ((rows + 1)^(1 - a) - 1) of the ids."""
    top = (rows + 1.0) ** (1 - a) - 1
    points = curve_points(rows)
    return HotRows(10**9, 1.0, rows, tuple(points), tuple(((k + 1.0) ** (1 - a) - 1) / top for k in points))


def _limits_with_curve(tmp_path, curve: HotRows) -> str:
    """A limits file for v6e-1 at batch 256 whose t0 carries `curve` (as `tpurec data stats` writes it)."""
    tables: dict[str, dict] = {n: {"max_ids_per_partition": 256, "max_unique_ids_per_partition": 256} for n, _ in BIG}
    tables["t0"]["hot_rows"] = curve.to_json()
    doc = {"format": "tpurec-id-limits", "version": 1, "layout": plan_layout("v6e-1", 256), "tables": tables}
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_model_half_again_over_hbm_is_planned_onto_the_host_tier_largest_table_first(tmp_path, capsys):
    """46.5 M rows x 516 bytes x 2 (the update's transient) = 47.99 GB against 29.8 GiB of v6e-1 HBM,
    28.3 GiB once 5% is kept: 1.58x over. Refused without the host tier; with it, t0 (the largest) moves to
    host memory behind a cache from its hot-row curve, and the plan prints tier, cache and hit rate."""
    tables = _big_tables(tmp_path)
    need = sum(r for _, r in BIG) * (128 * 4 + 4) * 2
    free = 32 * 10**9 * 0.95
    assert need / free >= 1.5
    assert main(["plan", "--tables", str(tables), "--topology", "v6e-1", "--host-tier", "off"]) == 2
    capsys.readouterr()
    curve = _zipf_curve(24_000_000, 1.2)
    out = tmp_path / "plan.json"
    limits = _limits_with_curve(tmp_path, curve)
    args = ["plan", "--tables", str(tables), "--topology", "v6e-1", "--limits", limits]
    assert main([*args, "--format", "json", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    tiers = {t["name"]: t["tier"] for t in report["tables"]}
    assert tiers == {"t0": "host", "t1": "hbm", "t2": "hbm", "t3": "hbm", "t4": "hbm"}
    t0 = next(t for t in report["tables"] if t["name"] == "t0")
    # the smallest load factor whose expected LRU hit rate reaches 90%: 0.05 (1.2 M rows, 92.6%) for
    # Zipf(1.2) ids, 256 a batch (0.02: 89.6%)
    assert (t0["load_factor"], t0["cache_rows"], t0["cache_algorithm"]) == (0.05, 1_200_000, "lru")
    assert t0["expected_hit_rate"] == round(estimate(curve, 1_200_000, 256).hit_rate, 4)
    assert t0["expected_hit_rate"] >= 0.9 > estimate(curve, 480_000, 256).hit_rate  # (0.02's cache: short of it)
    assert t0["host_bytes"] == 24_000_000 * 516 == 12_384_000_000
    assert report["fits"] is True
    # the saved report keeps the cache: `plan show` recomputes the same figures from it
    assert R.report_from_file(out) == report
    assert main([*args]) == 0
    text = capsys.readouterr().out
    assert "host tier: 1 table(s) in host memory" in text
    assert "(the host tier runs on the TPU path, tested on the emulated TPU; not yet measured on a chip" in text
    assert "t0           cache 1,200,000 of 24,000,000 rows (load factor 0.05, lru), host 11.53 GiB" in text
    assert f"expected hit rate {t0['expected_hit_rate']:.1%}" in text
    line = next(row for row in text.splitlines() if row.startswith("t0 "))
    assert line.split()[-3:] == ["host", "1,200,000", f"{t0['expected_hit_rate']:.1%}"]
    # `plan diff` against the resident plan of the same tables on a slice where they fit names the move
    resident = tmp_path / "resident.json"
    assert (
        main(["plan", "--tables", str(tables), "--topology", "v6e-4", "--format", "json", "--out", str(resident)]) == 0
    )
    capsys.readouterr()
    assert main(["plan", "diff", str(resident), str(out)]) == 0
    assert "(tier hbm -> host, cache 1,200,000 rows)" in capsys.readouterr().out


def test_without_a_curve_the_cache_is_the_default_fifth_and_the_hit_rate_unknown(tmp_path):
    report = R.plan_tables(
        [R.TableSpec(n, n, r, 128, 1.0) for n, r in BIG],
        "v6e-1",
        batch_size=256,
        optimizer="rowwise_adagrad",
        host_tier="auto",
    )
    t0 = next(t for t in report["tables"] if t["name"] == "t0")
    assert (t0["tier"], t0["load_factor"], t0["cache_rows"], t0["expected_hit_rate"]) == ("host", 0.2, 4_800_000, None)
    assert [t["tier"] for t in report["tables"] if t["name"] != "t0"] == ["hbm"] * 4


def test_mlperf_dcnv2_refused_on_v5p_8_with_adam_now_plans_onto_the_host_tier(capsys):
    assert main(["plan", "--model", "mlperf-dcnv2", "--topology", "v5p-8", "--optimizer", "adam"]) == 0
    text = capsys.readouterr().out
    assert "fits: yes" in text and "host tier: 3 table(s)" in text


@pytest.mark.parametrize("algorithm", [CacheAlgorithm.LRU, CacheAlgorithm.LFU])
def test_a_saved_plan_keeps_each_tables_cache_params(tmp_path, algorithm):
    made = plan(_ebc(), make_topology("cpu-2"), batch_size=8, constraints=_on_host(0.25, algorithm))
    path = tmp_path / "p.json"
    plan_io.save_plan(made, path)
    doc = json.loads(path.read_text())
    assert doc["modules"][""]["t"]["cache_params"] == {"load_factor": 0.25, "algorithm": algorithm.name}
    back = plan_io.load_plan(path)
    assert back.plan == made.plan
    assert host_tier_tables(back.plan[""]) == {"t": CacheParams(load_factor=0.25, algorithm=algorithm)}
    # a bad hand edit is one line naming the field
    doc["modules"][""]["t"]["cache_params"]["load_factor"] = 1.5
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"cache_params\.load_factor.*a load factor in \(0, 1\]"):
        plan_io.load_plan(path)
