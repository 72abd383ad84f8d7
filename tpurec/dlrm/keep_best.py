"""`tpurec train --keep-best` and `--early-stop N`: the best evaluation so far, and what follows from it.

A long run's eval AUC can peak early and fall (issue 63: 0.800 at step 500, 0.735 at step 4,000), and
the checkpoints a run keeps are its newest (`--keep`). `BestEval` follows the eval AUC of every
evaluation (`--eval-every`, and the final one): with `--keep-best` the model of the best one is
saved as a checkpoint of its own under `<checkpoint-dir>/best/` (CheckpointManager.save_best),
its step and eval figures in its meta.json; with `--early-stop N` training ends after N evaluations
in a row without a higher AUC. Its state goes into every checkpoint's meta.json ("best"), so a
resumed run compares, counts and stops as the uninterrupted one would; the one evaluation a
checkpoint cannot hold is the final one, taken after the final checkpoint (so that a failed
evaluation never costs it): a run resumed from there to train on evaluates that step again first
(`owed`), uncounted in the metrics, which hold it already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpurec.errors import UserError

META_KEY = "best"  # the field of a checkpoint's meta.json holding the state


@dataclass
class BestEval:
    """The best eval AUC so far (`auc`, at `step`; None before the first finite one), how many
    evaluations since it had none higher (`since`), and the step of the last evaluation (`at`)."""

    step: int | None = None
    auc: float | None = None
    since: int = 0
    at: int | None = None

    def seen(self, step: int, auc: float) -> bool:
        """Take the evaluation at `step`; True when its AUC is the best so far. A non-finite AUC (an
        eval split of one label) is never the best: it counts as no improvement."""
        self.at = step
        if math.isfinite(auc) and (self.auc is None or auc > self.auc):
            self.step, self.auc, self.since = step, auc, 0
            return True
        self.since += 1
        return False

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "auc": self.auc, "since": self.since, "at": self.at}

    def owed(self, step: int, eval_every: int) -> bool:
        """Whether a run resumed at `step` (a checkpoint holding this state) evaluates it before
        training: an evaluation step this state has not seen (the final one of the run before)."""
        return bool(eval_every) and step > 0 and step % eval_every == 0 and (self.at or 0) < step

    @classmethod
    def from_meta(cls, meta: dict, where: str) -> BestEval:
        """The state a checkpoint's meta.json recorded (none in one written without it: a fresh
        state); one line naming the checkpoint when it is not one this module wrote."""
        got = meta.get(META_KEY)
        if got is None:
            return cls()
        step, auc, since, at = (got.get(k) if isinstance(got, dict) else None for k in ("step", "auc", "since", "at"))
        sane = (
            isinstance(since, int)
            and since >= 0
            and (at is None or isinstance(at, int))
            and (step is None) == (auc is None)
            and (step is None or (isinstance(step, int) and isinstance(auc, (int, float)) and math.isfinite(auc)))
        )
        if not sane:
            raise UserError(
                f'resume: {where}/meta.json: "{META_KEY}" is {got!r}; must be {{"step": int, "auc": number, '
                '"since": int, "at": int}'
            )
        assert isinstance(since, int)  # checked above (for mypy)
        return cls(step, None if auc is None else float(auc), since, at)


def result(best: BestEval, path: Path | None) -> dict[str, Any]:
    """The result line's "best": the step and AUC, and the checkpoint kept for it (--keep-best)."""
    out: dict[str, Any] = {"step": best.step, "auc": None if best.auc is None else round(best.auc, 6)}
    return out | ({"checkpoint": str(path)} if path is not None else {})


def summary_lines(r: dict) -> list[str]:
    """The summary's lines for the result line's "best" and "early_stop"."""
    lines = []
    best, stop = r.get("best"), r.get("early_stop")
    if best and best["step"] is not None:
        kept = f": {best['checkpoint']}" if best.get("checkpoint") else ""
        lines.append(f"  best eval      AUC {best['auc']:.4f} at step {best['step']:,}{kept}")
    if stop:
        than = f"an AUC above step {stop['best_step']:,}'s" if stop["best_step"] is not None else "a finite AUC"
        lines.append(
            f"  early stop     at step {stop['step']:,} of {stop['steps_asked']:,}: {stop['evaluations']} "
            f"evaluation(s) in a row without {than} (--early-stop)"
        )
    return lines
