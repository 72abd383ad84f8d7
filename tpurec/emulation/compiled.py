"""TorchTPU's `torch.compile` backend on the emulated device: `backend="tpu"`, what a graph costs in programs.

torch-tpu 0.2.0 registers a Dynamo backend named "tpu" (`torch_tpu/_internal/compile/__init__.py`,
`registry.register_backend(compiler_fn=TpuBackend(), name="tpu")`). `TpuBackend` runs AOTAutograd
(`min_cut_rematerialization_partition`, `keep_inference_input_mutations=False`, `dynamic=True` refused)
and gives each forward/backward graph to a `SplitCompiler` (`split_compiler.py`), which splits it on
its collectives (COLLECTIVES below) and compiles every piece with XLA: the stretches of computation
between collectives and each collective are programs of their own. Its inputs' mutations are copied back by AOTAutograd
after the graph, as eager device ops. With `TORCH_TPU_SPMD_HANDSHAKE_STAGE` set, the ranks handshake
each such graph and keep it whole, its collectives inside one program, when all agree (handshake.py).

Here the same AOTAutograd call runs the graph eagerly on the CPU data under the device tensors, as
`aot_eager` does (the same kernels: the same numbers), and every run asks the device for the graph's
programs: each stretch a "compiled" program keyed by (graph, stretch, its input shapes), each collective
a "collective" program keyed by op and shapes. Tracing itself ran every op through the device's rules
(`device._dispatch` on fake tensors) without counting it.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from typing import Any

import torch

from tpurec.emulation import device, handshake
from tpurec.runtime.device import DeviceKind

NAME = "tpu"  # TorchTPU's name for its backend
_PHASE_NAMES = {True: "forward", False: "backward"}


# The collectives TorchTPU's SplitCompiler cuts a graph at (`_internal/distributed/collective_ops.py`,
# `COLLECTIVE_OPS` and `_TPU_COLLECTIVE_NAMES`); `wait_tensor` stays with its collective.
COLLECTIVES = frozenset(
    {
        *(
            f"_c10d_functional::{name}"
            for name in (
                "all_reduce",
                "all_reduce_",
                "all_reduce_coalesced",
                "all_reduce_coalesced_",
                "all_gather_into_tensor",
                "all_gather_into_tensor_out",
                "all_gather_into_tensor_coalesced",
                "reduce_scatter_tensor",
                "reduce_scatter_tensor_out",
                "reduce_scatter_tensor_coalesced",
                "all_to_all_single",
                "broadcast",
                "broadcast_",
            )
        ),
        "tpu::_all_gather_dim",
        "tpu::_reduce_scatter_dim",
    }
)


def _op_name(node: torch.fx.Node) -> str:
    """The op a node calls ("_c10d_functional::all_reduce"), "" for anything else."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    schema = getattr(target, "_schema", None) if node.op == "call_function" else None
    return str(schema.name) if schema is not None else ""


def _collective(node: torch.fx.Node) -> str | None:
    """The collective a node calls (one of COLLECTIVES), else None."""
    op = _op_name(node)
    return op if op in COLLECTIVES else None


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_shape(v) for v in value)
    return None


def graph_programs(
    gm: torch.fx.GraphModule, example_inputs: Any, forward: bool, whole: bool = False
) -> list[tuple[str, str, Any]]:
    """The programs one run of `gm` asks of the device, as SplitCompiler cuts it: (kind, op, key). Cut
    at every collective, unless the ranks' handshake agreed (`whole`): then one program, its
    collectives inside (handshake.py)."""
    digest = hashlib.sha256(gm.code.encode()).hexdigest()[:12]
    shapes = tuple(_shape(x) for x in example_inputs)
    if whole:
        return [("compiled", f"graph:{digest}", (_PHASE_NAMES[forward], "whole", shapes))]
    programs: list[tuple[str, str, Any]] = []
    stretch = 0
    pending = False  # the current stretch has ops
    collectives: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        op = _collective(node)
        if op is None:
            # a collective's wait_tensor and its outputs' getitems go with it (SplitCompiler's partition map)
            waits = _op_name(node) == "_c10d_functional::wait_tensor"
            item = node.target is operator.getitem and node.args and node.args[0] in collectives
            if not (waits or item):
                pending = True
            continue
        collectives.add(node)
        if pending:
            programs.append(("compiled", f"graph:{digest}", (_PHASE_NAMES[forward], stretch, shapes)))
            stretch += 1
            pending = False
        args = tuple(_shape(a.meta.get("val")) for a in node.args if isinstance(a, torch.fx.Node))
        programs.append(("collective", op, args))
    if pending:
        programs.append(("compiled", f"graph:{digest}", (_PHASE_NAMES[forward], stretch, shapes)))
    return programs


# Every graph the backend compiled in this process: its programs, in order.
COMPILED: list[list[tuple[str, str, Any]]] = []


def _on_the_data(gm: torch.fx.GraphModule) -> None:
    """The graph made to run on the CPU data under the device tensors: a tensor the graph makes on the
    device (`torch.arange(n, device=x.device)`, `zeros`, `full`: part of the program on a TPU) is made
    on the CPU, as that data is; the traced copy of it beside the device data (`device._dispatch`) is
    then a CPU copy. A copy of a host tensor to the device inside the graph is refused: whether TorchTPU's
    compiler takes one (a host input of an XLA program) is not known."""
    for node in gm.graph.nodes:
        where = node.kwargs.get("device") if node.op == "call_function" else None
        if where is None or torch.device(where).type != device.DEVICE:
            continue
        source = node.args[0] if _op_name(node) == "aten::_to_copy" and node.args else None
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.device.type == DeviceKind.CPU:
            raise device.TorchTpuRuleError(
                f"a host tensor {tuple(value.shape)} copied to the device inside a compiled graph ({node.name}): "
                "whether TorchTPU's compiler takes a host->device copy in a program is not known (emulated "
                "device); build it on the device (from device tensors) or copy it before the compiled step"
            )
        node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    gm.recompile()


def _record(programs: list[tuple[str, str, Any]]) -> None:
    for kind, op, key in programs:
        device.RECORD.program(kind, op, key)


def _compiler(forward: bool) -> Callable[[torch.fx.GraphModule, Any], Any]:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        _on_the_data(gm)
        # SplitCompiler.__call__: a graph with collectives (all of the global group here: the emulated
        # tpu_dist refuses any other) is handshaken at the stage the variable names, else split
        collectives = sum(_collective(node) is not None for node in gm.graph.nodes)
        when = handshake.stage() if collectives else "OFF"
        whole = when == "DISPATCH_STAGE"  # compiled whole, handshaken at each run
        if when == "COMPILE_STAGE":
            whole = handshake.submit(handshake.fingerprint(gm.code), collectives)
        programs = graph_programs(gm, example_inputs, forward, whole=whole)
        COMPILED.append(programs)
        executable = handshake.fingerprint(gm.code, tuple(_shape(x) for x in example_inputs))
        dispatching = when == "DISPATCH_STAGE"

        def run(args: list) -> Any:
            nonlocal programs, dispatching
            # _SplitCompiledExecutable._maybe_handshake_and_recompile: the whole executable is compiled
            # (its fingerprint is the handshake's), and a mismatch recompiles it split and ends the handshakes
            if dispatching:
                _record(programs)
                if not handshake.submit(executable, collectives):
                    dispatching = False
                    programs = graph_programs(gm, example_inputs, forward)
                    COMPILED.append(programs)
            _record(programs)
            return torch.fx.Interpreter(gm).boxed_run(args)  # aot_eager's `boxed_nop`

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile_graph


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """The emulated "tpu" backend: TorchTPU's AOTAutograd settings, the graph run eagerly on the CPU
    data, its programs recorded at each run."""
    from torch._decomp import get_decompositions
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if not torch._dynamo.config.assume_static_by_default:
        raise NotImplementedError(  # TorchTPU's TpuBackend refuses the same
            "TPU backend does not support torch.compile(..., dynamic=True, ...). Please run torch.compile() "
            "with dynamic=None or default dynamism i.e. torch.compile(model) and try again."
        )
    return aot_autograd(
        fw_compiler=_compiler(True),
        bw_compiler=_compiler(False),
        partition_fn=min_cut_rematerialization_partition,
        # TorchTPU's `_TPU_DECOMPOSITIONS` (masked_fill as where, as Inductor does)
        decompositions=get_decompositions(  # type: ignore[arg-type]  # OpOverloads, typed as their base
            [torch.ops.aten.masked_fill.Tensor, torch.ops.aten.masked_fill_.Tensor]
        ),
        keep_inference_input_mutations=False,
    )(gm, example_inputs)


def register_backend() -> None:
    """`torch.compile(..., backend="tpu")` in this process (idempotent)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if NAME not in _COMPILER_FNS:
        register_backend(compiler_fn=tpu_backend, name=NAME)


def graph_counts() -> dict[str, int]:
    """Graphs Dynamo compiled in this process and the graph breaks it took (torch._dynamo's counters:
    `stats.unique_graphs`, and `graph_break` by reason)."""
    from torch._dynamo.utils import counters

    return {
        "graphs_compiled": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
