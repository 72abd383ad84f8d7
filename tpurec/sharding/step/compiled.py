"""`CompiledStep`: a tpurec-DMP training step with its device half under `torch.compile(fullgraph=True)`.

The split is TorchRec's own (TrainPipelineSparseDist runs `input_dist` ahead of
`compute_and_output_dist`; SparseCoreTrainPipeline feeds its compiled step preprocessed inputs):

* eager, per batch: each sharded EBC's input dist (the ids' all-to-alls, data-dependent sizes) and
  the SparseCore preprocessing of each kernel's ids (`sharded_preprocess.preprocess_sharded`); for a
  sharded EmbeddingCollection on its fixed-shape path the same and every index its output dist needs
  (`ec_preprocess.preprocess_sharded_ec`);
* one graph: the lookups (`tpurec::fused_lookup`), the output dist of the pooled embeddings (of an EC's
  sequence embeddings: gathers and an all-to-all of fixed shapes, `sequence_output.py`), the
  dense model and loss, backward (each stack's fused update, `tpurec::fused_update`), the dense
  gradients' average over the ranks (one functional all-reduce of one bucket, as DDP's) and the
  dense optimizer's update (`dense_update.DenseOptimizer`: torch.optim's SGD, Adagrad or Adam, its
  own state, the lr a graph input).

The learning rates change without a new graph: the dense one is a tensor argument read from the
optimizer's param group each step, and the fused update's scalars at its param group's lr are written
into each kernel's `step_feed`, a graph input, before the step (`SparseCoreKernel.begin_compiled_step`:
on a TPU the update op's Python runs once, when the graph is compiled; step_scalars.py), so
`LRSchedule` drives both.

The model is DMP's unwrapped module: DDP's backward hooks are what the graph does itself. The
graph is compiled for the batch's shape and each stack's SparseCore buffer sizes: fixed id limits
(the sharder's `max_ids_per_partition`, measured `id_limits`, a TPU) keep those the same for every
batch; without them they follow the batch's ids, and a batch with new sizes compiles a new graph.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind
from tpurec.sharding import rank_limits
from tpurec.sharding.sharder import ShardedSparseCoreEBC
from tpurec.sharding.step import inputs as step_inputs
from tpurec.sharding.step.dense_update import DenseOptimizer, scalar_device
from tpurec.sharding.step.inputs import FieldMap

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def model_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """TorchRec's convention (DLRMTrain, its train pipelines): `module(batch)` returns (loss, outputs)."""
    loss: torch.Tensor = module(batch)[0]
    return loss


class CompiledStep:
    """`step(batch)`: one training step of `dmp` (a tpurec.DistributedModelParallel), returns the loss.

    batch: a dataclass (e.g. torchrec's `Batch`) handed to `loss_fn(module, batch)` with each
    KeyedJaggedTensor field that feeds the model's sharded EmbeddingBagCollections (and
    EmbeddingCollections) replaced by their SparseCore inputs (`inputs.py`): a field feeds the modules
    whose features it holds (TorchRec's DLRM: `sparse_features` its one EBC; several may share a field or
    have one each), and the
    model's forward must hand that field to them.
    dense_optimizer: the dense parameters' (those without a fused optimizer) torch.optim SGD, Adagrad
    or Adam (or TorchRec's KeyedOptimizerWrapper / CombinedOptimizer holding it, e.g. `tpurec.dlrm.model
    .build_optimizer`'s), stepped in the graph with its param group's current lr; a float: plain SGD at that lr.
    backend: torch.compile's backend ("aot_eager", "inductor", "tpu", ...); None: `default_backend`'s
    choice for where the tables are.
    """

    def __init__(
        self,
        dmp: Any,
        dense_optimizer: float | Any,
        loss_fn: LossFn = model_loss,
        backend: str | Any | None = None,
    ) -> None:
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        self.module: nn.Module = dmp.module  # without DDP: the graph averages the dense gradients itself
        self.fields = FieldMap(self.module, "CompiledStep", fp=True)
        step_inputs.lr_at_update(self.fields.modules)  # each update at its param group's lr then
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
        backend_fn = host_values_logged(self.backend, os.environ.get(HOST_VALUES_ENV))
        self.compiled = torch.compile(self._step, fullgraph=True, dynamic=False, backend=backend_fn)
        self.eager_steps = 0  # batches over their fixed id limits, stepped eagerly (`step`)
        self._ahead: tuple[Any, Any] | None = None  # (batch, its preprocessed form or None): step_ahead
        self._first_done = False

    def preprocess(self, batch: Any) -> Any:
        """The eager half: `batch` with its KJTs replaced by the sharded EBCs' SparseCore inputs."""
        prepared, _ = step_inputs.prepare(batch, self.fields.fields(batch))
        if not self._first_done:  # limits the first batch set, made the same on every rank (rank_limits.py)
            self._first_done = True
            if rank_limits.after_first_batch(self.module, self.group, self.world_size):
                prepared, _ = step_inputs.prepare(batch, self.fields.fields(batch))
        return prepared

    def step(self, batch: Any) -> torch.Tensor:
        return self.run_prepared(self.preprocess(batch))

    def step_ahead(self, batches: Iterator[Any]) -> torch.Tensor:
        """The step of the next of `batches`, and the batch after it preprocessed once this step is
        queued on the device: the host's half of step i+1 runs while the device runs step i (what
        TorchRec's pipelines do for their input dist), wherever the host must wait for the device
        (a loss read, a buffer the step still reads). StopIteration when `batches` is done."""
        raw, prepared = self._ahead if self._ahead is not None else (next(batches), None)
        self._ahead = None
        loss = self.run_prepared(self.preprocess(raw) if prepared is None else prepared)
        upcoming = next(batches, None)
        if upcoming is not None:
            self._ahead = (upcoming, self.preprocess(upcoming))
        return loss

    def forget_ahead(self) -> None:
        """The batch preprocessed ahead is preprocessed again before its step: a forward outside the
        step (an evaluation) may have moved the host tier's rows it was mapped to."""
        if self._ahead is not None:
            self._ahead = (self._ahead[0], None)

    def run_prepared(self, prepared: Any) -> torch.Tensor:
        """One step of a batch `preprocess` made: compiled, or eagerly when over its id limits."""
        run = self.compiled
        device = self.dense_params[0].device if self.dense_params else None
        if step_inputs.any_rank_over_limits(step_inputs.parts(prepared), self.group, self.world_size, device):
            # Over its fixed id limits (measured on other data, say) a batch runs as several passes,
            # with no fixed graph: this one step runs eagerly, the same arithmetic, rather than
            # compiling a graph for it or failing mid-training; on every rank when one is over (the
            # ranks agree: one program per step across the slice). Counted (and, per table, in the
            # kernels' multipass_batches, which the trainer reports).
            run = self._step
            self.eager_steps += 1
        # loss.backward() inside the graph: Dynamo traces it only with this set (TorchRec's
        # SparseCoreTrainPipeline sets it for the whole process; here only around the step)
        if run is self.compiled:
            self._begin_updates()
        with torch._dynamo.config.patch(trace_autograd_ops=True), user_errors_of_the_trace():
            out: torch.Tensor = run(prepared, self.dense.lr_inputs(), self.dense.state_inputs())
        return out

    def _begin_updates(self) -> None:
        """The compiled updates' eager half: every kernel's step counted and its scalars written at the
        tables' lr now (`SparseCoreKernel.begin_compiled_step`; step_scalars.py says why)."""
        for module in self.fields.modules:
            for kernel in step_inputs.kernels(module):
                kernel.begin_compiled_step()

    def explain(self, batch: Any) -> Any:
        """torch._dynamo.explain of the compiled part on `batch` (it runs the step: the tables and
        dense parameters are updated)."""
        prepared = self.preprocess(batch)
        self._begin_updates()
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return torch._dynamo.explain(self._step)(prepared, self.dense.lr_inputs(), self.dense.state_inputs())

    def _step(self, prepared: Any, lrs: list[torch.Tensor], states: Any) -> torch.Tensor:
        loss = self.loss_fn(self.module, prepared)
        loss.backward()
        # torch.optim's step() breaks the graph on purpose (optimizer.py, `_use_grad`): the same
        # update written traceably, on the optimizer's own state (dense_update.py)
        self.dense.apply(lrs, states)
        return loss.detach()


@contextlib.contextmanager
def user_errors_of_the_trace() -> Iterator[None]:
    """A tpurec UserError raised while Dynamo traces a step (the model reading its KJT where the step
    hands it SparseCore inputs: `ModuleInputs`) comes out of torch.compile as `Unsupported: Observed
    exception`, the error's text inside its cause; raised here as that UserError again (one line).
    Nothing of the step ran: Dynamo traces the whole graph before running it (fullgraph)."""
    try:
        yield
    except torch._dynamo.exc.Unsupported as e:
        from torch._dynamo.exc import observed_exception_map

        cause = e.__cause__
        ours = {v for k, v in observed_exception_map.items() if isinstance(k, type) and issubclass(k, UserError)}
        if cause is None or type(cause) not in ours:
            raise
        text = str(cause)
        found = re.search(r"exception \w+\(([\"'])(.*)\1\)", text, re.S)
        raise UserError(found.group(2) if found else text) from None


# A file to list each value of the traced step that is a host tensor (on a TPU a program takes none)
HOST_VALUES_ENV = "TPUREC_GRAPH_HOST_VALUES"


def host_values_logged(backend: str | Any, path: str | None) -> str | Any:
    """`backend`, or with `path` a backend that first appends to `path` every node of the Dynamo graph
    whose value is a CPU tensor (its name, shape, dtype and the user code that made it), then
    compiles with `backend`: what to read when TorchTPU says "expected tensor to be on tpu, got cpu"."""
    if not path:
        return backend
    from torch._dynamo import lookup_backend

    inner = lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_logged(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        with open(path, "a") as f:
            for n in gm.graph.nodes:
                v = n.meta.get("example_value")
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    trace = (n.meta.get("stack_trace") or "").strip().splitlines()[-4:]
                    f.write(f"{n.op} {n.name} {n.target} {tuple(v.shape)} {v.dtype}\n  " + "\n  ".join(trace) + "\n")
        return inner(gm, example_inputs)

    return compile_logged


def default_backend(sharded: ShardedSparseCoreEBC) -> str:
    """ "tpu" when the sharded tables are on a tpu device, else "aot_eager".

    "tpu" is TorchTPU's Dynamo backend (torch-tpu 0.2.0, `torch_tpu/_internal/compile/__init__.py`:
    `register_backend(compiler_fn=TpuBackend(), name="tpu")`; docs/tpu.md): AOTAutograd, and each graph
    split at its collectives into XLA programs. On the emulated device it is tpurec.emulation.compiled's
    stand-in, registered by the emulated rank. On a CPU, aot_eager: AOTAutograd's graphs run by the
    eager kernels, the eager step's numbers (inductor computes the traced update wrongly, `_step`).
    """
    device = sharded._device
    # a string: "tpu" parses as a torch.device only once TorchTPU (or the emulation) has named it
    kind = "cpu" if device is None else str(device).split(":")[0]
    return "tpu" if kind == DeviceKind.TPU else "aot_eager"
