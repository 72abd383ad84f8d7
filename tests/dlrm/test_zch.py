"""`tpurec train --zch` (issue #38): the DLRM's tables behind TorchRec's MCH remap on raw-id data, the
remap's counters in the result line and --metrics-out, and the refusals; `data synth --raw-ids`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tpurec.data.catalog import DLRM_TINY_ROWS

from .helpers import REPO, train, train_here

DISTINCT = 8  # raw ids per feature of the converted dataset
BATCH, STEPS, INTERVAL = 64, 6, 2


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=300
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def cycling_raw_ids(tmp_path_factory):
    """Criteo TSV rows whose 26 categoricals each cycle through DISTINCT hex ids, converted --raw-ids."""
    tmp = tmp_path_factory.mktemp("cycling")
    lines = []
    for i in range(2048):
        dense = [str(i % 7)] * 13
        cats = [format(1 + (i + j) % DISTINCT, "x") for j in range(26)]
        lines.append("\t".join([str(int(i % 4 == 0)), *dense, *cats]))
    (tmp / "day.tsv").write_text("\n".join(lines) + "\n")
    p = _cli("data", "convert", tmp / "day.tsv", "--out", tmp / "data", "--raw-ids", "--quiet")
    assert p.returncode == 0, p.stderr
    return tmp / "data"


@pytest.fixture(scope="module")
def zipf_raw_ids(tmp_path_factory):
    out = tmp_path_factory.mktemp("zipf") / "data"
    p = _cli("data", "synth", "--raw-ids", "--rows", 6000, "--out", out, "--quiet")
    assert p.returncode == 0, p.stderr
    return out


def test_zch_counts_the_remap_below_capacity_exactly(cycling_raw_ids, cache, tmp_path, capsys):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    result, _, _ = train_here(
        capsys, "--data", cycling_raw_ids, "--zch", "--zch-eviction-interval", INTERVAL, "--steps", STEPS,
        "--batch-size", BATCH, "--eval-every", 0, "--metrics-out", metrics, "--curves-out", "none",
        "--checkpoint-dir", ck, cache=cache,
    )  # fmt: skip
    z = result["zch"]
    assert (z["eviction"], z["eviction_interval"]) == ("lru", INTERVAL)
    assert z["remapped_ids"] == STEPS * BATCH * 26  # every id of every training step, one per feature
    slots = [n - 1 for n in DLRM_TINY_ROWS]  # TorchRec keeps a shard's last slot as its end marker
    assert z["slots"] == sum(slots)
    assert z["occupied_slots"] == sum(min(DISTINCT, s) for s in slots)
    tables = {r["table"]: r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "zch_table"}
    assert len(tables) == 26
    roomy = 0
    for j, s in enumerate(slots):
        t = tables[f"t_C{j + 1}"]
        assert t["zch_remapped_ids"] == STEPS * BATCH
        if s >= DISTINCT:  # room for every id: all admitted at the first eviction step, none pushed out
            roomy += 1
            assert t["zch_occupancy"] == round(DISTINCT / s, 6)
            assert t["zch_evictions"] == 0
            # the remap runs after its eviction step: every id finds its slot from step INTERVAL on
            assert t["zch_hit_rate"] == round((STEPS - INTERVAL + 1) / STEPS, 6)
        else:
            assert t["zch_occupancy"] == 1.0
    assert roomy == 24  # dlrm-tiny's 3- and 4-row tables hold fewer than DISTINCT ids
    train_rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    assert train_rows[-1]["zch_remapped_ids"] == z["remapped_ids"]
    assert train_rows[0]["zch_hit_rate"] == 0.0  # before the first eviction step every id shares the last row
    # its checkpoint holds the remap's state: resuming it without --zch is refused in one line, naming the flag
    resume = ["--steps", STEPS + 1, "--checkpoint-dir", ck, "--resume"]
    _, code, err = train_here(capsys, "--data", cycling_raw_ids, *resume, cache=cache, check=False)
    assert code == 2 and "written with --zch" in err.strip().splitlines()[-1]


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
@pytest.mark.multiprocess
def test_zch_at_two_ranks_evicts_above_capacity_and_sums_the_ranks(zipf_raw_ids, cache, tmp_path):
    result, p = train(
        "--nproc", 2, "--data", zipf_raw_ids, "--zch", "--zch-eviction", "lfu", "--zch-eviction-interval", 3,
        "--steps", 12, "--batch-size", 64, "--eval-every", 0, "--curves-out", "none", cache=cache, timeout=600,
    )  # fmt: skip
    z = result["zch"]
    assert z["eviction"] == "lfu"
    assert z["remapped_ids"] == 12 * 64 * 2 * 26
    # each rank's shard keeps its own end-marker slot: 2 per table; the 3-row table grew to 2 blocks of 2 rows
    assert z["slots"] == sum(DLRM_TINY_ROWS) + 1 - 2 * 26
    assert "rows grown: t_C9 3 -> 4" in p.stderr
    assert z["evictions"] > 0 and z["admitted"] > z["evictions"]  # the long tail churns through the small tables
    assert 0 < z["occupancy"] <= 1 and z["tables_full"] >= 2
    assert "zch remap" in p.stderr  # the summary's line


@pytest.mark.slow  # 4 emulated ranks, about 50 s
@pytest.mark.multiprocess
def test_zch_on_an_emulated_tpu_slice_keeps_the_remap_on_the_host(zipf_raw_ids, cache):
    """The TPU code path (DMP moves a model with dense parameters to the device before DDP): the remap's
    state stays on the host with the ids, and no step copies anything from the device but the loss."""
    result, p = train(
        "--emulate-tpu", "v5p-8", "--data", zipf_raw_ids, "--zch", "--steps", 12, "--batch-size", 64,
        "--eval-every", 0, "--curves-out", "none", cache=cache, timeout=900,
    )  # fmt: skip
    z = result["zch"]
    assert z["remapped_ids"] == 12 * 64 * 4 * 26 and z["admitted"] > 0
    assert "rows grown: t_C9 3 -> 8, t_C17 10 -> 12, t_C20 4 -> 8" in p.stderr
    assert set(result["device_to_host_copies"]) == {"tpurec.dlrm.trainer._read_loss"}


def test_zch_on_hashed_data_or_without_data_is_refused_in_one_line(cache, tmp_path, capsys):
    from tpurec.cli import main

    hashed = tmp_path / "hashed"
    assert main(["data", "synth", "--rows", "500", "--out", str(hashed), "--quiet"]) == 0
    _, code, err = train_here(capsys, "--data", hashed, "--zch", cache=cache, check=False)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "--zch" in line and "--raw-ids" in line and str(hashed) in line
    _, code, err = train_here(capsys, "--zch", cache=cache, check=False)
    assert code == 2 and "--zch" in err and "--data" in err
    _, code, err = train_here(capsys, "--zch-eviction", "lfu", cache=cache, check=False)
    assert code == 2 and "--zch-eviction is for --zch" in err


def test_without_zch_raw_ids_keep_the_modulo_hash(cycling_raw_ids, cache, capsys):
    result, _, _ = train_here(
        capsys, "--data", cycling_raw_ids, "--steps", 2, "--batch-size", BATCH, "--eval-every", 0, cache=cache
    )
    assert "zch" not in result and result["steps"] == 2


def test_synth_raw_ids_are_skewed_over_an_id_space_larger_than_the_tables(tmp_path):
    from tpurec.data.schema import CAT_RAW, dataset_metadata
    from tpurec.data.synth import synthesize

    summary = synthesize(4000, str(tmp_path / "d"), raw_ids=True, id_space=2**20, show_progress=False)
    meta = dataset_metadata(tmp_path / "d")
    assert meta["categorical"] == CAT_RAW and meta["raw_id_space"] == 2**20 == summary["raw_id_space"]
    assert all(f["num_embeddings"] is None for f in meta["sparse"])
    import pyarrow.parquet as pq

    ids = pq.read_table(tmp_path / "d" / "part-00000.parquet", columns=["C1"]).column("C1").to_numpy()
    assert ids.min() >= 1 and ids.max() <= 2**20  # 0 stays "empty"
    _, counts = np.unique(ids, return_counts=True)
    assert len(counts) > 1000  # more distinct ids than dlrm-tiny's 1000-row tables
    assert np.sort(counts)[-10:].sum() > 0.2 * len(ids)  # 10 hot ids carry over a fifth of the traffic (28% here)


@pytest.mark.parametrize(
    ("rows", "world", "want"),
    [(3, 1, 3), (3, 2, 4), (4, 2, 4), (3, 4, 8), (10, 4, 12), (9, 4, 12), (1000, 4, 1000)]
    + [(27, 8, 32), (26, 8, 32), (30, 8, 30)],
)
def test_remap_rows_give_every_rank_a_block_of_at_least_2_rows(rows, world, want):
    from tpurec.dlrm.zch import remap_rows

    assert remap_rows(rows, world) == want
    block = -(-want // world)  # row-wise: ceil(rows / ranks) each, the last ranks what is left
    assert min(max(0, min(block, want - r * block)) for r in range(world)) >= 2


def test_spread_ids_keeps_raw_ids_distinct_and_in_range():
    import torch

    from tpurec.dlrm.zch import INPUT_HASH_SIZE, spread_ids

    raw = torch.cat([torch.arange(0, 100_000), torch.randint(0, 2**62, (100_000,)), torch.tensor([2**32 - 1])])
    raw = raw.unique()
    spread = spread_ids(raw, INPUT_HASH_SIZE)
    assert spread.unique().numel() == raw.numel()
    assert int(spread.min()) >= 0 and int(spread.max()) < INPUT_HASH_SIZE
    # consecutive raw ids fall into both halves of the range (the 2 ranks' blocks of the remap)
    assert 0.4 < float((spread[:100_000] < INPUT_HASH_SIZE // 2).float().mean()) < 0.6


@pytest.mark.slow
def test_bench_zch_reports_both_sides_auc(tmp_path):
    p = _cli("bench", "zch", "--rows", 6000, "--epochs", 0.5, "--batch-size", 128, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert set(r["sides"]) == {"modulo", "zch_lru"}
    assert all(0 < s["auc"] < 1 for s in r["sides"].values())
    assert r["sides"]["zch_lru"]["remap"]["remapped_ids"] > 0 and "remap" not in r["sides"]["modulo"]
    sides = r["sides"]
    assert r["auc_gain_vs_modulo"]["zch_lru"] == pytest.approx(sides["zch_lru"]["auc"] - sides["modulo"]["auc"])
