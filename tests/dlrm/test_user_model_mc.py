"""`tpurec train --model-module` with a managed-collision table of the user's own (#63 item 1):
the table's remap gets the column's raw ids (not ids hashed into its rows first), and the run
reports the remap's counters as `--zch` runs do (docs/your_model.md, docs/managed_collision.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.reliability.inproc import assert_refused, run_cli

from .helpers import REPO, checkpoint_tensors

MODEL = f"{REPO / 'tests' / 'dlrm' / 'mc_user_model.py'}"
EMPTY = 2**63 - 1  # TorchRec's marker of an unused slot


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    """2,048 rows of a user's Parquet: 2 float columns, user_id drawn from 300 distinct 40-bit ids
    (3x the MC table's 100 slots), item_id raw ids below 10^9."""
    import pandas as pd

    rng = np.random.default_rng(0)
    n = 2048
    users = rng.integers(0, 2**40, 300)
    df = pd.DataFrame({"label": rng.integers(0, 2, n), "d0": rng.random(n), "d1": rng.random(n)})
    df["user_id"] = rng.choice(users, n)
    df["item_id"] = rng.integers(0, 10**9, n)
    path = tmp_path_factory.mktemp("events") / "events.parquet"
    df.to_parquet(path)
    return path, set(users.tolist())


def _train(capsys, *args) -> tuple[dict, str]:
    code, out, err = run_cli(["train", "--quiet", "--curves-out", "none", *args], capsys)
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_an_mc_table_gets_the_columns_raw_ids_and_the_run_counts_its_remap(events, tmp_path, capsys, monkeypatch):
    """6 steps of batch 128: every one of the 768 training ids went through the remap; the 99 usable
    slots end full of the data's own 40-bit ids (before #63 the reader hashed them into the table's
    100 rows first: the remap held ids below 100, and no counter was reported)."""
    path, users = events
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    ck = tmp_path / "ck"
    args = ["--model-module", f"{MODEL}:build", "--data", path, "--steps", 6, "--batch-size", 128]
    result, err = _train(capsys, *args, "--checkpoint-dir", ck)
    zch = result["zch"]
    assert zch["eviction"] == "lru" and zch["eviction_interval"] == 2
    assert zch["remapped_ids"] == 6 * 128 and zch["eval_remapped_ids"] == result["eval_rows"]
    assert (zch["occupied_slots"], zch["slots"], zch["tables_full"]) == (99, 99, 1)
    # 300 users for 99 slots: slots change hands (measured 133); the table starts empty and ends
    # full, so every admission but the first 99 evicted an id
    assert zch["evictions"] > 50 and zch["admitted"] - zch["evictions"] == 99
    assert 0 < zch["remap_hits"] < 768  # new ids wait in the shared last row until an eviction step
    assert "features user_id (ids below 1,099,511,627,776) read unhashed for the remap" in err
    assert f"zch remap      768 ids ({zch['hit_rate']:.1%} in their own slot), {zch['evictions']} evictions" in err
    tensors = checkpoint_tensors(ck / "step-00000006")
    (held,) = [v for k, v in tensors.items() if k.endswith("_mch_sorted_raw_ids")]
    held = {int(x) for x in held.tolist() if x != EMPTY}
    assert len(held) == 99 and held <= users and min(held) > 2**20


def test_the_reader_hands_an_mc_feature_of_raw_id_data_its_ids_as_stored(tmp_path):
    """tpurec's own raw-id data (`data synth --raw-ids`): the MC feature's ids are the stored ones
    (reduced below the remap's range), the other features' hashed into their tables (1 + id mod (n - 1))."""
    import pyarrow.parquet as pq

    from tpurec.cli import main
    from tpurec.data.reader import ParquetReader

    out = tmp_path / "raw"
    assert main(["data", "synth", "--raw-ids", "--rows", "1000", "--out", str(out)]) == 0
    stored = pq.read_table(sorted(out.glob("*.parquet"))[0])
    reader = ParquetReader(out, 1000, table_sizes=[2**20] + [1000] * 25, remap_ranges={"C1": 2**20})
    batch = next(iter(reader))
    ids = batch.sparse_features.to_dict()
    c1, c2 = (stored.column(n).to_numpy()[:1000].astype(np.int64) for n in ("C1", "C2"))
    assert c1.max() >= 2**20  # some ids the range reduces
    np.testing.assert_array_equal(ids["C1"].values().numpy(), c1 % 2**20)
    np.testing.assert_array_equal(ids["C2"].values().numpy(), np.where(c2 == 0, 0, 1 + c2 % 999))


def test_a_column_of_more_ids_than_the_mc_tables_rows_trains_and_one_past_its_range_is_refused(
    events, tmp_path, capsys, monkeypatch
):
    """`--sparse user_id:1000000` (ids hashed into 10^6): the MC table of 100 slots takes them (was
    refused: "holds ids in [0, 1,000,000), but table 'user' ... has 100 rows"); a remap of input range
    2^10 cannot."""
    path, _ = events
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    mapping = ["--data", path, "--sparse", "user_id:1000000,item_id", "--steps", 1, "--batch-size", 128]
    result, _ = _train(capsys, "--model-module", f"{MODEL}:build", *mapping)
    assert result["zch"]["remapped_ids"] == 128
    code, _, err = run_cli(["train", "--quiet", "--model-module", f"{MODEL}:small_range", *mapping], capsys)
    says = (
        f"column 'user_id' holds ids in [0, 1,000,000), but table 'user' of --model-module {MODEL}:small_range "
        "takes ids below 1,024 (its remap's input_hash_size)"
    )
    assert_refused(code, err, says, prefix="tpurec train: error")


def test_zch_and_the_compiled_step_with_an_mc_model_are_one_line(events, tmp_path, capsys, monkeypatch):
    path, _ = events
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    common = ["train", "--quiet", "--model-module", f"{MODEL}:build", "--data", path]
    code, _, err = run_cli([*common, "--zch"], capsys)
    assert_refused(code, err, "--zch puts the built-in DLRM's tables behind TorchRec's managed-collision remap; a")
    assert "their features get the data's raw ids and the run reports the remap's counters without --zch" in err
    code, _, err = run_cli([*common, "--step", "pipelined", "--steps", 1], capsys)
    says = f"--step pipelined trains without managed-collision tables (--model-module {MODEL}:build: features user_id)"
    assert_refused(code, err, says, prefix="tpurec train: error")


def test_plan_warns_of_a_remap_whose_ids_all_land_on_rank_0(capsys):
    """TorchRec's default input range (2^63 - 1) and no input_hash_func over 2 ranks: every id below
    2^62 in rank 0's block (the range docs/managed_collision.md's example had)."""
    code, _, err = run_cli(["plan", "--model-module", f"{MODEL}:default_range", "--topology", "cpu-2"], capsys)
    assert code == 0, err
    assert (
        "tpurec plan: warning: managed-collision table 'user': its remap's input range [0, 9,223,372,036,854,775,807) "
        "is cut into 2 row-wise blocks of 4,611,686,018,427,387,904 ids, one per rank, and it has no input_hash_func"
    ) in err
    code, _, err = run_cli(["plan", "--model-module", f"{MODEL}:build", "--topology", "cpu-2"], capsys)
    assert code == 0 and "warning" not in err  # a range sized to the ids (2^40)
