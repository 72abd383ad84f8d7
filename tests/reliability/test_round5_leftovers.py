"""#61 item 6 leftovers: what still printed a traceback or a misleading line. `--tensorboard` on a
disk that fills during the run, `train --zch --plan` with a table-wise plan, a resume whose remap
setting or world size differs, `data inspect` of a 0-row dataset, a user forward of one argument."""

from __future__ import annotations

import errno
import json
import os

import pytest

from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli


# the event writer's thread dying with a traceback (pytest turns its print into this warning)
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_on_a_disk_that_fills_keeps_the_result_line_and_says_so(tmp_path, monkeypatch, capsys):
    """The event file opens, then every write into it fails with ENOSPC (the disk filled during the
    run). Before: the writer's thread printed a traceback and the run ended without its result line."""
    from tensorboard.compat.tensorflow_stub.io.gfile import LocalFileSystem

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    tb = tmp_path / "tb"
    real = LocalFileSystem._write
    writes = []

    def write(self, filename, content, mode):
        writes.append(filename)
        if os.fsdecode(filename).startswith(str(tb)) and len(writes) > 1:  # the file's first record lands
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(self, filename, content, mode)

    monkeypatch.setattr(LocalFileSystem, "_write", write)
    code, out, err = run_cli([*TINY_TRAIN, "--steps", 2, "--tensorboard", tb], capsys)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["steps"] == 2 and "auc" in result
    assert code == 2 and "Traceback" not in err and "Exception in thread" not in err, err
    [line] = [x for x in err.splitlines() if x.startswith("tpurec train: error")]
    assert f"--tensorboard {tb}: writing the TensorBoard events failed (No space left on device)" in line


@pytest.fixture(scope="module")
def raw_ids(tmp_path_factory):
    """3,000 synthetic rows of raw (unhashed) ids, as --zch trains on."""
    from tpurec.cli import main

    path = tmp_path_factory.mktemp("raw") / "d"
    assert main(["data", "synth", "--rows", "3000", "--raw-ids", "--out", str(path), "--quiet"]) == 0
    return path


def test_zch_with_a_table_wise_plan_is_one_line_naming_the_plan_and_the_table(raw_ids, tmp_path, capsys):
    """Before: TorchRec's `AssertionError: Only ROW_WISE sharding is supported.` from deep in DMP."""
    argv = [*TINY_TRAIN[:2], "--data", raw_ids, *TINY_TRAIN[4:], "--steps", 1]
    plan = tmp_path / "tw.json"
    code, _, err = run_cli([*argv, "--save-plan", plan], capsys)  # the plan without --zch: table-wise
    assert code == 0, err
    assert (
        json.loads(plan.read_text())["modules"]["model.sparse_arch.embedding_bag_collection"]["t_C1"]["sharding_type"]
        == "table_wise"
    )
    code, out, err = run_cli([*argv, "--zch", "--plan", plan], capsys)
    assert_refused(
        code,
        err,
        f"--plan {plan}, module 'model.sparse_arch.embedding_bag_collection.mc', table 't_C1': sharding_type "
        "'table_wise' is not for a managed-collision table (--zch): TorchRec's remap shards those row_wise only; "
        "plan with --zch (tpurec train --zch --save-plan FILE) or leave out --plan",
        prefix="tpurec train",
    )
    assert out == ""


@pytest.fixture(scope="module")
def zch_checkpoint(raw_ids, tmp_path_factory):
    """A 1-rank --zch (lru) checkpoint of 2 steps on the raw-id data."""
    from tpurec.cli import main

    ck = tmp_path_factory.mktemp("zch") / "ck"
    argv = [*TINY_TRAIN[:2], "--data", raw_ids, *TINY_TRAIN[4:], "--steps", 2, "--zch", "--checkpoint-dir", ck]
    assert main([str(a) for a in argv]) == 0
    return ck / "step-00000002"


def test_resuming_with_another_zch_eviction_names_the_setting(raw_ids, zch_checkpoint, tmp_path, capsys):
    """Before: 'holds no ..._mch_counts: it was written for another model than this run's'."""
    argv = [*TINY_TRAIN[:2], "--data", raw_ids, *TINY_TRAIN[4:], "--steps", 3, "--zch", "--zch-eviction", "lfu"]
    code, _, err = run_cli([*argv, "--checkpoint-dir", tmp_path / "ck", "--resume", zch_checkpoint], capsys)
    assert_refused(
        code,
        err,
        f"resume: {zch_checkpoint} was written with zch_eviction = lru (--zch-eviction), this run has lfu: a "
        "checkpoint resumes only the model and data it was written for (give --zch-eviction lru, or start a new run)",
        prefix="tpurec train",
    )
    assert not list((tmp_path / "ck").glob("step-*"))  # nothing saved


@pytest.mark.multiprocess
def test_a_one_rank_zch_checkpoint_at_two_ranks_names_the_world_size(raw_ids, zch_checkpoint, tmp_path):
    """Before: 'has table t_C9 with 3 rows, this run's has 4 (tables take their sizes from the data's
    _dataset.json: resume on the data the checkpoint was trained on ...)': the data was the same."""
    from tests.dlrm.helpers import train

    args = ["--data", raw_ids, *TINY_TRAIN[4:], "--steps", 3, "--zch", "--nproc", 2]
    _, p = train(*args, "--resume", zch_checkpoint, cache=tmp_path, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    [line] = [x for x in p.stderr.splitlines() if x.startswith("tpurec train: error")]
    assert line.endswith(
        f"resume: {zch_checkpoint} was written with --zch at 1 rank(s), this run has 2: the managed-collision "
        "remap keeps each rank's block of every table (their ids and sizes follow the world size), so it resumes "
        "only at the world size it was written at (--nproc 1, or start a new run)"
    ), line


def test_data_inspect_of_a_dataset_of_0_rows_is_one_line(tmp_path, capsys):
    """tpurec's own dataset (its _dataset.json, its Parquet schema) whose files hold no rows. Before:
    `ValueError: min() arg is an empty sequence` from the row-group summary."""
    import pyarrow.parquet as pq

    from tpurec.data.synth import synthesize

    d = tmp_path / "d"
    synthesize(300, str(d), seed=0, show_progress=False)
    [part] = d.glob("*.parquet")
    pq.write_table(pq.read_table(part).slice(0, 0), part)
    code, out, err = run_cli(["data", "inspect", d], capsys)
    assert_refused(code, err, f"tpurec data: error: {d}: 0 rows in 1 Parquet file(s): nothing to inspect")
    assert out == ""
