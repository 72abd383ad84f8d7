"""`tpurec train --nproc / --emulate-tpu` check --plan and --limits against the model, the world size
and the slice once, in the launching process, before any rank starts (tpurec/dlrm/preflight.py): one
line, exit 2. Before, each rank refused them after building its data and model (a plan for another
model: 94 s and 8 copies of the line), and a plan for another TPU generation or limits for another
model's tables were taken without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpurec.planner.id_limits import FORMAT

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan16(tmp_path_factory) -> Path:
    """A plan of dlrm-tiny for v5p-16 (8 devices, v5p)."""
    path = tmp_path_factory.mktemp("plan") / "p16.json"
    cmd = ["plan", "--model", "dlrm-tiny", "--topology", "v5p-16", "--format", "json", "--out", str(path)]
    assert _tpurec(cmd, path.parent).returncode == 0
    return path


def _tpurec(args: list[str], cwd: Path, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if cache is not None:
        env["TPUREC_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def _refused_once(args: list[str], tmp_path: Path, cache: Path) -> str:
    """The one error line of a train launch refused before any rank started."""
    start = time.monotonic()
    p = _tpurec(["train", "--synth-rows", "2000", "--steps", "1", *args], tmp_path, cache)
    elapsed = time.monotonic() - start
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(errors) == 1, p.stderr[-2000:]  # once, by the launcher: no rank printed it
    assert "rank" not in p.stderr.replace("ranks", "").replace("rank 4", ""), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert elapsed < 90  # seconds: about 5 s of CPU (the ranks took 66-94 s to refuse a plan)
    return errors[0]


@pytest.mark.multiprocess
def test_a_plan_for_another_generation_or_world_size_is_refused_before_any_rank(plan16, tmp_path, tiny_cache):
    line = _refused_once(["--emulate-tpu", "v6e-8", "--plan", str(plan16)], tmp_path, tiny_cache)
    assert line == (
        f"tpurec train: error: --plan {plan16} was planned for v5p-16 (v5p), not v6e-8 (v6e): plan for the "
        "slice you run (tpurec plan --topology v6e-8)"
    )
    line = _refused_once(["--nproc", "2", "--plan", str(plan16)], tmp_path, tiny_cache)
    assert line.startswith(f"tpurec train: error: --plan {plan16}, module 'model.sparse_arch.embedding_bag_collection'")
    assert line.endswith("but the world size is 2 (a plan made for another world size: plan again for this one)")


@pytest.mark.multiprocess
def test_limits_of_another_models_tables_are_refused_naming_missing_and_extra(tmp_path, tiny_cache):
    entry = {"max_ids_per_partition": 16, "max_unique_ids_per_partition": 8}
    tables = {f"t_C{i}": entry for i in range(3, 27)} | {"t_other": entry}
    doc = {"format": FORMAT, "version": 1, "layout": {"world_size": 2}, "tables": tables}
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps(doc))
    line = _refused_once(["--nproc", "2", "--limits", str(limits)], tmp_path, tiny_cache)
    want = (
        f"--limits {limits}: measured for other tables: no limits for the model's table(s) t_C1, t_C2; table(s) "
        "t_other are not the model's (measure this model's: tpurec data stats --model/--plan)"
    )
    assert line == f"tpurec train: error: {want}"
    # one process: the trainer's own check, before the model is sharded
    p = _tpurec(["train", "--synth-rows", "2000", "--steps", "1", "--limits", str(limits)], tmp_path, tiny_cache)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == f"tpurec train: error: rank 0: {want}"


@pytest.mark.slow  # 8 emulated ranks: about 3 minutes on 2 cores
@pytest.mark.multiprocess
def test_id_limits_recipe_runs_on_v5p_16_where_row_wise_shards_have_no_rows(plan16, tmp_path, tiny_cache):
    """docs/id_limits.md's recipe on v5p-16: the planner row-wise shards t_C9 (3 rows) over 8 ranks,
    leaving 0-row shards, whose stack bound divided by zero on every rank. The launcher's checks
    accept the matching plan and limits."""
    data, limits = tmp_path / "data", tmp_path / "limits.json"
    assert _tpurec(["data", "synth", "--rows", "9000", "--out", str(data)], tmp_path).returncode == 0
    shards = json.loads(plan16.read_text())["plan"]
    assert "t_C9" in json.dumps(shards)
    stats = ["data", "stats", str(data), "--model", "dlrm-tiny", "--plan", str(plan16), "--out", str(limits)]
    assert _tpurec(stats, tmp_path).returncode == 0
    train = ["train", "--data", str(data), "--emulate-tpu", "v5p-16", "--plan", str(plan16), "--limits", str(limits)]
    p = _tpurec([*train, "--steps", "2", "--eval-every", "0"], tmp_path, tiny_cache)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 8 and result["id_limits"]["limits"] == str(limits)
    assert result["id_limits"]["dropped_ids"] == 0
