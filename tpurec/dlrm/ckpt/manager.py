"""`CheckpointManager`: the one object a training run holds for everything it does with checkpoints.

The modules beside this one each own one concern (checkpoint.py the DCP save/load and the atomic
layout, meta.py and integrity.py what is checked before a checkpoint is trusted, config.py and
shapes.py whether it fits this model, dcp_guard.py the unpickling allow-list, space.py the room on
disk, lock.py one run per directory). A run needs them in a fixed order at fixed moments, and
before this class the trainer called them one by one; the manager keeps that order in one place
(the shape of torchtitan's CheckpointManager: save, load/resume, the save interval, retention):

  lock()        rank 0, before any data is made: two runs in one directory would mix checkpoints
  resume(...)   `--resume` / `--resume PATH`: find the newest checkpoint that verifies (or the one
                named), check its config and tensors against this model, load it
  check_room()  before the first step: a disk too small fails now, not at the first save
  is_due(step)  the save interval (`--checkpoint-every`, default `--eval-every`)
  save(...)     every rank; then purge() keeps the newest `--keep` complete ones
  save_best(...) every rank, `--keep-best`: the best evaluation's checkpoint under root/best/, alone

Messages, file formats and the order of every check are those of the module functions it calls.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

from tpurec.dlrm.ckpt import checkpoint
from tpurec.errors import UserError

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer


class _Reader(Protocol):
    """What a checkpoint restores a data reader through (ParquetReader, the prefetcher)."""

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointManager:
    """Checkpoints of one run under `root` (`--checkpoint-dir`; None: the run saves none, but may
    still resume from `--resume PATH`). `every`: steps between saves (0: only the final one);
    `keep`: complete checkpoints kept (0: all); `rank`: this process's rank (only rank 0 locks);
    `say`: where progress lines go (the trainer's: rank 0 only)."""

    def __init__(
        self,
        root: str | os.PathLike | None,
        *,
        every: int = 0,
        keep: int = 0,
        rank: int = 0,
        say: Callable[[str], object] = print,
    ) -> None:
        # Kept as given, not as a Path: messages name the directory as the user typed it.
        self.root = root
        self.every = every
        self.keep = keep
        self.rank = rank
        self.say = say
        self._lock: TextIO | None = None

    @property
    def enabled(self) -> bool:
        """True when the run writes checkpoints (it has a --checkpoint-dir)."""
        return bool(self.root)

    # ---- before training ----
    def lock(self) -> None:
        """Hold the directory's lock for the life of this manager (rank 0 only: one holder per run
        is enough, and the other ranks may share its filesystem); CheckpointDirInUse if another run
        holds it. Nothing without a root, nor in a bucket, which has no lock that a killed run
        releases: one run at a time writes a bucket's directory (docs/checkpoints.md)."""
        from tpurec.runtime import storage

        if self.enabled and self.rank == 0 and self._lock is None and not storage.is_uri(self.root or ""):
            from tpurec.dlrm.ckpt.lock import lock_dir

            assert self.root is not None
            self._lock = lock_dir(self.root)

    def close(self) -> None:
        """Release the lock now (it is otherwise released when this process ends)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def check_room(self, dmp: nn.Module, optimizer: Optimizer) -> None:
        """UserError unless the root's disk has room for one checkpoint of this model (space.py);
        nothing without a root."""
        if self.enabled:
            from tpurec.dlrm.ckpt.space import check_room

            assert self.root is not None
            check_room(self.root, dmp, optimizer)

    # ---- the interval ----
    def is_due(self, step: int) -> bool:
        """True at a step where the interval falls (a training segment ends there)."""
        return bool(self.enabled and self.every and step % self.every == 0)

    def should_save(self, step: int, last_step: int) -> bool:
        """True where a periodic save goes: an interval step before the last (the last step always
        saves, separately, before the final evaluation)."""
        return self.is_due(step) and step != last_step

    # ---- save and retention ----
    def save(self, step: int, dmp: nn.Module, optimizer: Optimizer, reader_state: dict, meta: dict) -> Path:
        """Collective (every rank): write checkpoint `step` with the reader position `reader_state`
        and the RNG states as this rank's train state, and `meta` (rank 0) as meta.json; then keep
        the newest `keep`. Returns its directory; CheckpointWriteError when it cannot be written."""
        assert self.root is not None  # checkpoints are written only into one
        train_state = {"reader": reader_state, "rng": checkpoint.rng_state(), "step": step}
        # checkpoint.save purges (rank 0) before its last barrier: no rank goes on while it deletes.
        path = checkpoint.save(self.root, step, dmp, optimizer, train_state, meta, keep=self.keep)
        self.say(f"checkpoint: {path}")
        return path

    def best_root(self) -> Path:
        """Where `--keep-best` keeps its checkpoint: a checkpoint directory of its own (`--resume
        ROOT/best` takes it), which the root's `step-*` listing, retention and `--resume` never see."""
        from tpurec.runtime import storage

        assert self.root is not None
        return storage.path(self.root) / "best"

    def save_best(self, step: int, dmp: nn.Module, optimizer: Optimizer, reader_state: dict, meta: dict) -> Path:
        """Collective: write checkpoint `step` under `best_root()` as `save` does, then (rank 0) delete
        the best one before it, so the best stays the one checkpoint there (by evaluation, not by
        step: a run resumed from an earlier step may have left a later one)."""
        root = self.best_root()
        train_state = {"reader": reader_state, "rng": checkpoint.rng_state(), "step": step}
        path = checkpoint.save(root, step, dmp, optimizer, train_state, meta, keep=0)
        if self.rank == 0:
            for old in checkpoint.complete_checkpoints(root):
                if old.name != path.name:
                    checkpoint.delete(old)
        self.say(f"best checkpoint: {path}")
        return path

    def purge(self) -> list[Path]:
        """Delete all but the newest `keep` complete checkpoints (rank 0's job; save does it);
        returns those deleted."""
        return checkpoint.purge(self.root, self.keep) if self.root else []

    # ---- find, verify, load ----
    def latest(self) -> Path | None:
        """The newest complete checkpoint under the root (not verified), or None."""
        return checkpoint.latest(self.root) if self.root else None

    def verify(self, path: str | os.PathLike) -> None:
        """CorruptCheckpointError unless every file of checkpoint `path` matches its manifest and its
        metadata is sane (checkpoint.verify)."""
        checkpoint.verify(path)

    def find(self, resume: str) -> Path | None:
        """The checkpoint `--resume` means, verified: "latest" (or a directory of checkpoints) the
        newest that verifies, naming each newer one skipped; else that checkpoint or a UserError.
        None: "latest" with no complete checkpoint yet (the run starts from scratch)."""
        src = self.root if resume == "latest" else resume
        if not src:
            raise UserError("--resume needs --checkpoint-dir (or --resume PATH)")
        if resume == "latest" or checkpoint.is_root(src):
            if checkpoint.latest(src) is None and resume == "latest":
                self.say(f"resume: no complete checkpoint in {src}; starting from scratch")
                return None
            found = checkpoint.latest_intact(src, self.say)
            if found is None:
                why = "intact and verified (see above)" if checkpoint.latest(src) else "complete"
                raise UserError(f"resume: no checkpoint in {src} is {why}; leave out --resume to start over")
            return found
        path = checkpoint.resolve(src)
        try:
            checkpoint.verify(path)  # --resume PATH: that checkpoint or none
        except checkpoint.CorruptCheckpointError as e:
            raise UserError(f"resume: {e}") from None
        return path

    def load(
        self, path: str | os.PathLike, dmp: nn.Module, optimizer: Optimizer, config: dict, verified: bool = False
    ) -> tuple[dict, dict | None]:
        """Load checkpoint `path` into `dmp` and `optimizer` after checking it was written for this
        model's `config` (a DLRMConfig.to_dict()): (its meta with "path", this rank's train state or
        None at another world size). Refusals are UserErrors starting "resume: "."""
        from tpurec.dlrm.ckpt.config import config_mismatch

        mismatch = config_mismatch(path, config)
        if mismatch:
            raise UserError(f"resume: {mismatch}")
        try:
            return checkpoint.load(path, dmp, optimizer, verified=verified)
        except (checkpoint.CheckpointMismatchError, checkpoint.CorruptCheckpointError) as e:
            raise UserError(f"resume: {e}") from None

    def resume(
        self, resume: str | None, dmp: nn.Module, optimizer: Optimizer, config: dict
    ) -> tuple[dict, dict | None] | None:
        """`find` then `load` (the checkpoint found was just verified: hashing it twice costs
        minutes on a large one); None when there is nothing to resume."""
        if not resume:
            return None
        path = self.find(resume)
        if path is None:
            return None
        return self.load(path, dmp, optimizer, config, verified=True)

    @staticmethod
    def restore(train_state: dict, reader: _Reader) -> None:
        """Put this rank's reader position and RNG states back (a checkpoint of the same world size):
        the reader first, then the RNGs, so nothing the reader draws moves them."""
        reader.load_state_dict(train_state["reader"])
        checkpoint.set_rng_state(train_state["rng"])
