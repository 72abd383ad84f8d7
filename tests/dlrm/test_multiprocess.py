"""`tpurec train --nproc 2`: quality, exact resume, resume at another world size, a failing rank."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from .helpers import checkpoint_tensors, train

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def test_two_ranks_reach_the_same_quality(cache):
    result, _ = train("--nproc", 2, cache=cache, timeout=900)
    assert result["world_size"] == 2
    assert result["oracle_auc"] - result["auc"] <= 0.02, result


def test_exact_resume_two_ranks(cache, tmp_path):
    common = ["--nproc", 2, "--synth-rows", 30000, "--eval-every", 20, "--keep", 0]
    train("--steps", 60, "--checkpoint-dir", tmp_path / "a", *common, cache=cache)
    train("--steps", 35, "--checkpoint-dir", tmp_path / "b", *common, cache=cache)
    _, p = train("--steps", 60, "--checkpoint-dir", tmp_path / "b", "--resume", *common, cache=cache)
    assert "at step 35, exact" in p.stderr
    # one voice for the job: each data and checkpoint line once, not once per rank (nor launcher + rank 0)
    said = [line for line in p.stderr.splitlines() if line.startswith(("data: ", "checkpoint: "))]
    assert len(said) == len(set(said)) and sum(line.startswith("data: ") for line in said) == 2, said
    want = checkpoint_tensors(tmp_path / "a" / "step-00000060")
    got = checkpoint_tensors(tmp_path / "b" / "step-00000060")
    assert set(want) == set(got)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_resume_at_another_world_size(cache, tmp_path, first, second):
    small_data = ["--synth-rows", 60000, "--eval-every", 0, "--keep", 0]
    common = [*small_data, "--checkpoint-dir", tmp_path]
    before, _ = train("--nproc", first, "--steps", 60, *common, cache=cache)
    saved = checkpoint_tensors(tmp_path / "step-00000060")
    # resumed at the other world size without a step (evaluate, save elsewhere): every tensor it
    # loaded, written back, is the saved one bit for bit (a shard at a shifted offset keeps its shape)
    again_dir = tmp_path / "again"
    resume_60 = ["--resume", tmp_path / "step-00000060", "--checkpoint-dir", again_dir]
    _, p = train("--nproc", second, "--steps", 60, *small_data, *resume_60, cache=cache)
    assert "already at the last step (60)" in p.stderr
    again = checkpoint_tensors(again_dir / "step-00000060")
    assert set(again) == set(saved) and [k for k in saved if not torch.equal(again[k], saved[k])] == []
    after, p = train("--nproc", second, "--steps", 61, "--resume", *common, cache=cache)
    assert f"at world size {second} from {first}" in p.stderr
    assert after["steps"] == 61 and after["world_size"] == second
    # one more step from the loaded state: still as good as when saved (nothing was lost in resharding)
    assert after["auc"] > before["auc"] - 0.01, (before, after)
    # and the tables the second run started from are the saved ones: the step-61 tables differ from
    # step 60 only in rows that step touched
    now = checkpoint_tensors(tmp_path / "step-00000061")
    key = next(k for k in saved if k.endswith("embedding_bags.t_C9.weight"))  # 3 rows: all touched
    small = next(k for k in saved if k.endswith("embedding_bags.t_C3.weight"))  # 1,000 rows
    changed = (now[small] != saved[small]).any(dim=1).float().mean().item()
    assert changed < 0.9, changed
    assert now[key].shape == saved[key].shape


def test_failing_rank_stops_the_job_and_is_named(cache, tmp_path):
    import subprocess
    import sys

    from .helpers import REPO

    data = tmp_path / "data"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tpurec.cli",
            "data",
            "synth",
            "--rows",
            "40000",
            "--rows-per-file",
            "20000",
            "--row-group-size",
            "20000",
            "--out",
            str(data),
        ],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    f = data / "part-00001.parquet"  # rank 1's file (one row group per file, dealt in order)
    t = pq.read_table(f)
    c1 = t.column("C1").to_pylist()
    c1[3] = 10**6
    t = t.set_column(t.schema.get_field_index("C1"), "C1", pa.array(c1, pa.int64()))
    pq.write_table(t, f)
    _, p = train("--nproc", 2, "--data", data, "--steps", 20, cache=cache, check=False, timeout=300)
    assert p.returncode != 0
    assert f"rank 1: {f}" in p.stderr and "out of range" in p.stderr
