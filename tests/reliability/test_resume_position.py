"""Every resume path reads exactly the rows the uninterrupted run would have read next (issue #29,
family 10): same world size (exact), another world size (the same epoch, the same whole batches
through it), mid-epoch and at an epoch's end, with and without batches prepared ahead.

Step counts alone miss a reader restarted at the start of its epoch: the batches' contents are
compared (a fingerprint of each batch's dense values, ids and labels). One uninterrupted run of
12 steps (3,000 rows, batch 512: 5 steps per epoch) checkpoints every step; each case resumes one
of its checkpoints in this process and records what it trains on.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tpurec.dlrm.ckpt_integrity import write_checksums
from tpurec.dlrm.options import TrainOptions
from tpurec.dlrm.trainer import position_in_epoch

STEPS = 12  # over two epochs
TINY = dict(synth_rows=3000, eval_every=0, curves_out="none", quiet=True, steps=STEPS)


def _fingerprint(batch) -> str:
    """What a batch holds, row for row: dense values, ids and labels."""
    h = hashlib.sha256()
    for t in (batch.dense_features, batch.sparse_features.values(), batch.sparse_features.lengths(), batch.labels):
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


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

        trainer._stream = recorded(trainer._stream)
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
