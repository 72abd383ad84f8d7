"""`tpurec train --host-tier`: tables in host memory behind a cache of their rows (docs/host_tier.md),
end to end as a user runs it, against the resident run and against the planner's expected hit rate."""

from __future__ import annotations

import json

import pytest

from tpurec.cli import main

from .helpers import train, train_here, train_losses


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


@pytest.fixture(scope="module")
def zipf_data(tmp_path_factory):
    """40,000 dlrm-tiny rows: each table's ids Zipf(1.1)-distributed over its rows (tpurec data synth)."""
    out = tmp_path_factory.mktemp("zipf")
    assert main(["data", "synth", "--rows", "40000", "--out", str(out / "data"), "--quiet"]) == 0
    return out / "data"


def test_the_planners_expected_hit_rate_is_within_5_points_of_the_measured_one(zipf_data, cache, tmp_path, capsys):
    """t_C3 (1,000 rows, 999 of them used) on the host tier with an LRU cache of 20% of its rows, batch 256:
    `tpurec data stats` measures its hot-row curve, `tpurec plan` expects a hit rate from it, and 300 steps
    of `tpurec train` (and their evaluation, at the same batch) measure one: 50.5% against 49.9%."""
    limits, report = tmp_path / "limits.json", tmp_path / "plan.json"
    common = ["--model", "dlrm-tiny", "--topology", "cpu-1", "--batch-size", "256"]
    assert main(["data", "stats", str(zipf_data), *common, "--out", str(limits), "--quiet"]) == 0
    plan = ["plan", *common, "--limits", str(limits), "--host-tier", "t_C3:0.2:lru"]
    assert main([*plan, "--format", "json", "--out", str(report)]) == 0
    row = next(t for t in json.loads(report.read_text())["tables"] if t["name"] == "t_C3")
    assert (row["tier"], row["cache_rows"], row["cache_algorithm"]) == ("host", 200, "lru")
    expected = row["expected_hit_rate"]
    result, _, err = train_here(
        capsys, "--data", zipf_data, "--batch-size", 256, "--steps", 300, "--host-tier", "t_C3:0.2:lru",
        "--curves-out", "none", cache=cache,
    )  # fmt: skip
    measured = result["host_tier"]["t_C3"]
    assert (measured["rows"], measured["cache_rows"], measured["algorithm"]) == (1000, 200, "lru")
    # every batch's distinct rows are counted: 300 training batches and the evaluation's
    assert measured["hits"] + measured["misses"] > 300 * 100
    assert measured["evictions"] >= measured["misses"] - 200  # a full cache evicts a row per miss
    assert abs(measured["hit_rate"] - expected) < 0.05, (expected, measured)
    assert 0.3 < measured["hit_rate"] < 0.7  # a test of the model, not of a cache that always or never hits
    assert "host tier: t_C3 " in err and "cache 200 of 1,000 rows, lru" in err


def test_host_tier_training_gives_the_resident_runs_losses_and_a_saved_plan_runs_it_again(
    zipf_data, cache, tmp_path, capsys
):
    """Two tables on the host tier (LFU at 30%, LRU at the default 20%): every training loss and the final
    evaluation equal the resident run's; the plan saved keeps their caches and trains the same again."""
    common = ["--data", zipf_data, "--batch-size", 256, "--steps", 60, "--eval-every", 30, "--curves-out", "none"]

    def run(*args) -> dict:  # in this process: the three runs import torch and TorchRec once
        result, _, _ = train_here(capsys, *common, *args, cache=cache)
        assert result is not None
        return result

    resident = run("--metrics-out", tmp_path / "a.jsonl")
    tiered = run(
        "--metrics-out", tmp_path / "b.jsonl", "--host-tier", "t_C1:0.3:lfu,t_C3", "--save-plan", tmp_path / "p.json"
    )
    assert len(train_losses(tmp_path / "a.jsonl")) == 60
    assert train_losses(tmp_path / "b.jsonl") == train_losses(tmp_path / "a.jsonl")
    assert (tiered["auc"], tiered["logloss"]) == (resident["auc"], resident["logloss"])
    assert "host_tier" not in resident
    figures = tiered["host_tier"]
    assert (figures["t_C1"]["cache_rows"], figures["t_C1"]["algorithm"]) == (300, "lfu")
    assert (figures["t_C3"]["cache_rows"], figures["t_C3"]["algorithm"]) == (200, "lru")
    saved = json.loads((tmp_path / "p.json").read_text())["modules"]
    [module] = saved.values()
    assert module["t_C1"]["cache_params"] == {"load_factor": 0.3, "algorithm": "LFU"}
    assert module["t_C3"]["cache_params"] == {"load_factor": None, "algorithm": None}  # FBGEMM's defaults
    assert "cache_params" not in module["t_C2"]
    again = run("--metrics-out", tmp_path / "c.jsonl", "--plan", tmp_path / "p.json")
    assert train_losses(tmp_path / "c.jsonl") == train_losses(tmp_path / "a.jsonl")
    assert again["host_tier"] == figures  # the plan's tables on the host tier, the same caches, the same batches


@pytest.mark.slow  # two emulated runs: about 40 s
@pytest.mark.multiprocess
def test_on_an_emulated_tpu_the_host_tier_trains_the_resident_runstrain_losses(zipf_data, cache, tmp_path):
    """`tpurec train --emulate-tpu v5e-1` (the TPU path, its TensorCore kernel) with t_C1 (LFU, 30%) and t_C3
    (LRU, 20%) on the host tier, their caches on the emulated device: the resident run's 30 losses and
    evaluation within 1e-6. dlrm-tiny's bags hold one id each, so no bag sums rows in an order that
    follows the cache slots, and each row's gradient sums its entries in sample order whatever its slot
    (bit for bit); but the update's optimizer works on as many rows as each stack's unique-id limit, which
    differs between the runs, and XLA's CPU backend compiles row-wise Adagrad over fewer than 256 rows
    differently (the last bit of a few rows: found in session 32). Every copy shape was compiled before
    the first step."""
    common = ["--emulate-tpu", "v5e-1", "--data", zipf_data, "--batch-size", 256, "--steps", 30, "--eval-every", 15]
    common += ["--curves-out", "none"]
    resident, _ = train(*common, "--metrics-out", tmp_path / "a.jsonl", cache=cache)
    tiered, _ = train(*common, "--metrics-out", tmp_path / "b.jsonl", "--host-tier", "t_C1:0.3:lfu,t_C3", cache=cache)
    assert tiered["emulated_tpu"] == "v5e-1" and tiered["world_size"] == 1
    # the plan's HBM figure for the device; the emulated device's allocator gives no reading
    assert tiered["hbm"]["planned_bytes"] > 0 and tiered["hbm"]["in_use_bytes"] is None
    assert len(train_losses(tmp_path / "a.jsonl")) == 30
    assert train_losses(tmp_path / "b.jsonl") == pytest.approx(train_losses(tmp_path / "a.jsonl"), rel=1e-6, abs=0)
    assert tiered["auc"] == pytest.approx(resident["auc"], abs=1e-6)
    assert tiered["logloss"] == pytest.approx(resident["logloss"], rel=1e-6)
    figures = tiered["host_tier"]
    assert (figures["t_C1"]["cache_rows"], figures["t_C1"]["algorithm"]) == (300, "lfu")
    assert (figures["t_C3"]["cache_rows"], figures["t_C3"]["algorithm"]) == (200, "lru")
    assert all(f["evictions"] > 0 and f["writebacks"] > 0 for f in figures.values())
    # the copies' shapes, all compiled when the caches were made: none new after warm-up
    assert tiered["recompiles_after_warmup"] == 0, tiered["recompiled_ops"]
    assert tiered["programs_compiled"]["tensorcore"] > resident["programs_compiled"]["tensorcore"]
    # a batch's write-backs of a table (rows and state together) are one device->host copy: at most one
    # per host-tier table a step beyond the resident run's (4.86 a step before they were packed)
    extra = tiered["device_to_host_copies_per_step"] - resident["device_to_host_copies_per_step"]
    assert 0 < extra <= 2, (tiered["device_to_host_copies"], resident["device_to_host_copies"])


@pytest.mark.slow  # a plan and two runs of four emulated ranks: about 70 s
@pytest.mark.multiprocess
def test_a_row_wise_host_tier_table_on_four_emulated_tpu_ranks_trains_as_resident_on_the_same_plan(cache, tmp_path):
    """`tpurec train --emulate-tpu v5e-4 --plan P`: t_C3 row-wise over the four ranks, each rank's shard on
    the host tier (LRU, 60% of its 250 rows: evicting), against the same plan with t_C3 resident. A plan
    made for the host tier is another plan (the planner's problem differs): the same plan for both runs,
    its cache_params dropped for the resident one. Every loss within 2e-7 (float32 summation order)."""
    common = ["--model", "dlrm-tiny", "--topology", "v5e-4", "--batch-size", "512", "--format", "json"]
    tiered_plan = tmp_path / "tiered.json"
    assert main(["plan", *common, "--host-tier", "t_C3:0.6:lru", "--out", str(tiered_plan)]) == 0
    doc = json.loads(tiered_plan.read_text())
    t_c3 = doc["plan"]["modules"][""]["t_C3"]
    assert t_c3["sharding_type"] == "row_wise" and len(t_c3["ranks"]) == 4
    t_c3.pop("cache_params")
    resident_plan = tmp_path / "resident.json"
    resident_plan.write_text(json.dumps(doc))
    runs = {}
    for name, plan in (("resident", resident_plan), ("tiered", tiered_plan)):
        args = ["--emulate-tpu", "v5e-4", "--plan", plan, "--batch-size", 512, "--steps", 20, "--seed", 3]
        args += ["--synth-rows", 20000, "--curves-out", "none", "--metrics-out", tmp_path / f"{name}.jsonl"]
        runs[name], _ = train(*args, cache=cache, timeout=900)
    assert runs["tiered"]["world_size"] == 4 and "host_tier" not in runs["resident"]
    figures = runs["tiered"]["host_tier"]["t_C3"]
    assert figures["cache_rows"] == 600 and figures["evictions"] > 0 and figures["writebacks"] > 0
    want = train_losses(tmp_path / "resident.jsonl")
    assert len(want) == 20 and train_losses(tmp_path / "tiered.jsonl") == pytest.approx(want, rel=0, abs=2e-7)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--host-tier", "auto", "--device", "cpu"], "--host-tier auto moves tables off a TPU's HBM (--device tpu"),
        (["--host-tier", "t_C3:0", "--device", "cpu"], "load factor '0' of t_C3 is not a number in (0, 1]"),
        (["--host-tier", "t_C3:0.2:fifo"], "eviction 'fifo' of t_C3 is not lru or lfu"),
        (["--host-tier", "t_C3", "--zch"], "--zch's managed-collision tables are not on the host tier yet"),
    ],
)
def test_a_host_tier_flag_the_run_cannot_take_is_one_line(flags, message, cache, capsys):
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_table_the_model_lacks_is_named_with_the_models_tables(zipf_data, cache, capsys):
    _, code, err = train_here(
        capsys, "--data", zipf_data, "--steps", 2, "--host-tier", "t_C99", cache=cache, check=False
    )
    assert code == 2
    assert "--host-tier: no table t_C99 in the model (its tables: t_C1, t_C2" in err


@pytest.mark.slow  # an emulated rank: about 25 s
def test_host_tier_auto_on_a_tpu_plans_and_says_what_it_moved(zipf_data, cache):
    """`--host-tier auto` is DMP's host_tier="auto" on a TPU rank (the emulated v5e here): dlrm-tiny fits
    the chip's HBM, so it moves nothing and says so; the run trains as usual (what auto moves when a model
    does not fit: tests/sharding/test_host_tier_dmp.py)."""
    result, p = train(
        "--data", zipf_data, "--batch-size", 256, "--steps", 4, "--emulate-tpu", "v5e-1", "--host-tier", "auto",
        "--curves-out", "none", cache=cache,
    )  # fmt: skip
    assert "--host-tier auto: no table (all fit the HBM) on the host tier" in p.stderr
    assert "host_tier" not in result and result["steps"] == 4


MULTI_HOT = "tests/dlrm/multi_hot_model.py:build"


def test_the_expected_hit_rate_holds_for_a_multi_hot_table_within_5_points(cache, tmp_path, capsys):
    """t_multi (20,000 rows, 10 Zipf ids a sample, as MLPerf's multi-hot tables are read) on the host tier
    with an LRU cache of 20% of its rows, batch 256: the planner's expected hit rate from `data stats`'
    hot-row curve against 300 steps of `tpurec train --model-module`."""
    data, limits, report = tmp_path / "data", tmp_path / "limits.json", tmp_path / "plan.json"
    assert main(["data", "synth", "--model-module", MULTI_HOT, "--rows", "20000", "--out", str(data), "--quiet"]) == 0
    common = ["--model-module", MULTI_HOT, "--topology", "cpu-1", "--batch-size", "256"]
    assert main(["data", "stats", str(data), *common, "--out", str(limits), "--quiet"]) == 0
    plan = ["plan", *common, "--limits", str(limits), "--host-tier", "t_multi:0.2:lru"]
    assert main([*plan, "--format", "json", "--out", str(report)]) == 0
    row = next(t for t in json.loads(report.read_text())["tables"] if t["name"] == "t_multi")
    assert (row["tier"], row["cache_rows"]) == ("host", 4000)
    expected = row["expected_hit_rate"]
    args = ["--model-module", MULTI_HOT, "--data", data, "--batch-size", 256, "--steps", 300]
    result, _, _ = train_here(capsys, *args, "--host-tier", "t_multi:0.2:lru", "--curves-out", "none", cache=cache)
    measured = result["host_tier"]["t_multi"]
    assert measured["evictions"] > 0  # a full cache: the planner's figure is its steady state
    assert abs(measured["hit_rate"] - expected) < 0.05, (expected, measured)
    assert 0.2 < measured["hit_rate"] < 0.9
