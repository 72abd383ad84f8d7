"""Which step trains a rank (`--step`), and the update it steps: the optimizers (the tables' fused one
and the dense one, `tpurec.dlrm.model.build_optimizer`) and the learning-rate schedule.

`eager` is TorchRec's `TrainPipelineSparseDist` (its SparseCore inputs built ahead where they can be,
`tpurec.dlrm.input_pipeline.train_pipeline`); `compiled` and `pipelined` are tpurec's, behind the same
`progress(iterator)` (`tpurec/sharding/step/kinds.py`). Evaluation forwards through the same pipeline
(evaluation.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    import torch
    from torchrec.datasets.utils import Batch

    from tpurec.dlrm.training.rank_run import RankRun


class TrainingStep:
    """`optimizer` and `schedule` once built; `pipeline` after `build_pipeline()`."""

    def __init__(self, run: RankRun, dmp: Any) -> None:
        from tpurec.dlrm.model import LRSchedule, build_optimizer

        cfg = run.cfg
        self.run, self.dmp = run, dmp
        self.optimizer = build_optimizer(dmp, cfg)
        self.schedule = LRSchedule(self.optimizer, cfg.warmup_steps, cfg.decay_start, cfg.decay_steps)
        o = run.options
        if o.dense_compiled(run.device, emulated=run.emulation.topology is not None):
            from tpurec.dlrm.training.dense_update_compile import compile_dense_update

            run.say(
                f"{'--compile-dense' if o.compile_dense else 'on a TPU'}: "
                + compile_dense_update(self.optimizer, dmp, run.device)
            )

    def build_pipeline(self) -> None:
        import torch

        from tpurec.dlrm.input_pipeline import train_pipeline

        run, o = self.run, self.run.options
        device = torch.device(run.device) if run.device == DeviceKind.CPU else self.dmp.device
        if o.step != "eager":  # tpurec's compiled or pipelined step (sharding/step/); options.py refuses a real TPU
            from tpurec.sharding.step.kinds import StepPipeline

            # compiled only with fixed SparseCore buffer sizes (--limits): else a graph per batch
            fixed = o.id_limits is not None
            self.pipeline: Any = StepPipeline(o.step, self.dmp, self.optimizer, compile=fixed, device=device)
            how = "under torch.compile" if fixed else "eagerly (no --limits: buffer sizes follow each batch)"
            run.say(f"--step {o.step}: the steady step runs {how}")
            return
        self.pipeline = train_pipeline(
            self.dmp,
            self.optimizer,
            device,
            world_size=run.world,
            workers=o.pipeline_workers,
            # --zch, a model's MC tables: the lookups take the remapped ids, known only in the step
            prepare=o.pipeline_depth > 0 and not run.remapped(),
        )

    def advance(self, batches: Iterator[Batch], step: int) -> torch.Tensor | None:
        """Step `step` (0-based) on the next of `batches`: its loss, or None once they are done and
        the pipeline has drained."""
        self.schedule.set_step(step)
        try:
            loss, _, _ = self.pipeline.progress(batches)
        except StopIteration:
            return None
        return loss.detach()

    @property
    def eager_steps(self) -> int | None:
        """--step compiled|pipelined: batches over their fixed id limits stepped outside the graph."""
        return None if self.run.options.step == "eager" else int(self.pipeline.eager_steps)

    def input_pipeline_line(self) -> str | None:
        """How many SparseCore lookups took inputs built ahead (the eager step with --pipeline-depth)."""
        from tpurec.dlrm.input_pipeline import sparsecore_lookups

        o = self.run.options
        lookups = sparsecore_lookups(self.dmp)
        # --step compiled|pipelined preprocess in their own step (sharding/step/): no input pipeline to report
        if not (lookups and o.pipeline_depth and o.step == "eager"):
            return None
        hits = sum(m.prepared_hits for m in lookups)
        misses = sum(m.prepared_misses for m in lookups)
        if hits + misses:
            return f"input pipeline: SparseCore inputs built ahead for {hits} of {hits + misses} lookups"
        return "input pipeline: no SparseCore inputs to build ahead (the CPU kernels' direct step)"

    def close(self) -> None:
        """The pipeline's worker threads stopped (after the last evaluation, which runs through it)."""
        from tpurec.dlrm.input_pipeline import close_pipeline

        close_pipeline(self.pipeline)
