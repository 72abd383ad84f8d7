"""One rank's DLRM training run as a `Trainer`: setup, step, evaluate, checkpoint, run.

`tpurec train` (one rank, in-process) and `python -m tpurec.dlrm` (each rank under torchrun) build a
Trainer from `TrainOptions` and call `run()`. Setup follows the data: the process group first (the
synthetic data's writer and the other ranks meet at a barrier), then the data (the table sizes come
from it), then the model, its DMP, optimizers and pipeline, and last the resume, which loads into all
of them. Training goes in segments that end at the next eval, checkpoint or the last step; the
pipeline drains at a segment's end, so the reader position then is exactly that of the batches
trained (what a checkpoint records).

The Trainer holds its parts (`tpurec/dlrm/training/`), one job each: the data, the sharded model, the
step, the evaluation, the checkpoints, the progress and the result; what an emulated TPU rank does
differently is behind one object, its `Emulation`. Everything but the final JSON line (rank 0) goes
to stderr, so stdout stays machine-readable.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tpurec.data.catalog import get_table_set
from tpurec.dlrm.ckpt.manager import CheckpointManager
from tpurec.dlrm.options import TrainOptions
from tpurec.dlrm.rank_setup import init_distributed, log, setup_logging
from tpurec.dlrm.training import emulation
from tpurec.dlrm.training.checkpointing import Checkpointing
from tpurec.dlrm.training.data import Segment, TrainingData
from tpurec.dlrm.training.evaluation import evaluate
from tpurec.dlrm.training.model import ShardedModel, load_user_model
from tpurec.dlrm.training.progress import Progress
from tpurec.dlrm.training.rank_run import RankRun
from tpurec.dlrm.training.reporting import Reporting
from tpurec.dlrm.training.side_outputs import SideOutputs
from tpurec.dlrm.training.step import TrainingStep
from tpurec.errors import UserError
from tpurec.runtime import stop_request
from tpurec.runtime.device import resolve_choice

if TYPE_CHECKING:
    import torch


class Trainer:
    """Trains one rank of a `tpurec train` run. After `setup()`: `cfg` (the resolved DLRMConfig),
    `table_set` (its catalog tables), `readers`, `dmp`, `optimizer`, `pipeline`, `step_count`,
    `checkpointer` (the run's CheckpointManager: lock, resume, interval, save, retention), and the
    parts: `rank_run` (RankRun), `data`, `model`, `steps`, `checkpoints`."""

    def __init__(self, options: TrainOptions) -> None:
        self.options = options
        self.step_count = 0  # training steps taken (the same on every rank)
        self.samples = 0  # samples trained on, over all ranks
        self.emulation = emulation.Emulation()  # setup() puts an emulated TPU rank's in its place
        self._batches = Segment(iter(()))  # the current segment's batches; see _train_segment
        self._stop = stop_request.StopRequest()  # run() installs its own, which signals reach
        self._stopping = 0  # the signal every rank agreed to stop for (stop_request.py); 0: none
        self.outputs = SideOutputs()  # files written beside the training whose writing failed
        self._ready = False

    # ---- setup ----
    def setup(self) -> None:
        import torch

        o = self.options
        self.emulation = emulation.start()  # a rank of `tpurec train --emulate-tpu`: TorchTPU's stand-ins first
        self.device = device = resolve_choice(o.device)
        self.rank, self.world = rank, world = init_distributed(device, o.dist_timeout)
        setup_logging(rank)
        from tpurec.runtime import heartbeat

        # Right after the group forms: a rank that stops from here on is named within the timeout.
        heartbeat.start(o.heartbeat_timeout, program="tpurec train")
        # One thread per rank unless asked: on a small shared host more threads than free cores make
        # every op wait for a busy core (measured 20x slower with 2 threads on 2 busy cores).
        torch.set_num_threads(o.threads or 1)
        say = log.info if rank == 0 else (lambda *a, **k: None)
        cfg = o.config()
        every = o.checkpoint_every if o.checkpoint_every is not None else cfg.eval_every
        self.checkpointer = CheckpointManager(o.checkpoint_dir, every=every, keep=o.keep, rank=rank, say=say)
        self.checkpointer.lock()  # before any step: one run per directory
        table_set = get_table_set(cfg.table_set)  # resolved once; everything below reads it
        self.rank_run = run = RankRun(o, rank, world, device, self.emulation, say, cfg, table_set)
        if o.model_module:  # built first: the data is checked against its features
            load_user_model(run)
        self.data = TrainingData(run)
        self.data.check_memory()
        self.data.setup()
        self.model = ShardedModel(run)
        self.model.build(self.data)
        self.steps = TrainingStep(run, self.model.dmp)
        if rank == 0:
            self.model.report_plan(self.data, self.outputs)
        self.steps.build_pipeline()
        self.checkpoints = Checkpointing(run, self.checkpointer, self.model.dmp, self.steps.optimizer, self.data)
        self.cfg, self.table_set, self.readers = run.cfg, table_set, self.data.readers
        self.dmp, self.optimizer, self.pipeline = self.model.dmp, self.steps.optimizer, self.steps.pipeline
        self.total_steps = self.data.total_steps
        resumed = self.checkpoints.resume(self.total_steps)
        if resumed is not None:
            self.step_count, self.samples = resumed
        # Before the first step, not at the first save (tpurec/dlrm/ckpt/space.py).
        self.checkpointer.check_room(self.dmp, self.optimizer)
        self.data.start_stream(self.dmp)
        self._batches = self.data.segment(self.total_steps - self.step_count)
        self._ready = True

    # ---- the four things a run does ----
    def step(self) -> float | None:
        """One training step on the next batch of the current segment: its loss, or None once the
        segment has no batch left and the pipeline has drained (after setup(), the segment runs to
        the last step; run() cuts it at every eval and checkpoint)."""
        loss = self._advance()
        return None if loss is None else self._read_loss(loss, 1)

    def _advance(self) -> torch.Tensor | None:
        """One training step; its loss as a tensor where the step computed it (on a TPU: on the TPU,
        read by the host only at a log point, `_read_loss`), or None when the segment is done."""
        self.emulation.begin("train")
        loss = self.steps.advance(self._batches, self.step_count)
        if loss is not None:
            self.step_count += 1
            self.samples += self.data.batch_size * self.world
        return loss

    def _read_loss(self, loss_sum: torch.Tensor | float, steps: int) -> float:
        """The mean of the last `steps` losses (summed in `loss_sum`) on the host: a device->host copy
        on a TPU (counted, tpurec.runtime.host_copies). Non-finite stops training."""
        import torch

        from tpurec.runtime import host_copies

        assert isinstance(loss_sum, torch.Tensor)  # read after a step has run
        self.emulation.loss_on_device(loss_sum)
        value = float(host_copies.to_host(loss_sum, "loss")) / steps
        if not math.isfinite(value):
            # Training on would only spread NaN through every table; checkpoints already written stay.
            first = self.step_count - steps + 1
            where = f"step {self.step_count}" if steps == 1 else f"steps {first}-{self.step_count}"
            raise UserError(
                f"training loss is {value} at {where}: stopped. Look for non-finite dense "
                "values in the data (`tpurec data inspect`), or lower --embedding-lr / --dense-lr"
            )
        return value

    def evaluate(self) -> dict:
        """Forward the whole eval split through the (drained) pipeline; metrics over all ranks."""
        return evaluate(self.rank_run, self.model, self.steps, self.data)

    def checkpoint(self) -> Path:
        """Save model, optimizer, reader position and RNG states at the current step (every rank)."""
        return self.checkpoints.save(self.step_count, self.samples)

    def run(self) -> dict:
        """Set up (if not yet), train to the last step with evals and checkpoints on the way, then
        checkpoint, evaluate and report (rank 0: summary on stderr, one JSON line on stdout).
        Returns the final figures (the JSON line's)."""
        if not self._ready:
            self.setup()
        cfg, total, ckpt = self.cfg, self.total_steps, self.checkpoints
        self.progress = Progress(self.rank_run, total, self.step_count, self.data.batch_size, self.model.remap)
        self.reporting = Reporting(self.rank_run, self.data, self.model, self.outputs, self.progress)

        def boundary(s: int) -> bool:
            return s == total or (cfg.eval_every and s % cfg.eval_every == 0) or self.checkpointer.is_due(s)

        if ckpt.eval_owed and self.step_count < total:  # not logged: the metrics file holds it
            self._evaluated(self.evaluate())
        self._stop = stop_request.StopRequest()
        # SIGTERM (a preemption) is recorded to the end of the run, through evaluations and saves,
        # and stops it at the next point the ranks agree on; Ctrl-C only within training segments.
        with stop_request.catching(self._stop, stop_request.PREEMPTION):
            try:
                while self.step_count < total and not self._stopping and ckpt.early_stop is None:
                    with stop_request.catching(self._stop):
                        self._train_segment(next(s for s in range(self.step_count + 1, total + 1) if boundary(s)))
                    if not self._stopping:
                        self._after_segment(total)
            except BaseException:  # Ctrl-C, a failed step: the records so far reach the file
                self.progress.metrics.flush()
                raise
            self.progress.bar.close()
            self.data.close()  # batches read ahead that training will not take
            if not self._stopping and self.checkpointer.enabled and ckpt.saved_at(self.step_count) is None:
                # Written before the final evaluation (not again after an early stop's), so the training it
                # saves never depends on the evaluation succeeding (issue #36 item 2: on a TPU it once
                # failed and lost this checkpoint).
                self.checkpoint()
                self._stopping = self._stop.agreed(self.world)  # a SIGTERM during it: stop, it is saved
            if self._stopping:
                with stop_request.catching(self._stop):  # the relayed copies of the signal must not cut the save
                    self._stop_here()
            return self._finish()

    # ---- the loop's pieces ----
    def _train_segment(self, end: int) -> None:
        """Steps up to `end`; the pipeline drains at the end (its batch source ends there)."""
        self._batches = self.data.segment(end - self.step_count)
        from tpurec.dlrm import id_feedback
        from tpurec.runtime import host_copies

        id_feedback.record(self.dmp, True)  # training batches only: evaluation's may differ in size
        p = self.progress
        copies_before = host_copies.counts()
        p.segment_starts()
        began, first = time.perf_counter(), True
        while (loss := self._advance()) is not None:
            p.stepped(loss, self.step_count, None if first else time.perf_counter() - began)
            first = False
            if self.step_count % p.log_every == 0 or self.step_count == end:
                sps, eta = p.window(self.step_count)
                # the same steps on every rank: where they agree to stop (the batches in flight drain)
                if not self._batches.cut and (signum := self._stop.agreed(self.world)):
                    self._stopping, self._batches.cut = signum, True
                mean = self._read_loss(p.loss_sum, p.loss_n)
                p.sample_device_bytes()
                p.log_train({**self._where(), "seconds": p.seconds(), "loss": mean}, sps, eta)
            p.bar.update(1)
            began = time.perf_counter()  # (a logged step's loss read waits for the device: not its own time)
        copies = host_copies.counts()
        p.segment_ends(Counter({what: n - copies_before.get(what, 0) for what, n in copies.items()}))
        id_feedback.record(self.dmp, False)
        if self.step_count < end and not self._stopping:  # the data ran out (an empty epoch); cannot continue
            raise RuntimeError(f"training data exhausted at step {self.step_count}")

    def _where(self) -> dict:
        """Where a metrics record is taken: the step, the reader's epoch, the samples so far."""
        return {"step": self.step_count, "epoch": self.data.train_state()["epoch"], "samples": self.samples}

    def _log_eval(self, ev: dict) -> dict:
        return self.progress.log_eval(ev, self._where())

    def _evaluated(self, ev: dict) -> None:
        self.checkpoints.evaluated(ev, self.step_count, self.samples, self.total_steps)

    def _after_segment(self, total: int) -> None:
        """The evaluation and the periodic checkpoint due where a training segment ended."""
        cfg, step = self.cfg, self.step_count
        if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
            ev = self._log_eval(self.evaluate())
            if self.rank == 0:
                self.progress.bar.write(
                    f"step {step}: eval AUC {ev['auc']:.4f}, NE {ev['ne']:.4f}, logloss {ev['logloss']:.4f}",
                    file=sys.stderr,
                )
            self._evaluated(ev)
        if self.checkpointer.should_save(step, total):
            self.checkpoint()
        # A SIGTERM during the evaluation or the save (recorded, stop_request.PREEMPTION): every rank
        # is here, after both, so they stop at this step together.
        self._stopping = self._stop.agreed(self.world)

    def _stop_here(self) -> NoReturn:
        """A SIGTERM or Ctrl-C stopped training at an agreed step (the pipeline drained): the last
        checkpoint (every rank, when there is a checkpoint dir), then the metrics and curves (rank 0),
        then StoppedBySignal, whose line says how to resume."""
        from tpurec.runtime.stop_request import StoppedBySignal

        self.steps.close()
        saved = None
        if self.checkpointer.enabled:  # a SIGTERM during a save stops right after it: that one is saved
            saved = self.checkpoints.saved_at(self.step_count) or self.checkpoint()
        if self.rank == 0:
            self.reporting.write_curves()
        raise StoppedBySignal(self._stopping, self.step_count, saved, self.options.resume_command())

    def _finish(self) -> dict:
        """After the last step and its checkpoint (run()): the final evaluation and report."""
        line = self.steps.input_pipeline_line()
        if line:
            self.rank_run.say(line)
        early = self.checkpoints.early_stop
        if early is not None:  # the model of the evaluation that stopped it: not evaluated again
            final = early[1]
        else:  # the final checkpoint is written (run()); a SIGTERM now lets it end
            final = self._log_eval(self.evaluate())
            self._evaluated(final)
        self.steps.close()  # after the final evaluation, which still runs through it
        best = self.checkpoints.best_figures(self.total_steps)
        result = self.reporting.result(final, self.step_count, self.steps.eager_steps, best)
        self.reporting.report(result)
        return result
