"""Every resume path reads exactly the rows the uninterrupted run would have read next (issue #29,
family 10): same world size (exact), another world size (the same epoch, the same whole batches
through it), mid-epoch and at an epoch's end, with and without batches prepared ahead.

Step counts alone miss a reader restarted at the start of its epoch: the batches' contents are
compared (a fingerprint of each batch's dense values, ids and labels). One uninterrupted run of
12 steps (3,000 rows, batch 512: 5 steps per epoch) checkpoints every step; each case resumes one
of its checkpoints in this process and records what it trains on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.batchlog.sitecustomize import fingerprint as _fingerprint
from tpurec.dlrm.ckpt.integrity import write_checksums
from tpurec.dlrm.options import TrainOptions
from tpurec.dlrm.training.data import position_in_epoch

STEPS = 12  # over two epochs
TINY: dict[str, Any] = dict(synth_rows=3000, eval_every=0, curves_out="none", quiet=True, steps=STEPS)


def _trained_batches(options: TrainOptions) -> list[str]:
    """Run `options` in this process; the fingerprints of the batches its steps took, in order."""
    import torch

    from tpurec.dlrm.trainer import Trainer

    threads = torch.get_num_threads()
    trainer = Trainer(options)
    try:
        trainer.setup()
        taken: list[str] = []

        def recorded(stream):
            for batch in stream:  # what the pipeline pulls: exactly the batches trained (it drains per segment)
                taken.append(_fingerprint(batch))
                yield batch

        trainer.data.stream = recorded(trainer.data.stream)
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    return taken


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_cache) -> tuple[Path, list[str]]:
    """The checkpoints (one per step) and batches of a run that is never interrupted."""
    root = tmp_path_factory.mktemp("uninterrupted") / "ck"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPUREC_CACHE", str(tiny_cache))
        batches = _trained_batches(TrainOptions(**TINY, checkpoint_dir=str(root), checkpoint_every=1, keep=0))
    assert len(batches) == STEPS and len(set(batches)) == STEPS  # every batch its own rows
    return root, batches


def _resumed(step: Path, monkeypatch, tiny_cache, **more) -> list[str]:
    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    return _trained_batches(TrainOptions(**TINY, resume=str(step), **more))


# (checkpoint step, pipeline depth): mid-epoch, at the end of the first epoch's batches, mid second epoch
SAME = [(2, 4), (5, 4), (7, 4), (7, 0)]


@pytest.mark.parametrize("at,depth", SAME, ids=["mid_epoch", "epoch_end", "second_epoch", "inline_reader"])
def test_resume_at_the_same_world_size_reads_the_next_rows(uninterrupted, tiny_cache, monkeypatch, capsys, at, depth):
    root, batches = uninterrupted
    got = _resumed(root / f"step-{at:08d}", monkeypatch, tiny_cache, pipeline_depth=depth)
    assert "exact (same world size)" in capsys.readouterr().err
    assert got == batches[at:]


@pytest.mark.parametrize("at", [1, 2, 5, 7], ids=["first_batch", "mid_epoch", "epoch_end", "second_epoch"])
def test_resume_at_another_world_size_reads_the_rows_at_the_same_fraction(
    uninterrupted, tiny_cache, tmp_path, monkeypatch, capsys, at
):
    """The checkpoint says it was written by 2 ranks: the resume takes its other-world-size path
    (epoch and fraction, not the rank's reader state). At 1 rank the fraction is a whole number of
    batches, so the next rows are exactly the uninterrupted run's."""
    import shutil

    root, batches = uninterrupted
    step = tmp_path / f"step-{at:08d}"
    shutil.copytree(root / step.name, step)
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps(meta | {"world_size": 2}))
    write_checksums(step)
    got = _resumed(step, monkeypatch, tiny_cache)
    assert f"at world size 1 from 2: data position approximate (epoch {meta['epoch']}," in capsys.readouterr().err
    assert got == batches[at:]


def test_a_fraction_of_whole_batches_resumes_at_those_batches_at_any_epoch_size():
    """The fraction saved (rows / rows per epoch) times the new epoch's rows lands on a whole batch
    even where float arithmetic falls just short of it (1024 / 2850 * 2850 < 1024)."""
    for rows in (2850, 2851, 107, 99_999, 4_000_000_001):
        for batch in (64, 100, 512):
            for done in range(0, min(rows, 64 * batch), batch):
                assert position_in_epoch(done / rows, rows, batch) == done
                assert position_in_epoch(done / rows, 2 * rows, batch) == 2 * done  # 2 ranks -> 1: twice the rows


REPO = Path(__file__).resolve().parents[2]
TINY_FLAGS = ["--synth-rows", "3000", "--eval-every", "0", "--curves-out", "none", "--quiet"]


def _train_logged(log: Path, cache: Path, *args) -> tuple[list[str], str]:
    """A real `tpurec train ARGS` (every rank a process of its own); the batches rank 0 trained on,
    recorded by tests/reliability/batchlog/sitecustomize.py."""
    log.mkdir()
    env = dict(
        os.environ,
        TPUREC_CACHE=str(cache),
        TPUREC_TEST_BATCH_LOG=str(log),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent / "batchlog"), str(REPO)]),
    )
    cmd = [sys.executable, "-m", "tpurec.cli", "train", *TINY_FLAGS, *map(str, args)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    return (log / "rank-0.txt").read_text().split(), p.stderr


@pytest.mark.slow  # three real runs, one of two ranks: about a minute
@pytest.mark.multiprocess
def test_a_run_saved_at_2_ranks_resumes_at_1_on_the_next_rows(tmp_path, tiny_cache):
    """Saved by `tpurec train --nproc 2` after 2 steps (2 x 512 rows each: 2,048 of the epoch's 2,850
    rows), resumed by `tpurec train --resume` at 1 rank: the 1-rank run goes on with the batches an
    uninterrupted 1-rank run trains from row 2,048 on, its 5th batch on (not the epoch's first)."""
    ck = tmp_path / "ck"
    reference, _ = _train_logged(tmp_path / "ref", tiny_cache, "--steps", 10)
    assert len(reference) == 10 and len(set(reference)) == 10
    _train_logged(tmp_path / "two", tiny_cache, "--nproc", 2, "--steps", 2, "--checkpoint-dir", ck)
    got, said = _train_logged(tmp_path / "one", tiny_cache, "--steps", 8, "--checkpoint-dir", ck, "--resume")
    assert "at world size 1 from 2" in said
    assert got == reference[4:10]


def test_a_checkpoint_saved_after_the_epochs_last_batch_resumes_at_the_next_epoch(
    tmp_path, tiny_cache, monkeypatch, capsys
):
    """2,695 synthetic rows hold out 135 for evaluation: 2,560 train rows, 5 whole batches of 512. The
    checkpoint after step 5 has read every row of its epoch (`rows_consumed == num_rows`, which a
    `>=` in the train state's check refused as past the epoch); resumed, it trains the next epoch's
    batches, as the uninterrupted run did."""
    from tpurec.dlrm.ckpt.checkpoint import train_state_file

    root = tmp_path / "ck"
    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    at_end = dict(TINY, synth_rows=2695, steps=7)
    batches = _trained_batches(TrainOptions(**at_end, checkpoint_dir=str(root), checkpoint_every=5, keep=0))
    assert len(batches) == 7 and len(set(batches)) == 7
    step = root / "step-00000005"
    reader = json.loads(train_state_file(step, 0).read_text())["reader"]
    assert reader["rows_consumed"] == reader["num_rows"] == 2560 and reader["epoch"] == 0
    capsys.readouterr()
    got = _trained_batches(TrainOptions(**at_end, resume=str(step)))
    assert "exact (same world size)" in capsys.readouterr().err
    assert got == batches[5:]
