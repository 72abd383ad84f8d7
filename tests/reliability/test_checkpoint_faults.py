"""Checkpoint faults: a full disk during a save, damaged shard files, a checkpoint of another model.

Saves here go through `tpurec.dlrm.ckpt.checkpoint.save` with a small torch module in this process (DCP
needs no process group for one rank), so the faults are cheap to inject: a full disk by a write
wrapper around DCP's file streams (runs anywhere; the real full disk, a small tmpfs, is in
test_run_faults.py). Flipped bits and an interrupted save are in tests/dlrm/test_train.py.
"""

from __future__ import annotations

import errno
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from tests.dlrm.helpers import checkpoint_meta, train_state
from tpurec.dlrm.ckpt import checkpoint as ckpt
from tpurec.dlrm.ckpt.config import config_mismatch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # optimizer state to save too
    return model, opt


def _save(root, step, model, opt, **kw):
    meta = checkpoint_meta(step, name="m", embedding_dim=16)
    return ckpt.save(root, step, model, opt, train_state(step), meta, **kw)


class _FullDisk:
    """A file whose writes fail with ENOSPC once `room` bytes are written (as a full disk does);
    everything else goes to the real file."""

    def __init__(self, real, room):
        self.real, self.room = real, room

    error = OSError(errno.ENOSPC, "No space left on device")

    def write(self, data):
        if len(data) > self.room:
            raise self.error
        self.room -= len(data)
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def full_disk(monkeypatch):
    """DCP's data files get 1 KiB of room; everything else writes normally."""
    original = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as real:
            yield _FullDisk(real, 1024) if "w" in mode and str(path).endswith(".distcp") else real

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


# What a full disk raises inside DCP: ENOSPC from write(), or (torch.save's zip writer, seen on a real
# full tmpfs in test_run_faults.py) a RuntimeError that names no errno, told apart by the free space.
RAISED = {
    "enospc": OSError(errno.ENOSPC, "No space left on device"),
    "zip_writer": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
}


@pytest.mark.parametrize("raised", list(RAISED))
def test_a_full_disk_during_a_save_is_named_and_keeps_the_previous_checkpoint(tmp_path, request, monkeypatch, raised):
    root = tmp_path / "ck"
    model, opt = _model_and_optimizer()
    first = _save(root, 3, model, opt)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    request.getfixturevalue("full_disk")  # from here on the disk is full
    monkeypatch.setattr(_FullDisk, "error", RAISED[raised])
    monkeypatch.setattr(ckpt, "_nearly_full", lambda path: True)  # what statvfs says on a full disk
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        _save(root, 6, model, opt, keep=1)  # keep=1 would delete step 3 after a good save
    message = str(e.value)
    assert message == (
        f"no space left on device writing {root / 'step-00000006.tmp'}; the previous checkpoint {first} is intact. "
        "Free space or give another --checkpoint-dir"
    )
    assert "\n" not in message and "Traceback" not in message
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]  # the unfinished .tmp is gone
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    ckpt.verify(first)
    fresh = torch.nn.Linear(64, 32)
    fresh_opt = torch.optim.Adagrad(fresh.parameters(), lr=0.1)
    meta, state = ckpt.load(root, fresh, fresh_opt)  # resumable: the newest complete one loads
    assert meta["step"] == 3 and state["step"] == 3 and state["reader"] == train_state(3)["reader"]
    assert torch.equal(fresh.weight, model.weight)


def test_any_other_failure_inside_dcp_is_one_line_naming_rank_and_error(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    model, opt = _model_and_optimizer()
    first = _save(root, 3, model, opt)
    original = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and str(path).endswith(".distcp"):
            raise ValueError("codec exploded\nsecond line of detail")
        with original(self, path, mode) as real:
            yield real

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        _save(root, 6, model, opt)
    assert str(e.value) == (
        f"cannot write checkpoint {root / 'step-00000006.tmp'}: rank 0 failed in torch.distributed.checkpoint "
        f"with ValueError: codec exploded; the previous checkpoint {first} is intact"
    )
    assert "CheckpointException" in repr(e.value.__cause__)  # DCP's own report stays on the chain
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]


def test_saving_the_same_step_again_keeps_the_old_copy_until_the_new_one_is_complete(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    model, opt = _model_and_optimizer()
    first = _save(root, 3, model, opt)
    monkeypatch.setattr(ckpt, "_barrier", lambda: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    with pytest.raises(ckpt.CheckpointWriteError, match=r"cannot write checkpoint .*step-00000003.tmp: Read-only"):
        _save(root, 3, model, opt)
    ckpt.verify(first)
    assert (first / ckpt.MARKER).exists()


def _damage_truncate(f: Path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _damage_zero(f: Path):
    f.write_bytes(bytes(f.stat().st_size))


def _damage_empty(f: Path):
    f.write_bytes(b"")


def _damage_delete(f: Path):
    f.unlink()


DAMAGE = [
    # (how the newest checkpoint's largest DCP shard is damaged, what the message says)
    (_damage_truncate, r"bytes, [\d,]+ written"),
    (_damage_zero, r"contents changed since it was written \(checksum mismatch\)"),
    (_damage_empty, r": 0 bytes, [\d,]+ written"),
    (_damage_delete, r": missing"),
]


@pytest.mark.parametrize("damage,says", DAMAGE, ids=[d.__name__.removeprefix("_damage_") for d, _ in DAMAGE])
def test_resume_skips_a_damaged_shard_for_the_newest_intact_checkpoint(tmp_path, damage, says):
    root = tmp_path / "ck"
    model, opt = _model_and_optimizer()
    first = _save(root, 3, model, opt)
    newest = _save(root, 6, model, opt)
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    damage(shard)
    said = []
    assert ckpt.latest_intact(root, said.append) == first
    assert len(said) == 1 and said[0].startswith(f"resume: checkpoint {newest} is damaged: {shard}")
    assert __import__("re").search(says, said[0]) and said[0].endswith("trying the previous checkpoint")
    with pytest.raises(ckpt.CorruptCheckpointError, match=says):  # --resume PATH of the damaged one
        ckpt.load(newest, model, opt)


def test_damaged_checksums_file_is_named(tmp_path):
    model, opt = _model_and_optimizer()
    path = _save(tmp_path / "ck", 3, model, opt)
    (path / "CHECKSUMS.json").write_text('{"__0_0.distcp": {"bytes"')  # truncated
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"CHECKSUMS.json: unreadable"):
        ckpt.verify(path)


@pytest.mark.parametrize(
    "field,ours,says",
    [
        ("embedding_dim", 32, "was written with embedding_dim = 16 (--embedding-dim), this run has 32"),
        ("name", "criteo-kaggle", "was written with name = m (--model), this run has criteo-kaggle"),
        ("dense_arch", (64, 8), "dense_arch = [64, 16] (--dense-arch), this run has [64, 8]: a checkpoint"),
    ],
)
def test_a_checkpoint_of_another_model_config_is_refused_naming_field_and_values(tmp_path, field, ours, says):
    path = tmp_path / "step-00000003"
    path.mkdir()
    saved = {"name": "m", "embedding_dim": 16, "dense_arch": [64, 16], "embedding_lr": 0.1}
    (path / "meta.json").write_text(json.dumps({"config": saved}))
    current = dict(saved, dense_arch=(64, 16)) | {field: ours}
    message = config_mismatch(path, current)
    assert message is not None and says in message and "\n" not in message
    # what may change on resume (learning rates, steps, ...) is not refused
    assert config_mismatch(path, dict(saved, dense_arch=(64, 16), embedding_lr=0.01, steps=9)) is None
    shutil.rmtree(path)
