"""`PipelinedStep`: a tpurec-DMP trainer in the shape of TorchRec's `SparseCoreTrainPipeline`
(torchrec/experimental/torch_tpu/pipelining/train_pipeline.py).

Three stages, each on a different batch; a steady step runs, in this order (TorchRec's):

* SparseCore backward of batch t: each stack's fused update from t's activation gradients
  (`sharded_preprocess.update_sharded`, the `tpurec::fused_update` op of the compiled backward);
* TensorCore stage of batch t+1: t+1's raw activations as leaves requiring grad, TorchRec's output
  dist, the model and loss, backward, the dense gradients averaged over the ranks and the dense
  optimizer's update (CompiledStep's: `dense_update.DenseOptimizer`), giving the activations' gradients;
* SparseCore forward of batch t+2: its lookups on the tables as they are now (no autograd graph).

So t+2's lookup sees t's update but not t+1's: the tables are one step stale, the dense parameters
are not. Under an lr schedule each batch's updates take the lr of the step that returns its loss
(the eager step's): the dense one runs in that step, and the fused table update of t, one step
later, runs with the tables' param groups set back to the lr t's model stage saw (`_table_lr`).
Where consecutive batches touch disjoint rows of every table the stale rows are not read and the
pipelined step computes the unpipelined step's numbers exactly. The host half of each batch
(input dist, SparseCore preprocessing: `preprocess_sharded`) runs eagerly before the step, as
CompiledStep's does; with `compile=True` the steady step is one `torch.compile(fullgraph=True,
dynamic=False)` graph, the warm-up and drain steps run eagerly (TorchRec's choice too).

A batch over its fixed id limits (measured on other data, say) runs as several passes, with no
lookup of fixed shape to run ahead of the model: the batches in flight are drained (model stages
and SparseCore backwards, in order, each at its own lr), the batch waits in the pending slot for
one unpipelined eager step (CompiledStep's arithmetic, at the lr of the step that returns its
loss), and the following batches restart the pipeline (warm-up again; compiled, the same graph).
No staleness across that batch: it reads the tables after every earlier update, and the next
batch reads them after its update. Counted in `eager_steps`.

The SparseCore stages on a batch in flight (forward, backward, the batch between them) are in
`pipeline_stages.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpurec.errors import UserError
from tpurec.sharding import rank_limits
from tpurec.sharding.sharded_preprocess import RawActivations
from tpurec.sharding.step import inputs as step_inputs
from tpurec.sharding.step import pipeline_stages as stages
from tpurec.sharding.step.compiled import LossFn, default_backend, model_loss, user_errors_of_the_trace
from tpurec.sharding.step.dense_update import DenseOptimizer, scalar_device
from tpurec.sharding.step.inputs import FieldMap
from tpurec.sharding.step.pipeline_stages import Behind, Prepared


class PipelinedStep:
    """`progress(iterator)` / `step(batch)`: one pipelined step of `dmp` (a tpurec.DistributedModelParallel
    with sharded EmbeddingBagCollections), returning the loss of the previous batch (None for the
    first batch); `drain()` finishes the batches in flight, `iterate(loader)` yields every loss.

    A batch over its fixed id limits is not pipelined: `step` drains the batches in flight (returning
    the last one's loss, the previous batch's) and keeps the batch in a pending slot; the next `step`
    (or `drain`) runs its eager step first and returns its loss, then goes on (a new warm-up:
    `step` returns the pending loss where a first batch would return None). The slot and the
    pipeline are never both full.

    batch, loss_fn, dense_optimizer and backend: as CompiledStep's. compile: False runs the steady step eagerly.
    """

    def __init__(
        self,
        dmp: Any,
        dense_optimizer: float | Any,
        loss_fn: LossFn = model_loss,
        compile: bool = True,
        backend: str | Any | None = None,
    ) -> None:
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        self.module: nn.Module = dmp.module  # without DDP: the step averages the dense gradients itself
        self.fields = FieldMap(self.module, "PipelinedStep")
        self.sharded = self.fields.modules[0]  # (where the tables are: `default_backend`)
        self.dense_params = [p for _, p in in_backward_optimizer_filter(self.module.named_parameters())]
        self.loss_fn = loss_fn
        env = getattr(dmp, "_env", None)
        self.group = getattr(env, "process_group", None)
        self.world_size = self.group.size() if self.group is not None and dist.is_initialized() else 1
        self.dense = DenseOptimizer(
            dense_optimizer, self.dense_params, self.group, self.world_size, scalar_device(self.dense_params)
        )
        self.backend = default_backend(self.sharded) if backend is None else backend
        self._steady_fn = (
            torch.compile(self._steady, fullgraph=True, dynamic=False, backend=self.backend)
            if compile
            else self._steady
        )
        self.updated_batches = 0  # batches whose SparseCore backward ran (all of them after a drain)
        self.eager_steps = 0  # batches over their fixed id limits, stepped eagerly (`_step_pending`)
        self._first_done = False
        # the fused table optimizers' param groups, whose lr each kernel reads when its update runs
        step_inputs.lr_at_update(self.fields.modules)
        kernels = [k for m in self.fields.modules for k in step_inputs.kernels(m)]
        on_host = sorted({t.name for k in kernels for t in (k.host_tier or {}).values()})
        if on_host:  # batch t+2's rows would be loaded and evicted while t's and t+1's updates are to come
            raise UserError(
                f"PipelinedStep: tables {on_host} are on the host tier, which the pipelined step does not run yet; "
                "train them with CompiledStep or the eager step"
            )
        groups = {id(g): g for k in kernels if (g := k.lr_source) is not None}
        self._table_groups = list(groups.values())
        self.reset()

    def reset(self) -> None:
        """Forget the batches in flight (their updates are lost: call `drain()` first to keep them)."""
        self._count = 0
        self._behind: Behind | None = None  # batch t: its inputs and gradients, per sharded EBC
        self._behind_lr: list[float] = []  # the tables' lr when batch t went through the model
        self._ahead: Any = None  # batch t+1: looked up, waiting for the model
        self._drain_iter: Iterator[torch.Tensor] | None = None
        # a batch over its fixed id limits (its SparseCore inputs in place of its KJT), the pipeline
        # drained before it: stepped eagerly at the next `step` or `drain`, which returns its loss
        self._pending: Any = None

    def preprocess(self, batch: Any) -> tuple[Any, list[Prepared]]:
        """The host half of a batch (eager): each sharded EBC's input dist and its kernels' SparseCore
        inputs; the batch with them in its KJTs' place (`step_inputs.prepare`), and them."""
        prepared = step_inputs.prepare(batch, self.fields.fields(batch))
        if not self._first_done:  # limits the first batch set, made the same on every rank (rank_limits.py)
            self._first_done = True
            if rank_limits.after_first_batch(self.module, self.group, self.world_size):
                prepared = step_inputs.prepare(batch, self.fields.fields(batch))
        return prepared

    def step(self, batch: Any) -> torch.Tensor | None:
        batch, prepared = self.preprocess(batch)
        previous = self._step_pending()  # the previous batch, if it was over its limits: its loss
        if self._over_limits(prepared):
            # several passes: no lookup of fixed shape to run ahead. The batches in flight finish
            # (the last one's loss is the previous batch's), this one waits for its eager step
            for loss in self._drain_flight():
                previous = loss
            self._pending = batch
            return previous
        if self._count == 0:  # warm-up 0: SparseCore forward of this batch (a restart after an eager step too)
            self._ahead = stages.activated(batch, prepared, stages.lookups(prepared))
            self._count = 1
            return previous
        if self._count == 1:  # warm-up 1: SparseCore forward of batch 1, the model on batch 0
            raw = stages.lookups(prepared)
            grads, loss = self._tensor_core(self._ahead)
        else:
            assert self._behind is not None
            # loss.backward() in the graph; t's table update (in it) at the lr t's model stage saw
            with torch._dynamo.config.patch(trace_autograd_ops=True), self._table_lr(self._behind_lr):
                stages.begin_updates(self._behind)
                dense = (self.dense.lr_inputs(), self.dense.state_inputs())
                with user_errors_of_the_trace():
                    raw, grads, loss = self._steady_fn(self._behind, self._ahead, prepared, *dense)
            self.updated_batches += 1
        self._behind = stages.behind(self._ahead, grads)
        self._behind_lr = [float(g["lr"]) for g in self._table_groups]
        self._ahead = stages.activated(batch, prepared, raw)
        self._count += 1
        return loss

    def drain(self) -> Iterator[torch.Tensor]:
        """The batches not yet trained, their losses yielded: a pending over-limit batch's eager step,
        or the pipeline's batches in flight (`_drain_flight`); the pipeline is empty after it."""
        loss = self._step_pending()
        if loss is not None:
            yield loss
        yield from self._drain_flight()

    def _drain_flight(self) -> Iterator[torch.Tensor]:
        """The pipeline's batches in flight: the last batch's model stage (its loss yielded), then the
        last two SparseCore backwards, each at the lr its model stage saw."""
        if self._count == 0:
            return
        if self._behind is not None:
            with self._table_lr(self._behind_lr):
                stages.begin_updates(self._behind)
                stages.updates(self._behind)
            self.updated_batches += 1
        grads, loss = self._tensor_core(self._ahead)
        self._behind = stages.behind(self._ahead, grads)
        self._behind_lr = [float(g["lr"]) for g in self._table_groups]
        self._ahead = None
        yield loss
        with self._table_lr(self._behind_lr):
            stages.begin_updates(self._behind)
            stages.updates(self._behind)
        self.updated_batches += 1
        self.reset()

    def _step_pending(self) -> torch.Tensor | None:
        """The pending over-limit batch's unpipelined eager step (CompiledStep's arithmetic: the model
        on its SparseCore inputs, backward with each stack's multi-pass fused update, the dense
        update), at the lrs set now: the schedule's for the step that returns its loss. Its loss."""
        if self._pending is None:
            return None
        assert self._count == 0  # the pipeline was drained when the batch arrived
        batch, self._pending = self._pending, None
        loss = self.loss_fn(self.module, batch)
        loss.backward()
        self.dense.apply(self.dense.lr_inputs(), self.dense.state_inputs())
        self.eager_steps += 1
        self.updated_batches += 1
        return loss.detach()

    def _over_limits(self, prepared: list[Prepared]) -> bool:
        """Whether any rank's batch is over its fixed id limits: the ranks agree, all drain and step
        eagerly (the rank that did not would look its rows up stale across that batch)."""
        device = self.dense_params[0].device if self.dense_params else None
        return step_inputs.any_rank_over_limits(list(prepared), self.group, self.world_size, device)

    @contextlib.contextmanager
    def _table_lr(self, lrs: list[float]) -> Iterator[None]:
        """The tables' param groups at `lrs` (those of the batch being updated) for the update, then
        back to what the schedule set: the update of t runs a step after t's model stage."""
        now = [g["lr"] for g in self._table_groups]
        for g, lr in zip(self._table_groups, lrs):
            g["lr"] = lr
        try:
            yield
        finally:
            for g, lr in zip(self._table_groups, now):
                g["lr"] = lr

    def progress(self, dataloader_iter: Iterator[Any]) -> torch.Tensor | None:
        """The next batch's step, then the drain's; StopIteration when all are done (TorchRec's
        train pipelines' contract). The first call returns None (nothing has reached the model yet)."""
        if self._drain_iter is None:
            batch = next(dataloader_iter, None)
            if batch is not None:
                return self.step(batch)
            self._drain_iter = self.drain()
        try:
            return next(self._drain_iter)
        except StopIteration:  # drained (and reset): the next call starts a new epoch
            self._drain_iter = None
            raise

    def iterate(self, loader: Iterable[Any]) -> Iterator[torch.Tensor]:
        """Every batch's loss, in order, the drain's included."""
        for batch in loader:
            loss = self.step(batch)
            if loss is not None:
                yield loss
        yield from self.drain()

    def explain(self, batch: Any) -> Any:
        """torch._dynamo.explain of the steady step on the pipeline's state and `batch` (after two
        warm-up steps). It runs the step (tables and dense parameters are updated) but does not
        advance the pipeline: for inspection, then `reset()`."""
        if self._behind is None:
            raise ValueError("PipelinedStep.explain needs two steps first (the warm-up)")
        _, prepared = self.preprocess(batch)
        stages.begin_updates(self._behind)
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            dense = (self.dense.lr_inputs(), self.dense.state_inputs())
            return torch._dynamo.explain(self._steady)(self._behind, self._ahead, prepared, *dense)

    def _steady(
        self,
        behind_t: Behind,
        batch_t1: Any,
        prepared_t2: list[Prepared],
        lrs: list[torch.Tensor],
        states: Any,
    ) -> tuple[list[RawActivations], list[RawActivations], torch.Tensor]:
        stages.updates(behind_t)
        grads_t1, loss_t1 = self._tensor_core(batch_t1, lrs, states)
        raw_t2 = stages.lookups(prepared_t2)
        return raw_t2, grads_t1, loss_t1

    def _tensor_core(
        self, batch: Any, lrs: Any = None, states: Any = None
    ) -> tuple[list[RawActivations], torch.Tensor]:
        """Model, loss and backward on a batch's raw activations (leaves), the dense update (its lr and
        state: the optimizer's current ones unless given, as the graph is given them); their gradients,
        per sharded EBC."""
        loss = self.loss_fn(self.module, batch)
        loss.backward()
        grads = [
            [
                [[a.grad if a.grad is not None else torch.zeros_like(a) for a in stacks] for stacks in kernels]
                for kernels in acts.raw
            ]
            for acts in step_inputs.parts(batch)
        ]
        if lrs is None:
            lrs, states = self.dense.lr_inputs(), self.dense.state_inputs()
        self.dense.apply(lrs, states)
        return grads, loss.detach()
