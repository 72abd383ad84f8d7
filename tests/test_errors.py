"""One user-error type (tpurec/errors.py): the commands print a UserError as one line and exit 2;
any other exception, a ValueError included, is a bug and propagates with its traceback."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tpurec.cli import main
from tpurec.errors import EXIT_USER_ERROR, UserError

REPO = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--model", "dlrm-tiny", "--topology", "v5p-8"]


def _slice_raises(monkeypatch, error: Exception) -> None:
    from tpurec.planner import topology

    def parse_slice(name, **kwargs):
        raise error

    monkeypatch.setattr(topology, "parse_slice", parse_slice)


def test_a_user_error_in_a_command_is_one_line_and_exit_2(monkeypatch, capsys):
    _slice_raises(monkeypatch, UserError("v5p-8 is not a slice today"))
    assert main(PLAN) == EXIT_USER_ERROR == 2
    assert capsys.readouterr().err == "tpurec plan: --topology: v5p-8 is not a slice today\n"


def test_a_bug_valueerror_in_a_command_keeps_its_traceback(monkeypatch, capsys):
    """Before UserError the command printed any ValueError as `tpurec plan: boom`, exit 2."""
    _slice_raises(monkeypatch, ValueError("boom"))
    with pytest.raises(ValueError, match="^boom$"):
        main(PLAN)
    assert "boom" not in capsys.readouterr().err


def test_a_bug_in_data_inspect_propagates_and_a_user_error_is_one_line(monkeypatch, capsys, tmp_path):
    from tpurec.data import inspect

    (tmp_path / "_dataset.json").write_text("{}")  # a dataset tpurec wrote: inspect_dataset reads it
    monkeypatch.setattr(inspect, "inspect_dataset", lambda path: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="^boom$"):
        main(["data", "inspect", str(tmp_path)])
    monkeypatch.setattr(inspect, "inspect_dataset", lambda path: (_ for _ in ()).throw(UserError(f"{path}: empty")))
    assert main(["data", "inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"tpurec data: error: {tmp_path}: empty\n"


def test_a_benchmark_names_itself_in_its_error_line(monkeypatch, capsys):
    from tpurec.bench import plan as bench_plan

    monkeypatch.setattr(bench_plan, "run", lambda *a: (_ for _ in ()).throw(UserError("too big")))
    assert main(["bench", "plan"]) == 2
    assert capsys.readouterr().err == "tpurec bench plan: error: too big\n"


class _Trainer:
    def __init__(self, error: Exception):
        self.error, self.options = error, _Options()

    def run(self):
        raise self.error


class _Options:
    dist_timeout = 60.0


def test_a_rank_prints_a_user_error_as_one_line_naming_it(monkeypatch, capsys):
    from tpurec.dlrm.cli import _run_rank

    monkeypatch.setenv("RANK", "1")
    assert _run_rank(_Trainer(UserError("--data /x: no Parquet files"))) == 2
    assert capsys.readouterr().err == "tpurec train: error: rank 1: --data /x: no Parquet files\n"


def test_a_rank_reraises_a_bug_valueerror_after_naming_the_rank(monkeypatch, capsys):
    """Before UserError the rank printed any ValueError as `tpurec train: error: rank 1: boom`, exit 2."""
    from tpurec.dlrm.cli import _run_rank

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="^boom$"):
        _run_rank(_Trainer(ValueError("boom")))
    assert capsys.readouterr().err == "tpurec train: rank 1 failed: ValueError: boom\n"


def test_the_user_error_classes_are_user_errors_and_still_valueerrors():
    from tpurec.data.schema import DataError
    from tpurec.dlrm.ckpt.checkpoint import CheckpointMismatchError, CheckpointWriteError, CorruptCheckpointError
    from tpurec.dlrm.ckpt.dcp_guard import UnsafeCheckpointError
    from tpurec.dlrm.ckpt.integrity import ManifestError
    from tpurec.dlrm.ckpt.lock import CheckpointDirInUse
    from tpurec.dlrm.ckpt.meta import CheckpointMetaError
    from tpurec.embedding.preprocess import IdLimitExceededError
    from tpurec.json_fields import FieldError
    from tpurec.planner.id_limits import IdLimitsError
    from tpurec.planner.plan_check import PlanMismatchError
    from tpurec.planner.planners import PlanDoesNotFit
    from tpurec.runtime.device import TpuUnavailableError

    kinds = [DataError, TpuUnavailableError, CheckpointMismatchError, CheckpointWriteError, CorruptCheckpointError]
    kinds += [ManifestError, CheckpointDirInUse, CheckpointMetaError, UnsafeCheckpointError, IdLimitExceededError]
    kinds += [FieldError, IdLimitsError, PlanMismatchError, PlanDoesNotFit]
    assert [k for k in kinds if not issubclass(k, UserError)] == []
    assert issubclass(UserError, ValueError) and issubclass(TpuUnavailableError, RuntimeError)
    from tpurec.emulation.torchtpu_dist import TorchTpuRuleError  # tpurec broke a TorchTPU rule: a bug

    assert not issubclass(TorchTpuRuleError, UserError)


def test_a_plan_mismatch_is_renamed_by_type_not_by_message():
    from tpurec.planner.plan_check import PlanMismatchError, _check_rank

    with pytest.raises(PlanMismatchError) as err:
        _check_rank("the plan", ", module '', table 't'", 3, 2)
    assert str(err.value).startswith("the plan, module '', table 't': placed on rank 3, but the world size is 2")
    renamed = err.value.named("--plan p.json")
    assert str(renamed).startswith("--plan p.json, module '', table 't': placed on rank 3")
    again = pickle.loads(pickle.dumps(renamed))
    assert (again.source, again.detail, str(again)) == (renamed.source, renamed.detail, str(renamed))


def test_a_bug_valueerror_shows_a_traceback_from_the_command_line(tmp_path):
    """The whole path a user sees: `tpurec plan` with a slice parser that has a bug."""
    code = (
        "import sys\n"
        "from tpurec.planner import topology\n"
        "def parse_slice(name, **kw): raise ValueError('boom')\n"
        "topology.parse_slice = parse_slice\n"
        "from tpurec.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    p = subprocess.run([sys.executable, "-c", code, *PLAN], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr and p.stderr.rstrip().endswith("ValueError: boom")


@pytest.mark.slow  # 3 processes, ~50 s; the rank's line: test_a_rank_prints_a_user_error_as_one_line_naming_it
def test_a_user_error_on_every_rank_of_a_two_rank_run_is_one_line_naming_both(tmp_path):
    """Limits measured for 4 devices, run on 2: the launcher checks their tables, the layout is the ranks'
    check, so each rank finds it; the line is printed once (was: once per rank)."""
    import json
    import os

    from tpurec.planner.id_limits import FORMAT

    entry = {"max_ids_per_partition": 16, "max_unique_ids_per_partition": 8}
    tables = {f"t_C{i}": entry for i in range(1, 27)}
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"format": FORMAT, "version": 1, "layout": {"world_size": 4}, "tables": tables}))
    cli = [sys.executable, "-m", "tpurec.cli"]
    train = ["train", "--nproc", "2", "--synth-rows", "2000", "--steps", "1", "--curves-out", "none"]
    env = dict(os.environ, TPUREC_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    cmd = [*cli, *train, "--limits", str(limits)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert p.returncode == 2, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(said) == 1, p.stderr[-3000:]
    assert said[0].startswith(f"tpurec train: error: ranks 0-1: --limits {limits} was measured for 4 device(s), not ")
    assert "Traceback" not in p.stderr
