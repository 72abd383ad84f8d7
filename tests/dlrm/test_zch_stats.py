"""`tpurec data stats --zch` (issue #38): id limits counted after `tpurec train --zch`'s remap, checked
against the demand the kernels of a `tpurec train --zch` run on the same data counted themselves
(`--limits-out`); and `train --limits` refusing limits measured with(out) another remap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.reliability.inproc import assert_refused, run_cli

from .helpers import REPO, train

FIGURES = ("max_ids", "max_unique_ids", "max_ids_per_slice", "max_unique_ids_per_slice", "max_ids_per_sample")
LIMITS = ("max_ids_per_partition", "max_unique_ids_per_partition", "max_ids_per_slice", "max_unique_ids_per_slice")
BATCH, STEPS, INTERVAL = 64, 10, 3


@pytest.fixture(scope="module")
def raw_ids(tmp_path_factory):
    out = tmp_path_factory.mktemp("zipf") / "data"
    synth = ["data", "synth", "--raw-ids", "--rows", "2000", "--out", str(out), "--quiet"]
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *synth],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return out


def _stats(raw_ids, out, capsys, *flags) -> dict:
    code, _, err = run_cli(
        ["data", "stats", raw_ids, "--model", "dlrm-tiny", "--batch-size", BATCH, "--out", out, "--quiet", *flags],
        capsys,
    )
    assert code == 0, err
    return json.loads(out.read_text())


def _trained_demand(raw_ids, tmp_path, *flags, nproc: int = 1) -> dict:
    seen = tmp_path / "seen.json"
    launch = ["--nproc", nproc] if nproc > 1 else []
    train(
        "--data", raw_ids, "--zch", "--batch-size", BATCH, "--eval-every", 0, "--curves-out", "none",
        "--limits-out", seen, *launch, *flags, cache=tmp_path / "cache",
    )  # fmt: skip
    return json.loads(seen.read_text())


def _assert_same_demand(seen: dict, stats: dict, steps: int) -> None:
    assert stats["zch"] == seen["zch"]
    assert stats["batches"] == steps
    assert set(stats["tables"]) == set(seen["tables"])
    for name, t in seen["tables"].items():
        mine = stats["tables"][name]
        assert t["observed"]["batches"] == steps
        assert [mine["observed"][k] for k in FIGURES] == [t["observed"][k] for k in FIGURES], name
        assert [mine[k] for k in LIMITS] == [t[k] for k in LIMITS], name


def test_zch_limits_are_the_demand_the_kernels_of_a_zch_run_count(raw_ids, tmp_path, capsys):
    seen = _trained_demand(raw_ids, tmp_path, "--steps", STEPS, "--zch-eviction-interval", INTERVAL)
    stats = _stats(
        raw_ids, tmp_path / "zch.json", capsys, "--topology", "cpu-1", "--zch",
        "--steps", STEPS, "--zch-eviction-interval", INTERVAL,
    )  # fmt: skip
    assert stats["zch"] == {"eviction": "lru", "eviction_interval": INTERVAL}
    _assert_same_demand(seen, stats, STEPS)

    # They must differ from the raw ids' (hashed modulo the tables at read time, as `train` without --zch
    # reads them): the remap admits ids only at its eviction steps, so every id of the first batch
    # looks up its table's last row, and that row's partition gets a whole SparseCore slice of samples
    # (BATCH / 4, one id each) in every table; the modulo hash spreads the big tables' ids.
    raw = _stats(raw_ids, tmp_path / "raw.json", capsys, "--topology", "cpu-1")
    assert "zch" not in raw
    slice_samples = BATCH // 4
    assert {t["observed"]["max_ids"] for t in stats["tables"].values()} == {slice_samples}
    spread = [n for n, t in raw["tables"].items() if t["observed"]["max_ids"] < slice_samples]
    assert len(spread) >= 20, raw["tables"]


@pytest.mark.slow
def test_zch_limits_at_two_ranks_with_lfu_are_the_demand_of_a_two_rank_run(raw_ids, tmp_path, capsys):
    """Over 2 ranks: each rank's remap block, the ids its input all-to-all brings it in rank order, the
    tables grown to blocks of >= 2 rows (t_C9 3 -> 4), row-wise shards."""
    flags = ("--zch-eviction", "lfu", "--zch-eviction-interval", 2)
    seen = _trained_demand(raw_ids, tmp_path, "--epochs", 1, *flags, nproc=2)
    stats = _stats(raw_ids, tmp_path / "zch.json", capsys, "--topology", "cpu-2", "--zch", *flags)
    _assert_same_demand(seen, stats, stats["batches"])
    assert stats["batches"] == seen["tables"]["t_C1"]["observed"]["batches"] > STEPS


def test_train_refuses_limits_of_another_remap_in_one_line(raw_ids, tmp_path, capsys):
    def limits(name: str, zch: dict | None) -> str:
        doc = {
            "format": "tpurec-id-limits",
            "layout": {"world_size": 1, "sparsecores_per_device": 4, "batch_size_per_device": BATCH},
            "tables": {},
        }
        path = tmp_path / name
        path.write_text(json.dumps(doc | ({"zch": zch} if zch else {})))
        return str(path)

    raw = limits("raw.json", None)  # every limits file before --zch existed: raw ids
    zch = limits("zch.json", {"eviction": "lru", "eviction_interval": 10})
    cases = [
        (["--zch", "--limits", raw], f"--limits {raw} was measured without --zch, but this run is with it"),
        (["--limits", zch], f"--limits {zch} was measured with --zch, but this run is without it"),
        (
            ["--zch", "--zch-eviction", "lfu", "--limits", zch],
            "remap --zch-eviction lru --zch-eviction-interval 10, not --zch-eviction lfu --zch-eviction-interval 10",
        ),
    ]
    for flags, says in cases:
        code, _, err = run_cli(["train", "--quiet", "--data", raw_ids, *flags], capsys)  # refused before any training
        assert_refused(code, err, says)


def test_data_stats_refuses_zch_flags_it_cannot_honour(raw_ids, tmp_path, capsys):
    out = tmp_path / "x.json"
    common = ["data", "stats", raw_ids, "--topology", "cpu-1", "--out", out]
    code, _, err = run_cli([*common, "--model", "dlrm-tiny", "--zch-eviction", "lfu"], capsys)
    assert_refused(code, err, "--zch-eviction is for --zch")
    tables = tmp_path / "t.json"
    tables.write_text(json.dumps([{"name": "t", "num_embeddings": 10, "embedding_dim": 8, "feature": "C1"}]))
    code, _, err = run_cli([*common, "--tables", tables, "--zch"], capsys)
    assert_refused(code, err, "--zch counts the ids of `tpurec train --zch`'s tables: give --model, not --tables")
    plan = tmp_path / "p.json"  # tpurec's plan of the hashed tables: small ones table-wise
    code, _, err = run_cli(
        ["plan", "--model", "dlrm-tiny", "--topology", "cpu-2", "--format", "json", "--out", plan], capsys
    )
    assert code == 0, err
    code, _, err = run_cli(
        ["data", "stats", raw_ids, "--model", "dlrm-tiny", "--plan", plan, "--out", out, "--zch"], capsys
    )
    assert_refused(code, err, "not row-wise over 2 ranks as --zch does")
    assert not out.exists()
