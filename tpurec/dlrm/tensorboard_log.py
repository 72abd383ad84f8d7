"""`tpurec train --tensorboard DIR`: the metrics rows as TensorBoard scalars (rank 0).

Written with torch.utils.tensorboard (the `tensorboard` package), one scalar per figure, named
`<kind>/<field>` as the metrics file's columns are (docs/train.md lists them):
- train/loss, train/samples_per_s at every logged training step (the metrics file's "train" rows);
- eval/auc, eval/ne, eval/logloss, eval/accuracy at every evaluation;
- with --zch, train/zch_remapped_ids, .../zch_hit_rate, .../zch_evictions, .../zch_occupancy on both;
- id_demand/<table>/max_ids, .../max_unique_ids, .../multipass_batches, .../dropped_ids at the end.
A resumed run opens its writer with `purge_step` one past the checkpoint's step: TensorBoard then
drops the earlier run's events from that step on, so the curve never loops back.
A write that fails once the run is under way (a full disk) stops the logging, never the run: the
failure is kept in `failure` and reported after the result line (the metrics file's rule).
"""

from __future__ import annotations

import math
from typing import Any

from tpurec.errors import UserError

_ZCH = ("zch_remapped_ids", "zch_hit_rate", "zch_evictions", "zch_occupancy")  # with --zch only
SCALARS = {
    "train": ("loss", "samples_per_s", *_ZCH),
    "eval": ("auc", "ne", "logloss", "accuracy", *_ZCH),
    "id_demand": ("max_ids", "max_unique_ids", "multipass_batches", "dropped_ids"),
}


class TensorBoardLog:
    """A SummaryWriter fed the metrics rows (`add`), flushed at each evaluation and at `close`."""

    def __init__(self, logdir: str, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's module needs the tensorboard package
            raise UserError(f"--tensorboard needs the tensorboard package ({e}): pip install tensorboard") from None
        try:
            purge = None if resume_step is None else resume_step + 1
            self._writer: Any = SummaryWriter(log_dir=logdir, purge_step=purge)
        except OSError as e:
            raise UserError(f"--tensorboard {logdir}: {e.strerror or e}") from None
        self._logdir = logdir
        self.failure: str | None = None
        self._guard_event_file()

    def _failed(self, e: OSError) -> None:
        if self.failure is None:
            self.failure = f"--tensorboard {self._logdir}: writing the TensorBoard events failed ({e.strerror or e})"

    def _guard_event_file(self) -> None:
        """The event file is written by tensorboard's own thread: an OSError there kills the thread with
        a traceback and comes back at a later add or flush. Its file's write and flush are wrapped so
        a failure is kept here and later records are dropped (the file keeps the whole ones before)."""
        file = getattr(getattr(self._writer.file_writer, "event_writer", None), "_general_file_writer", None)
        if file is None:  # another tensorboard's layout: failures still surface at add/flush/close
            return
        for name in ("write", "flush"):
            method = getattr(file, name)

            def guarded(*args: Any, _method: Any = method) -> None:
                if self.failure is not None:
                    return
                try:
                    _method(*args)
                except OSError as e:
                    self._failed(e)

            setattr(file, name, guarded)

    def _call(self, name: str, *args: Any) -> None:
        if self.failure is not None:
            return
        try:
            getattr(self._writer, name)(*args)
        except OSError as e:
            self._failed(e)

    def add(self, rec: dict) -> None:
        kind = rec.get("kind")
        prefix = f"id_demand/{rec.get('table')}" if kind == "id_demand" else kind
        for field in SCALARS.get(str(kind), ()):
            value = rec.get(field)
            # a figure not computed (None) or not finite (AUC of a one-class eval) is left out
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._call("add_scalar", f"{prefix}/{field}", value, int(rec["step"]))
        if kind == "eval":
            self.flush()

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        try:
            self._writer.close()
        except OSError as e:
            self._failed(e)
