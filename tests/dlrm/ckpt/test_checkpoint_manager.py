"""`CheckpointManager` on real files: the interval, save and retention, resume (newest intact, a
named one, none yet), the config check, restoring the reader and RNGs, the lock and the space check.

A small torch module stands in for the DMP (DCP needs no process group for one rank), as in
tests/reliability/test_checkpoint_faults.py; the trainer's own use is covered by tests/dlrm/test_train.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.dlrm.helpers import checkpoint_meta
from tpurec.dlrm.ckpt import CheckpointManager
from tpurec.dlrm.ckpt.lock import CheckpointDirInUse
from tpurec.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CONFIG = {"name": "m", "embedding_dim": 16}


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # optimizer state to save too
    return model, opt


def _reader_state(step: int) -> dict:
    return {
        "epoch": 0,
        "rows_consumed": 64 * step,
        "num_rows": 1000,
        "rank": 0,
        "world_size": 1,
        "seed": 0,
        "shuffle": True,
    }


def _save(m: CheckpointManager, step: int, model, opt):
    return m.save(step, model, opt, _reader_state(step), checkpoint_meta(step, **CONFIG))


class _Reader:
    def __init__(self) -> None:
        self.state: dict | None = None

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_the_interval_falls_on_multiples_before_the_last_step(tmp_path):
    m = CheckpointManager(tmp_path / "ck", every=3)
    assert [s for s in range(1, 11) if m.is_due(s)] == [3, 6, 9]
    assert [s for s in range(1, 10) if m.should_save(s, last_step=9)] == [3, 6]  # 9: the final save
    assert not any(CheckpointManager(tmp_path, every=0).is_due(s) for s in range(1, 10))
    off = CheckpointManager(None, every=3)  # no --checkpoint-dir: nothing is ever due
    assert not off.enabled and not any(off.is_due(s) for s in range(1, 10))


def test_save_keeps_the_newest_and_resume_loads_the_latest(tmp_path):
    said: list[str] = []
    root = tmp_path / "ck"
    m = CheckpointManager(root, every=1, keep=2, say=said.append)
    model, opt = _model_and_optimizer()
    paths = [_save(m, s, model, opt) for s in (1, 2, 3)]
    assert [p.name for p in paths] == ["step-00000001", "step-00000002", "step-00000003"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000002", "step-00000003"]
    assert said == [f"checkpoint: {p}" for p in paths]
    assert m.latest() == paths[-1]
    m.verify(paths[-1])

    other, other_opt = _model_and_optimizer(seed=1)
    assert not torch.equal(other.weight, model.weight)
    meta, state = m.resume("latest", other, other_opt, CONFIG)
    assert meta["step"] == 3 and meta["path"] == str(paths[-1])
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert state is not None and state["step"] == 3 and state["reader"] == _reader_state(3)

    rng = state["rng"]
    random.random()  # move the RNGs on: restore puts back those of the save
    reader = _Reader()
    m.restore(state, reader)
    assert reader.state == _reader_state(3)
    assert CheckpointManager(None).resume(None, other, other_opt, CONFIG) is None
    from tpurec.dlrm.ckpt.checkpoint import rng_state

    assert rng_state() == rng


def test_purge_with_keep_0_keeps_every_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path, keep=0)
    model, opt = _model_and_optimizer()
    for s in (1, 2, 3):
        _save(m, s, model, opt)
    assert m.purge() == [] and len(list(tmp_path.glob("step-*"))) == 3
    m.keep = 1
    assert [p.name for p in m.purge()] == ["step-00000001", "step-00000002"]
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-00000003"]


def test_resume_latest_of_an_empty_directory_starts_from_scratch(tmp_path):
    said: list[str] = []
    m = CheckpointManager(tmp_path, say=said.append)
    model, opt = _model_and_optimizer()
    assert m.resume("latest", model, opt, CONFIG) is None
    assert said == [f"resume: no complete checkpoint in {tmp_path}; starting from scratch"]
    with pytest.raises(UserError, match=r"--resume needs --checkpoint-dir \(or --resume PATH\)"):
        CheckpointManager(None).resume("latest", model, opt, CONFIG)


def test_a_damaged_newest_is_skipped_and_a_named_one_refused(tmp_path):
    said: list[str] = []
    m = CheckpointManager(tmp_path, say=said.append)
    model, opt = _model_and_optimizer()
    first, newest = _save(m, 1, model, opt), _save(m, 2, model, opt)
    (newest / "meta.json").write_text("{}")  # no longer what CHECKSUMS.json lists
    said.clear()
    assert m.find("latest") == first
    assert len(said) == 1 and said[0].startswith(f"resume: checkpoint {newest} is damaged")
    assert said[0].endswith("; trying the previous checkpoint")
    with pytest.raises(UserError, match=rf"^resume: checkpoint {newest} is damaged"):
        m.find(str(newest))
    (first / "meta.json").write_text("{}")
    with pytest.raises(UserError, match=r"is intact and verified \(see above\); leave out --resume"):
        m.find("latest")


def test_a_checkpoint_of_another_config_is_refused_before_loading(tmp_path):
    m = CheckpointManager(tmp_path)
    model, opt = _model_and_optimizer()
    path = _save(m, 1, model, opt)
    other, other_opt = _model_and_optimizer(seed=1)
    before = other.weight.clone()
    with pytest.raises(UserError, match=r"^resume: .* was written with embedding_dim = 16 \(--embedding-dim\)"):
        m.load(path, other, other_opt, {"name": "m", "embedding_dim": 32})
    assert torch.equal(other.weight, before)  # refused before DCP wrote into the model


def test_one_run_per_directory(tmp_path):
    first, second = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
    first.lock()
    with pytest.raises(CheckpointDirInUse, match=f"--checkpoint-dir {tmp_path} is in use by another run"):
        second.lock()
    CheckpointManager(tmp_path, rank=1).lock()  # only rank 0 takes it
    first.close()
    second.lock()
    second.close()


def test_a_disk_without_room_is_refused(tmp_path, monkeypatch):
    from tpurec.dlrm.ckpt import space

    model, opt = _model_and_optimizer()
    CheckpointManager(tmp_path).check_room(model, opt)
    monkeypatch.setattr(space, "free_disk_bytes", lambda root: 100)
    with pytest.raises(UserError, match=r"a checkpoint of this model needs about .* but only 100 bytes are free"):
        CheckpointManager(tmp_path).check_room(model, opt)
    CheckpointManager(None).check_room(model, opt)  # no --checkpoint-dir: nothing to check
