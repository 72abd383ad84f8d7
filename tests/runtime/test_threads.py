"""Torch's thread count per rank under tpurec.DistributedModelParallel (tpurec/runtime/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpurec.runtime import threads

REPO = Path(__file__).resolve().parents[2]


def test_cores_are_divided_among_the_local_ranks():
    assert threads.choose(None, {}, cores=8, local_ranks=4, current=8, torch_default=8) == (
        2,
        "8 cores / 4 local rank(s)",
    )
    assert threads.choose(None, {}, cores=2, local_ranks=4, current=2, torch_default=2)[0] == 1  # at least one
    # One process on all its cores: torch's own count already fits, left alone.
    assert threads.choose(None, {}, cores=8, local_ranks=1, current=8, torch_default=8)[0] is None


def test_cores_busy_with_other_work_are_left_to_it():
    # A shared 8-core host with 1.6 cores idle: 2 threads, however many torch starts with.
    assert threads.choose(None, {}, cores=8, local_ranks=1, current=8, torch_default=8, idle=1.6) == (
        2,
        "8 cores, 1.6 idle / 1 local rank(s)",
    )
    assert threads.choose(None, {}, cores=2, local_ranks=1, current=2, torch_default=2, idle=0.1)[0] == 1
    assert threads.choose(None, {}, cores=2, local_ranks=1, current=2, torch_default=2, idle=1.9)[0] is None
    assert threads.choose(None, {}, cores=16, local_ranks=2, current=16, torch_default=16, idle=12.0)[0] == 6


def test_idle_cores_are_measured_between_none_and_all():
    cpus = os.sched_getaffinity(0)
    idle = threads.idle_cores(cpus, seconds=0.05)
    assert idle is None or 0.0 <= idle <= len(cpus) + 1e-9


def test_the_users_choice_wins():
    assert threads.choose(3, {"OMP_NUM_THREADS": "1"}, 8, 4, 8, 8) == (3, "threads=")
    assert threads.choose(None, {"TPUREC_THREADS": "5"}, 8, 4, 8, 8) == (5, "TPUREC_THREADS")
    assert threads.choose(None, {"OMP_NUM_THREADS": "4"}, 8, 4, 4, 8) == (None, "OMP_NUM_THREADS is set")
    assert threads.choose(None, {"MKL_NUM_THREADS": "4"}, 8, 4, 4, 8)[0] is None
    # torch.set_num_threads(6) before the DMP: the count differs from torch's start-up one.
    assert threads.choose(None, {}, 8, 4, current=6, torch_default=8) == (None, "torch.set_num_threads was called")


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_a_bad_thread_count_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"TPUREC_THREADS='{bad}'"):
        threads.choose(None, {"TPUREC_THREADS": bad}, 8, 4, 8, 8)
    with pytest.raises(ValueError, match="threads=0"):
        threads.choose(0, {}, 8, 4, 8, 8)


PROGRAM = """
import sys, torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
import tpurec
if sys.argv[1] != "default":
    torch.set_num_threads(int(sys.argv[1]))
before = torch.get_num_threads()
ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10, feature_names=["f"])],
                             device=torch.device("meta"))
model = tpurec.DistributedModelParallel(torch.nn.Sequential(ebc), device="cpu")
tpurec.DistributedModelParallel(torch.nn.Sequential(EmbeddingBagCollection(ebc._embedding_bag_configs,
                                device=torch.device("meta"))), device="cpu")
print("threads", before, torch.get_num_threads())
"""


def _run(tmp_path, mode: str, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TPUREC_THREADS")}
    p = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(base, PYTHONPATH=str(REPO), **env),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_dmp_sets_the_share_once_and_says_how_to_override(tmp_path):
    cores = len(os.sched_getaffinity(0))
    if threads.physical_cores() < 2 or cores < 2:
        pytest.skip("one core: torch's count is already one thread")
    p = _run(tmp_path, "default", LOCAL_WORLD_SIZE=str(cores))  # as many ranks as cores: one thread each
    line = [w for w in p.stdout.splitlines() if w.startswith("threads")][0]
    assert line == f"threads {threads.physical_cores()} 1"
    said = [w for w in p.stderr.splitlines() if "thread(s) per rank" in w]
    assert len(said) == 1 and "threads=N" in said[0] and "TPUREC_THREADS" in said[0], p.stderr[-2000:]


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
def test_dmp_keeps_a_count_the_user_set(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core")
    default = threads.physical_cores()
    p = _run(tmp_path, "default", LOCAL_WORLD_SIZE="2", TPUREC_THREADS=str(default + 1))
    assert f"threads {default} {default + 1}" in p.stdout and "per rank" not in p.stderr
    p = _run(tmp_path, str(default + 2), LOCAL_WORLD_SIZE="2")  # torch.set_num_threads before the DMP
    assert f"threads {default + 2} {default + 2}" in p.stdout and "per rank" not in p.stderr
