"""A rank's checkpoints, over the run's one `CheckpointManager` (`tpurec/dlrm/ckpt/manager.py`: the
lock, finding and loading, the interval, saving, retention): what a checkpoint records (meta.json) and
a resume must match, the resume itself, and the best evaluation so far (`--keep-best` keeps its model
as a checkpoint of its own, `--early-stop` counts evaluations without a better one: keep_best.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpurec.dlrm import keep_best
from tpurec.dlrm.keep_best import BestEval
from tpurec.errors import UserError

if TYPE_CHECKING:
    from pathlib import Path

    from tpurec.dlrm.ckpt.manager import CheckpointManager
    from tpurec.dlrm.training.data import TrainingData
    from tpurec.dlrm.training.rank_run import RankRun


class Checkpointing:
    """`saved`: the step and directory of the last checkpoint written; `best`, `best_path` (the
    checkpoint kept for it), `early_stop` (the step it stopped at, that evaluation), `eval_owed`
    (resumed where the run before evaluated last: again, for BestEval, keep_best.py)."""

    def __init__(self, run: RankRun, manager: CheckpointManager, dmp: Any, optimizer: Any, data: TrainingData) -> None:
        self.run, self.manager, self.dmp, self.optimizer, self.data = run, manager, dmp, optimizer, data
        self.saved: tuple[int, Path] | None = None
        self.best = BestEval()
        self.best_path: Path | None = None
        self.early_stop: tuple[int, dict] | None = None
        self.eval_owed = False

    def config(self) -> dict:
        """The config a checkpoint records and a resume must match: the model's, and whether its tables
        are behind the managed-collision remap (--zch: other state, other tensors)."""
        run, o = self.run, self.run.options
        own = run.user.checkpoint_config() if run.user is not None else {}
        # the remap's state differs by eviction policy, and its per-rank blocks by world size
        zch = {"zch_eviction": o.zch_eviction, "zch_ranks": run.world} if o.zch else {}
        # other dense inputs are another model's: --dense-transform resumes only as it was written
        return {**run.cfg.to_dict(), "zch": o.zch, **zch, "dense_transform": o.dense_transform, **own}

    def meta(self, step: int, samples: int, st: dict) -> dict:
        """meta.json of a checkpoint at `step` (`st`: the reader's position)."""
        data = self.data
        return {
            "step": step,
            "samples": samples,
            "world_size": self.run.world,
            "batch_size": data.batch_size,
            "epoch": st["epoch"],
            "epoch_fraction": st["rows_consumed"] / max(1, data.readers.train.num_rows),
            "config": self.config(),
            "data": str(data.data_dir),
            keep_best.META_KEY: self.best.record(),
        }

    def save(self, step: int, samples: int) -> Path:
        """Model, optimizer, reader position and RNG states at `step` (every rank)."""
        st = self.data.train_state()
        self.saved = (step, self.manager.save(step, self.dmp, self.optimizer, st, self.meta(step, samples, st)))
        return self.saved[1]

    def saved_at(self, step: int) -> Path | None:
        """The checkpoint written at `step`, if the last one was."""
        return self.saved[1] if self.saved is not None and self.saved[0] == step else None

    def resume(self, total_steps: int) -> tuple[int, int] | None:
        """`--resume`: the manager finds, checks and loads the checkpoint into the model and optimizers;
        the data position and the best evaluation follow here. The step and samples it is at."""
        run, o = self.run, self.run.options
        loaded = self.manager.resume(o.resume, self.dmp, self.optimizer, self.config())
        if loaded is None:
            return None
        cmeta, state = loaded
        step = cmeta["step"]
        self.best = BestEval.from_meta(cmeta, cmeta["path"])  # compared and counted as the run before
        self.eval_owed = bool(o.keep_best or o.early_stop) and self.best.owed(step, run.cfg.eval_every)
        how = self.data.restore(cmeta, state, self.manager)
        run.say(f"resume: {cmeta['path']} at step {step}, {how}")
        if step > total_steps:
            raise UserError(
                f"resume: the checkpoint is at step {step}, past the {total_steps} steps asked "
                "for: nothing to train (raise --steps / --epochs, or resume an earlier checkpoint)"
            )
        if step == total_steps:
            run.say(f"resume: already at the last step ({total_steps}); evaluating only")
        return step, cmeta["samples"]

    def evaluated(self, ev: dict, step: int, samples: int, total_steps: int) -> None:
        """An evaluation at `step` (every rank, the same figures): the best so far, kept as a
        checkpoint (--keep-best) when it is, and --early-stop's count."""
        o = self.run.options
        if self.best.seen(step, ev["auc"]) and o.keep_best:
            st = self.data.train_state()
            meta = {**self.meta(step, samples, st), "eval": {k: ev[k] for k in ("auc", "ne", "logloss", "accuracy")}}
            self.best_path = self.manager.save_best(step, self.dmp, self.optimizer, st, meta)
        if o.early_stop and self.best.since >= o.early_stop and step < total_steps:
            self.early_stop = (step, ev)

    def best_figures(self, total_steps: int) -> dict:
        """--keep-best / --early-stop: the result line's "best" and, when it stopped early, "early_stop"."""
        o = self.run.options
        if not (o.keep_best or o.early_stop):
            return {}
        out = {"best": keep_best.result(self.best, self.best_path)}
        if self.early_stop is not None:
            out["early_stop"] = {
                "step": self.early_stop[0],
                "steps_asked": total_steps,
                "evaluations": o.early_stop,
                "best_step": self.best.step,
            }
        return out
