"""`tpurec train --step`: the training step behind the trainer's pipeline interface.

`eager` is TorchRec's TrainPipelineSparseDist (tpurec.dlrm.input_pipeline.train_pipeline); `compiled` and
`pipelined` are tpurec's CompiledStep and PipelinedStep (compiled.py, pipelined.py), run here behind the same
`progress(iterator)` the trainer calls: (loss, None, None) per training batch, StopIteration when the
batches (and, pipelined, the batches in flight) are done; in eval mode the model's forward,
(loss, logits, labels), as TorchRec's pipeline returns them from TorchRec's DLRMTrain.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class StepPipeline:
    """kind: "compiled" or "pipelined" (options.STEP_KINDS); optimizer: the trainer's (model.build_optimizer:
    the dense torch.optim optimizer in it is stepped in the graph, with the lr LRSchedule set in its
    param group, on its own state, so checkpoints and resumes see it as the eager step leaves it).
    compile: the pipelined steady step under torch.compile (it needs fixed id limits: without them
    the SparseCore buffers follow each batch's ids, a new graph per batch), else eager.
    device: where each batch goes first, as TorchRec's pipeline copies it (`batch.to(device)`); on the
    TPU path the trainer's batches move only their dense features and labels (tpurec.data.host_ids)."""

    def __init__(
        self, kind: str, dmp: Any, optimizer: Any, compile: bool = True, device: torch.device | None = None
    ) -> None:
        self.kind, self.dmp = kind, dmp
        self.device = device
        self._compiled: Any = None
        self._pipelined: Any = None
        if kind == "compiled":
            from tpurec.sharding.step.compiled import CompiledStep

            self._compiled = CompiledStep(dmp, optimizer)
        elif kind == "pipelined":
            from tpurec.sharding.step.pipelined import PipelinedStep

            self._pipelined = PipelinedStep(dmp, optimizer, compile=compile)
        else:
            raise ValueError(f"no step kind {kind!r}")

    @property
    def eager_steps(self) -> int:
        """This rank's training batches over their fixed id limits, stepped eagerly (outside the graph)."""
        step = self._compiled if self._compiled is not None else self._pipelined
        return int(step.eager_steps)

    def _to_device(self, batch: Any) -> Any:
        return batch if self.device is None else batch.to(self.device, non_blocking=True)

    def progress(self, batches: Iterator[Any]) -> tuple[torch.Tensor, Any, Any]:
        batches = map(self._to_device, batches)
        if not self.dmp.training:  # evaluation: the model's forward, nothing updated
            if self._compiled is not None:
                self._compiled.forget_ahead()
            out: tuple[torch.Tensor, Any, Any] = self.dmp(next(batches))[1]
            return out
        if self._compiled is not None:  # the next batch's host half while the device runs this one
            return self._compiled.step_ahead(batches), None, None
        loss = self._pipelined.progress(batches)
        while loss is None:  # the warm-up's first batch: looked up, not yet through the model
            loss = self._pipelined.progress(batches)
        return loss, None, None
