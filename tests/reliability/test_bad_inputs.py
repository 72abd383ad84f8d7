"""Bad command-line values and bad files, table-driven by category: each is refused with exit code 2
and one line naming what and where, with no traceback, in bounded time. In-process `tpurec.cli.main`
calls (no subprocess per case); faults that need real processes are in test_run_faults.py.

Covered elsewhere, not repeated here:
  numeric flags of plan / train / data (--headroom -1, --dcn-gbps -5, --batch-size 0, nan, ...):
      tests/test_bad_cli_inputs.py
  tables files (typos, zero/absurd sizes, truncated YAML): tests/planner/test_tables_file.py
  plans that do not fit the model or world (bogus_wise, rank 7 of 2, shards not covering):
      tests/planner/test_plan_check.py
  crafted DCP metadata, pickled train state: tests/dlrm/ckpt/test_checkpoint_safety.py
  data files (Parquet, converter, reader, cache): test_data_faults.py (written with the data side)
"""

from __future__ import annotations

import json
import os

import pytest

from tests.reliability.inproc import assert_refused as _assert_refused
from tests.reliability.inproc import run_cli as _run
from tpurec.cli import main


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A real `tpurec plan` report of dlrm-tiny on 4 devices (3-row t_C9 gets an empty shard)."""
    path = tmp_path_factory.mktemp("plans") / "dlrm-tiny.json"
    assert main(["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--format", "json", "--out", str(path)]) == 0
    return path


def _edited(plan_file, tmp_path, edit):
    doc = json.loads(plan_file.read_text())
    edit(doc)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))
    return out


def _t_c1(doc):
    return doc["plan"]["modules"][""]["t_C1"]


def _rank9(doc):
    _t_c1(doc)["shards"][0]["placement"] = "rank:9/tpu:9"
    _t_c1(doc)["ranks"] = [9]


PLAN_FILES = [
    # (edit of a good plan file, what the one line says after "tpurec plan: FILE")
    (_rank9, ", module '<root>', table 't_C1': placed on rank 9, but the world size is 4"),
    (lambda d: _t_c1(d).pop("shards"), ': $.plan.modules[""].t_C1.shards: missing'),
    (lambda d: _t_c1(d).update(sharding_type="bogus_wise"), "table 't_C1': sharding_type 'bogus_wise' is not one of"),
    (lambda d: d.pop("plan"), ": not a tpurec sharding plan (format='tpurec-plan-report')"),
    (lambda d: _t_c1(d)["shards"][0].update(sizes=[10, 16]), "shards cover 160 of the table's 16,000 elements"),
]


@pytest.mark.parametrize("edit,says", PLAN_FILES, ids=["rank9", "no_shards", "bogus_wise", "no_plan", "partial"])
def test_plan_show_refuses_a_bad_plan_file_naming_it(plan_file, tmp_path, capsys, edit, says):
    path = _edited(plan_file, tmp_path, edit)
    code, _, err = _run(["plan", "show", path], capsys)
    _assert_refused(code, err, f"tpurec plan: {path}")
    assert says in err, err


def test_plan_show_reads_a_plan_with_an_empty_row_wise_shard(plan_file, capsys):
    # TorchRec splits the 3-row t_C9 over 4 devices with a 0-row last shard: a valid plan
    code, out, err = _run(["plan", "show", plan_file], capsys)
    assert code == 0 and "t_C9" in out, err


def test_plan_show_of_a_truncated_file_names_it(plan_file, tmp_path, capsys):
    path = tmp_path / "cut.json"
    path.write_text(plan_file.read_text()[:500])
    code, _, err = _run(["plan", "show", path], capsys)
    _assert_refused(code, err, f"tpurec plan: {path}: not a JSON plan file (")


def test_plan_diff_of_two_models_says_so_first(plan_file, tmp_path, capsys):
    other = tmp_path / "criteo-kaggle.json"
    plan = ["plan", "--model", "criteo-kaggle", "--topology", "v6e-4", "--format", "json", "--out", str(other)]
    assert main(plan) == 0
    capsys.readouterr()
    code, out, _ = _run(["plan", "diff", plan_file, other], capsys)
    assert code == 0
    assert (
        "note: A and B plan different models ('dlrm-tiny' and 'criteo-kaggle'): the tables differ, so this "
        "compares two models, not two placements of one" in out.splitlines()[:3]
    )
    code, out, _ = _run(["plan", "diff", plan_file, plan_file], capsys)
    assert code == 0 and "different models" not in out


TRAIN_FLAGS = [
    (["--heartbeat-timeout", "-1"], "--heartbeat-timeout: '-1' must be >= 0"),
    (["--dist-timeout", "0"], "--dist-timeout: '0' must be > 0"),
    (["--dist-timeout", "inf"], "--dist-timeout: 'inf' is not a finite number"),
]


@pytest.mark.parametrize("flags,says", TRAIN_FLAGS, ids=[" ".join(f) for f, _ in TRAIN_FLAGS])
def test_train_timeouts_out_of_domain_are_refused(capsys, flags, says):
    code, _, err = _run(["train", *flags], capsys)
    assert code == 2 and says in err and "Traceback" not in err, err


def test_an_unwritable_checkpoint_dir_is_refused_before_anything_starts(unwritable_dir, capsys):
    d, reason = unwritable_dir
    code, _, err = _run(["train", "--checkpoint-dir", d / "ck"], capsys)
    _assert_refused(code, err, f"tpurec train: error: --checkpoint-dir {d / 'ck'}: cannot write in {d} ({reason})")


def test_a_checkpoint_dir_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, _, err = _run(["train", "--checkpoint-dir", tmp_path / "f" / "ck"], capsys)
    _assert_refused(code, err, f"--checkpoint-dir {tmp_path / 'f' / 'ck'}: {tmp_path / 'f'} is not a directory")


def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused(tmp_path, capsys, monkeypatch):
    """Concurrent runs: two runs saving into one directory would delete each other's step-N.tmp."""
    import torch

    from tpurec.dlrm.ckpt.lock import lock_dir

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    held = lock_dir(tmp_path / "ck")  # the other run (a lock held on another open file)
    try:
        code, _, err = _run(["train", "--quiet", "--checkpoint-dir", tmp_path / "ck", "--steps", 1], capsys)
    finally:
        held.close()
        torch.set_num_threads(threads)  # the Trainer pins this process to one thread
    _assert_refused(code, err, f"--checkpoint-dir {tmp_path / 'ck'} is in use by another run (pid {os.getpid()})")
    assert not (tmp_path / "cache").exists()  # refused before any data was made
