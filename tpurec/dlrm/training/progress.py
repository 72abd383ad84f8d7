"""A rank's training as it goes: the pace (samples/s of the steps since the last logged one, the ETA),
the progress bar or, without one, a line per tenth of the run, and the train and eval records of the
metrics file (`--metrics-out`, `--tensorboard`; rank 0 writes them, every rank computes them)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from tpurec.dlrm.report import MetricsLog
from tpurec.dlrm.training.slow_steps import SlowSteps
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    import torch

    from tpurec.dlrm.training.rank_run import RankRun
    from tpurec.dlrm.zch import RemapCounters


def remap_record(remap: RemapCounters | None, world: int, train: bool) -> dict:
    """--zch: the remap's figures for a metrics record (every rank calls it: a collective). Training:
    ids remapped so far, their hit rate, evictions so far, occupancy; eval: that evaluation's hit rate."""
    if remap is None:
        return {}
    f = remap.figures(world)
    return {
        "zch_remapped_ids": f["remapped_ids"] if train else f["eval_remapped_ids"],
        "zch_hit_rate": f["hit_rate"] if train else f["eval_hit_rate"],
        "zch_evictions": f["evictions"],
        "zch_occupancy": f["occupancy"],
    }


def clock(seconds: float) -> str:
    """An ETA as H:MM:SS (M:SS under an hour), as tqdm shows it."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """One run's (`run()`): `metrics` (the records), `bar`, `steps_run` and `train_seconds` (this
    process's training, for samples/s), `train_copies` (device->host copies in training steps, by what)."""

    def __init__(self, run: RankRun, total: int, step: int, batch: int, remap: RemapCounters | None) -> None:
        from tqdm import tqdm

        o = run.options
        self.run, self.total, self.batch, self.remap = run, total, batch, remap
        resumed_at = step if o.resume and step > 0 else None
        tensorboard = None
        if o.tensorboard and run.rank == 0:
            from tpurec.dlrm.tensorboard_log import TensorBoardLog

            tensorboard = TensorBoardLog(o.tensorboard, resumed_at)
        self.metrics = MetricsLog(o.metrics_out if run.rank == 0 else None, resumed_at, tensorboard)
        self.bar = tqdm(
            total=total,
            initial=step,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            # A log file is no terminal: \r-joined bar updates there are noise; plain lines instead.
            disable=run.rank != 0 or o.quiet or not sys.stderr.isatty(),
            mininterval=0.5,
            smoothing=0.1,
        )
        self.t_start = time.perf_counter()
        self.train_seconds, self.steps_run = 0.0, 0
        self.train_copies: Counter = Counter()
        self._window_seconds, self._window_steps = 0.0, 0  # training since the last logged step
        # each logged step reads the loss back (a device->host copy the host waits for): by default
        # about 100 in a run, 1 to 50 steps apart
        self.log_every = o.log_every or max(1, min(50, total // 100 or 1))
        self.loss_sum: torch.Tensor | float = (
            0.0  # the losses since the last logged step (a tensor once a step has run)
        )
        self.loss_n = 0
        # the most bytes the device's allocator held at a logged step (the TPU path): what the plan's
        # HBM figure is compared with, beside the end's reading (`sample_device_bytes`)
        self.max_device_bytes: int | None = None
        self.slow_steps = SlowSteps()  # steps far slower on the host than those before (new programs)
        self._last_tenth = -1
        self._t0 = self._mark = 0.0

    def sample_device_bytes(self) -> None:
        """At a logged step (the loss just read: steps up to it have run), the device allocator's bytes
        in use, kept when the most so far; nothing where the device gives no reading (a CPU, the
        emulated device). Steps queued after the logged one may hold more: a lower bound of the peak
        (TorchTPU's own peak statistic is no reading: docs/tpu.md)."""
        if self.run.device != DeviceKind.TPU:
            return
        import torch

        try:
            now = int(torch.accelerator.memory_allocated())
        except Exception:  # no accelerator statistics here
            return
        self.max_device_bytes = max(self.max_device_bytes or 0, now)

    def segment_starts(self) -> None:
        self._t0 = self._mark = time.perf_counter()

    def stepped(self, loss: torch.Tensor, step: int, host_seconds: float | None) -> None:
        """A step ran: `step` (its number), its loss (on the device), its seconds on the host (its
        `advance`, `slow_steps.py`; None for a segment's first)."""
        slow = self.slow_steps.add(step, host_seconds)
        if slow is not None and len(self.slow_steps.slow) == 1 and self.run.rank == 0:
            from tpurec.dlrm.rank_setup import log
            from tpurec.dlrm.training.slow_steps import message

            log.warning(message(slow))
        self.steps_run += 1
        self._window_steps += 1
        self.loss_sum = loss if self.loss_n == 0 else self.loss_sum + loss  # summed where computed
        self.loss_n += 1

    def window(self, step: int) -> tuple[float, float]:
        """At a logged step: samples/s of the steps since the last logged one (a running average
        hides a slowdown), and the ETA."""
        now = time.perf_counter()
        self._window_seconds += now - self._mark
        self._mark = now
        secs, steps = self._window_seconds, self._window_steps
        sps = steps * self.batch * self.run.world / secs if secs > 0 else 0.0
        eta = (self.total - step) * secs / steps if steps else 0.0
        self._window_seconds, self._window_steps = 0.0, 0
        return sps, eta

    def log_train(self, record: dict[str, Any], sps: float, eta: float) -> None:
        """A logged step's record (its mean loss in it), the bar's figures or, once per tenth, a line."""
        mean, step = record["loss"], record["step"]
        self.metrics.add({"kind": "train", **record, "samples_per_s": round(sps, 1), **self._remap(train=True)})
        self.bar.set_postfix_str(f"loss {mean:.4f}, {sps:,.0f} samples/s", refresh=False)
        if self.bar.disable and not self.run.options.quiet and self._crossed_tenth(step):
            self.run.say(f"step {step}/{self.total}: loss {mean:.4f}, {sps:,.0f} samples/s, ETA {clock(eta)}")
        self.loss_sum, self.loss_n = 0.0, 0

    def segment_ends(self, copies: Counter) -> None:
        """`copies`: the device->host copies this segment's steps made."""
        self._window_seconds += time.perf_counter() - self._mark
        self.train_seconds += time.perf_counter() - self._t0
        self.train_copies.update(copies)

    def _crossed_tenth(self, step: int) -> bool:
        """True once per tenth of the run: where a progress line goes when there is no bar."""
        tenth = step * 10 // max(1, self.total)
        if tenth > self._last_tenth:
            self._last_tenth = tenth
            return True
        return False

    def log_eval(self, ev: dict, where: dict[str, Any]) -> dict:
        """An evaluation's record (`where`: its step, epoch, samples)."""
        self.metrics.add({"kind": "eval", **where, "seconds": self.seconds(), **ev, **self._remap(train=False)})
        return ev

    def seconds(self) -> float:
        return round(time.perf_counter() - self.t_start, 3)

    def _remap(self, train: bool) -> dict:
        return remap_record(self.remap, self.run.world, train)
