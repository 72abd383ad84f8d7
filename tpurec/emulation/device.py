"""An emulated TPU device: tensors on `tpu:0` that hold CPU data, under TorchTPU 0.2.0's device rules.

A rank of an emulated slice used to compute on CPU tensors, so nothing could tell a tensor the real
rank would hold on its TPU from one on the host: a `.numpy()` of device logits, an op mixing host
and device tensors, a table on `tpu:<local rank>` all passed. Here PrivateUse1 is set up as a
Python backend named "tpu" (torch's `_setup_privateuseone_for_python_backend`: a device guard and
hooks, so autograd runs on it), and a device tensor is a `TpuTensor`: a wrapper subclass whose
`device` is `tpu:0` and whose data is a CPU tensor underneath. Every op on device tensors reaches
`TpuTensor.__torch_dispatch__`; factories asked for `device="tpu"` reach the PrivateUse1 fallback.
Both enforce what a TorchTPU device does (docs/tpu.md, "The emulated device", names where each rule
was read) and then run the op on the CPU data:

* each process's device is index 0: `tpu:1` and above name it too, as on the chip;
* an op mixing host and device tensors raises, as torch does (0-dim CPU tensors, scalars, excepted;
  `copy_`/`_to_copy` are the transfers; `x[cpu_index]` takes its host index, as the chip does, and
  `index_select` refuses one with the chip's message);
* `.numpy()` of a device tensor raises torch's TypeError; `.item()`, `float()`, `.tolist()`,
  `.cpu()`, `.to("cpu")` are device->host copies, counted by the call site that made them;
* an op without a TorchTPU kernel raises TorchTPU's "not implemented for TPU" error
  (`missing_kernel`): FBGEMM's ops unless tpurec routes them (`tpurec.runtime.host_ops`); called from
  the user's code, one line naming the call, its file:line and what to use instead (`missing_op`);
* an op the emulated generation's chip aborts on (KERNELS_FILE's `chip_aborts`: `aten::_embedding_bag` on
  v5e, XLA's "Unsupported conversion from vmreg/vreg to U64") raises with the chip's message instead of
  running (`set_generation`);
* every op is a program, keyed by (op, shapes, dtypes, non-tensor arguments), as TorchTPU's eager
  mode compiles them: SparseCore (`tpu::`), collective (`c10d::`) or TensorCore (the rest);
* an all-to-all with split sizes refuses input or output buffers of different sizes on different
  ranks, as `ProcessGroupTpu::AllToAllBaseUnevenSplits` does.

Ops with a Python kernel registered for the device (tpurec's TPU adapter, its host routes, the
TorchTPU stand-in ops) run that kernel on the device tensors, as on a TPU.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten, tree_map

from tpurec.emulation.rule_error import TorchTpuRuleError
from tpurec.runtime.device import DeviceKind

DEVICE = "tpu"
_PU1 = torch._C.DispatchKey.PrivateUse1
# Frames of these packages are not a copy's call site: the copy is charged to the code that asked.
_NOT_CALL_SITES = ("torch", "tpurec.emulation", "tpurec.runtime.host_copies", "contextlib", "threading")
# Which ops TorchTPU 0.2.0 serves on its device, read from its dispatcher (scripts/refresh_torchtpu_kernels.py).
KERNELS_FILE = Path(__file__).with_name("torchtpu_kernels.json")
# Transfers: the only ops that may take a host and a device tensor together.
_TRANSFERS = {
    "aten::_to_copy",
    "aten::to",
    "aten::copy_",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
    "aten::lift_fresh",
}
# Ops the chip runs with a host index tensor (`x[cpu_index]`: the index goes to the device)...
_HOST_INDEX_OPS = {"aten::index"}
# ... and ops it refuses one with its own message (`x.index_select(0, cpu_index)`), both read on a v5e chip.
_INDEX_ON_DEVICE_OPS = {"aten::index_select"}


@dataclass
class DeviceRecord:
    """What the device was asked, in bounded memory: each program (kind, op, compile key) with the phase
    that first asked for it, and the device->host copies by call site, also per phase kind."""

    phase: tuple[str, int] = ("setup", 1)  # set by the emulated rank: ("train", 3) is the third step
    programs: dict[tuple[str, str, Any], tuple[str, int]] = field(default_factory=dict)
    to_host: Counter = field(default_factory=Counter)  # call site -> copies
    to_host_by_phase: Counter = field(default_factory=Counter)  # (phase kind, after warm-up, call site) -> copies

    def program(self, kind: str, op: str, key: Any) -> None:
        self.programs.setdefault((kind, op, key), self.phase)

    def copy(self, site: str) -> None:
        self.to_host[site] += 1
        self.to_host_by_phase[self.phase[0], after_warmup(self.phase), site] += 1

    def reset(self) -> None:
        self.phase = ("setup", 1)
        self.programs.clear()
        self.to_host.clear()
        self.to_host_by_phase.clear()


RECORD = DeviceRecord()
# Phases of warm-up, by kind: the first two training steps (DDP rebuilds its gradient buckets once, at
# the start of its second iteration: torch's `Reducer::rebuild_buckets`, new bucket views and a
# broadcast of their sizes, on any device) and the first evaluation. Setup is all warm-up.
WARMUP = {"setup": float("inf"), "train": 2, "eval": 1}


def after_warmup(phase: tuple[str, int]) -> bool:
    return phase[1] > WARMUP[phase[0]]


# Ops the device refuses for want of a TorchTPU kernel (KERNELS_FILE's, at install).
_refused: set[str] = set()
# Ops the emulated generation's chip aborts the process on (KERNELS_FILE's `chip_aborts`): op -> its message.
_aborts: dict[str, str] = {}
_GENERATION: list[str] = []


def chip_aborts(generation: str) -> dict[str, str]:
    """The ops a chip of `generation` ("v5e") was seen to abort the process on, each with the chip's message."""
    ops = json.loads(KERNELS_FILE.read_text())["chip_aborts"]["ops"]
    return {op: by_gen[generation] for op, by_gen in ops.items() if generation in by_gen}


def set_generation(generation: str) -> None:
    """The TPU generation the device stands for: the ops its chip aborts on are refused from here on."""
    _GENERATION[:] = [generation]
    _aborts.clear()
    _aborts.update(chip_aborts(generation))


def _kind(op: str) -> str:
    namespace = op.split("::", 1)[0]
    if namespace == "tpu":
        return "sparsecore"
    if namespace in ("c10d", "_c10d_functional", "_dtensor"):
        return "collective"
    return "tensorcore"


def _key_part(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_key_part(v) for v in value)
    if isinstance(value, dict):  # keyword arguments: `dtype=`, `device=` make other programs
        return tuple(sorted((str(k), _key_part(v)) for k, v in value.items()))
    if isinstance(value, float):
        # A Python float is a runtime value of the chip's program: on the v5e chip `x / s` with an `s`
        # that changed every call compiled nothing new (docs/tpu.md, "Measured on a TPU v5e chip")
        return "float"
    if isinstance(value, (int, bool, str, type(None))):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    return type(value).__name__  # a process group, a Work: not part of what is compiled


def _call_site() -> str:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not any(module == p or module.startswith(p + ".") for p in _NOT_CALL_SITES):
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _to_device(x: Any) -> Any:
    return TpuTensor(x) if _is_host_tensor(x) else x


def _is_host_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, TpuTensor) and x.device.type == DeviceKind.CPU


_PU1_SET = torch._C.DispatchKeySet(_PU1)
# op name -> the Python kernel tpurec registered for it on the device (`register_kernels`): called
# directly, with the device tensors, as the dispatcher would on a TPU.
_KERNELS: dict[str, Callable[..., Any]] = {}


def register_kernels(kernels: dict[str, Callable[..., Any]]) -> None:
    _KERNELS.update(kernels)


def has_device_kernel(op: str) -> bool:
    """Whether a kernel is registered for `op` on PrivateUse1 itself (tpurec's TPU adapter, its host
    routes), not through the device's fallback or a composite kernel."""
    return torch._C._dispatch_has_kernel_for_any_dispatch_key(op, _PU1_SET)


def missing_kernel(op: str) -> bool:
    """Whether TorchTPU 0.2.0 has no kernel for `op` ("fbgemm::permute_1D_sparse_data") on the device:
    its dispatcher sends it to the missing-op fallback (KERNELS_FILE), and tpurec registers none for it
    (host routes, its TPU adapter)."""
    return op in _refused and not has_device_kernel(op)


def _missing_message() -> str:
    return str(json.loads(KERNELS_FILE.read_text())["fallback"]["message"])


def torchtpu_fallback_ops() -> set[str]:
    """The ops TorchTPU 0.2.0's dispatcher sends to its missing-op fallback (CPU fallback off by default)."""
    return set(json.loads(KERNELS_FILE.read_text())["fallback_ops"])


class TpuTensor(torch.Tensor):
    """A tensor on the emulated `tpu:0`; `_data` is its value, a CPU tensor."""

    _data: torch.Tensor  # an instance attribute, no __slots__: nn.Module.to swaps a traceable subclass's
    # parameters in (torch.utils.swap_tensors), which refuses tensors with different slots
    # No torch-function layer: its default would turn every result, host copies too, into this type.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> TpuTensor:
        assert not isinstance(data, TpuTensor) and data.device.type == DeviceKind.CPU, type(data)
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=torch.device(DEVICE, 0),
            requires_grad=data.requires_grad,
            # An empty tensor's wrapper gets a storage of its own: torch's fake-tensor conversion (tracing)
            # resizes a zero-byte storage to zero through the device's `resizePrivateUse1Bytes` hook,
            # which a Python backend cannot register. `_data` keeps the real (empty) data.
            storage_size=None if data.numel() else 1,
        )
        t._data = data
        return t

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "_is_param" and _DETACHED_PARAM and _DETACHED_PARAM[0][0] is self:
            _keep_parameter(self, _DETACHED_PARAM.pop()[1])

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return f"{self._data!r} (on emulated {self.device})"

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )

    def data_ptr(self) -> int:
        # A device address, distinct per storage as on a TPU (a wrapper has none of its own: 0).
        return int(self._data.data_ptr())

    def tolist(self) -> Any:
        RECORD.copy(_call_site())
        return self._data.tolist()

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickling copies to the host, as torch.save of a device tensor
        return (_from_host, (self._data.detach().clone(),))

    # A traceable wrapper subclass (torch/testing/_internal/two_tensor.py): torch.compile traces
    # through it (each op reaches `__torch_dispatch__` with fake data, the device's rules apply) and
    # its compiled graph runs on `_data`, the CPU tensors underneath.
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: None, outer_size: Any, outer_stride: Any
    ) -> TpuTensor:
        return TpuTensor(inner["_data"])

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})


# nn.Module.to swaps a traceable subclass's parameters (torch.utils.swap_tensors) for
# `Parameter(p.to(device))`, even when `p` is on the device already: `Parameter` detaches `p`, calls
# `requires_grad_` and sets `_is_param`. So that the parameter keeps its Python attributes (TorchRec's
# `_in_backward_optimizers`, ...) and autograd hooks, as torch's non-swapping path keeps them (a TPU's
# tensors are not wrappers: nothing is swapped there), the last detach of a parameter is remembered
# and the copy takes them when marked a parameter (autograd gives detach's result fresh metadata
# after the dispatch, so hooks set there would be lost).
_DETACHED_PARAM: list[tuple[TpuTensor, TpuTensor]] = []  # (detached copy, parameter)
_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")  # a tensor's autograd hooks, as Python dicts


def _keep_parameter(copy: TpuTensor, param: TpuTensor) -> None:
    for name, value in param.__dict__.items():
        if name not in ("_data", "_is_param"):
            copy.__dict__.setdefault(name, value)
    for hooks in _HOOKS:
        if getattr(param, hooks):
            setattr(copy, hooks, getattr(param, hooks))


def _from_host(data: torch.Tensor) -> TpuTensor:
    return TpuTensor(data)


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    op = func._schema.name  # "aten::to" for every overload of it
    kernel = _KERNELS.get(func.name())
    if kernel is not None:
        # A kernel tpurec registers for the device (its TPU adapter, a host route): it takes device tensors.
        return kernel(*args, **kwargs)
    said = _aborts.get(func.name())
    if said is not None:
        # the chip would kill the process (SIGABRT in XLA's compiler); the emulation says why instead
        raise TorchTpuRuleError(
            f"{said} (emulated TPU {_GENERATION[0]}: the chip's XLA compiler aborts the process compiling "
            f"{func.name()}, torch_tpu 0.2.0; torch.nn.EmbeddingBag / F.embedding_bag cannot run there: use "
            "TorchRec's EmbeddingBagCollection, which tpurec shards)"
        )
    if missing_kernel(func.name()):
        from tpurec.emulation import missing_op

        said = _missing_message().format(op=func.name())
        # one line naming the user's call, where the user's code made it (missing_op.py)
        raise missing_op.error(func.name(), f"{said} (emulated torch-tpu 0.2.0: its CPU fallback is off by default)")
    flat, _ = tree_flatten((args, kwargs))
    if op not in _TRANSFERS:
        if op in _HOST_INDEX_OPS:
            # x[idx] with a host index: the chip takes it (the result on tpu:0)
            args = (args[0], [_to_device(i) for i in args[1]], *args[2:])
            flat, _ = tree_flatten((args, kwargs))
        mixed = [x for x in flat if _is_host_tensor(x) and x.dim() > 0]
        if mixed and op in _INDEX_ON_DEVICE_OPS:
            # the chip's own words (torch_tpu 0.2.0, TPU v5e: docs/tpu.md, "Measured on a TPU v5e chip")
            raise RuntimeError(f"{op.split('::')[1]}(): expected tensor to be on tpu, got cpu")
        if mixed:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, tpu:0 and cpu! "
                f"(emulated TPU: {op} got a host tensor of shape {tuple(mixed[0].shape)})"
            )
    to_host = _is_to_host(op, args, kwargs)
    if not _tracing(flat):  # torch.compile tracing (fake data): the rules above apply, nothing runs
        if to_host or op == "aten::_local_scalar_dense":
            RECORD.copy(_call_site())
        if op.startswith("c10d::alltoall_base"):
            _check_symmetric_all_to_all(args)
        RECORD.program(_kind(op), func.name(), _key_part((args, kwargs)))
    wrappers = {id(x._data): x for x in flat if isinstance(x, TpuTensor)}
    unwrapped_args, unwrapped_kwargs = tree_map(_unwrap, (args, kwargs))
    if _tracing(flat):  # a tensor the traced graph made on the device meets the device's data
        unwrapped_args, unwrapped_kwargs = tree_map(_made_in_the_graph, (unwrapped_args, unwrapped_kwargs))
    if "device" in unwrapped_kwargs and unwrapped_kwargs["device"] is not None:
        if torch.device(unwrapped_kwargs["device"]).type == DEVICE:
            unwrapped_kwargs["device"] = torch.device("cpu")
    out = func(*unwrapped_args, **unwrapped_kwargs)
    if to_host:
        return out
    result = tree_map(lambda x: _wrap(x, wrappers), out)
    if op == "aten::detach" and getattr(args[0], "_is_param", False) and isinstance(result, TpuTensor):
        _DETACHED_PARAM[:] = [(result, args[0])]  # see _keep_parameter
    return result


def _tracing(flat: list) -> bool:
    """Whether this op is torch.compile tracing the program (Dynamo's or AOTAutograd's fake tensors,
    under the device tensors or beside them) rather than running it: the compiled graph is the
    program (`emulation/compiled.py`), not each op traced into it."""
    return any(is_fake(x._data if isinstance(x, TpuTensor) else x) for x in flat if isinstance(x, torch.Tensor))


def _is_to_host(op: str, args: tuple, kwargs: dict) -> bool:
    if op in ("aten::_to_copy", "aten::to"):
        devices = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str))]
        return bool(devices) and torch.device(devices[0]).type == DeviceKind.CPU
    if op == "aten::copy_":
        return _is_host_tensor(args[0])  # into a host tensor, from the device
    return False


def _made_in_the_graph(x: Any) -> Any:
    """While tracing, a factory asked for the device (`torch.arange(n, device=x.device)`) gives a plain fake
    tensor said to be on tpu, not a device tensor: FakeTensorMode makes it, the device's fallback never
    sees it. Beside the device tensors' CPU data it is taken as a traced copy to the CPU, which the
    emulated backend's graph pass (`compiled._on_the_data`) makes a CPU copy of a tensor made on the CPU."""
    if isinstance(x, torch.Tensor) and not isinstance(x, TpuTensor) and x.device.type == DEVICE:
        return torch.ops.aten._to_copy.default(x, device=torch.device("cpu"))
    return x


def _unwrap(x: Any) -> Any:
    return x._data if isinstance(x, TpuTensor) else x


def _wrap(x: Any, wrappers: dict[int, TpuTensor]) -> Any:
    if not isinstance(x, torch.Tensor) or isinstance(x, TpuTensor):
        return x
    if id(x) in wrappers:  # an in-place op or an out= argument: the caller's own device tensor
        return wrappers[id(x)]
    if x.device.type != DeviceKind.CPU:
        return x
    return TpuTensor(x)


def _check_symmetric_all_to_all(args: tuple) -> None:
    """ProcessGroupTpu::AllToAllBaseUnevenSplits: 'asymmetric input buffer sizes across ranks are not
    supported on TPU.' (strings on torch-tpu 0.2.0's glue library); judged on the output buffers too, whose
    sizes the same symmetric exchange needs equal on every rank (issue 58)."""
    output, tensor, boxed, output_splits, input_splits = args[:5]
    if not output_splits and not input_splits:
        return
    group = dist.ProcessGroup.unbox(boxed)  # the op carries it as a TorchScript object
    world = group.size()
    sizes = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    mine = torch.tensor([tensor.numel(), output.numel()], dtype=torch.int64)
    dist.all_gather(sizes, mine, group=group)
    inputs, outputs = {int(s[0]) for s in sizes}, {int(s[1]) for s in sizes}
    if len(inputs) > 1:
        raise TorchTpuRuleError(
            "asymmetric input buffer sizes across ranks are not supported on TPU. (emulated torch-tpu 0.2.0 "
            f"ProcessGroupTpu all-to-all: this rank sends {tensor.numel()} elements, others {sorted(inputs)})"
        )
    if len(outputs) > 1:  # the output buffers too: every rank's of one size (docs/tpu.md, the device's rules)
        raise TorchTpuRuleError(
            "asymmetric input buffer sizes across ranks are not supported on TPU. (emulated torch-tpu 0.2.0 "
            f"ProcessGroupTpu all-to-all: this rank receives {output.numel()} elements, others {sorted(outputs)})"
        )


def _fallback(keyset: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """PrivateUse1's kernel for every op without its own: factories asked for device="tpu"."""
    return _dispatch(func, args, kwargs)


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return device_index == 0

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


_LIBRARY: list[Any] = []


def install(backend_module: Any, refused_ops: set[str] | None = None) -> None:
    """Make "tpu" a device of this process (idempotent): PrivateUse1 renamed, the Python backend set up
    with `backend_module` as torch.tpu, the fallback registered. Before anything names PrivateUse1."""
    if _LIBRARY:
        return
    if "torch_tpu" in sys.modules:
        raise RuntimeError("the emulated TPU device cannot be installed where the real torch_tpu is loaded")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        raise RuntimeError(
            f"PrivateUse1 is already named {torch._C._get_privateuse1_backend_name()!r}: the emulated device must "
            "be installed first in the process (tpurec.emulation.rank.activate at `import tpurec`)"
        )
    _setup_privateuseone_for_python_backend(
        rename=DEVICE, backend_module=backend_module, hook=_Hooks(), device_guard=_Guard()
    )
    library = torch.library.Library("_", "IMPL")
    library.fallback(_fallback, dispatch_key="PrivateUse1", with_keyset=True)
    _LIBRARY.append(library)
    _LIBRARY.append(_register_torchtpu_kernels())
    _refused.update(torchtpu_fallback_ops() if refused_ops is None else refused_ops)


def _register_torchtpu_kernels() -> Any:
    """A PrivateUse1 kernel for each aten op TorchTPU 0.2.0 has one for (KERNELS_FILE), as TorchTPU
    registers them. Device tensors reach `__torch_dispatch__` first, but where torch excludes the
    Python key (`torch.tensor(data, device=...)` copies to the device so) an op reaches the device's
    kernel directly; the fallback cannot serve those (torch asserts), a kernel per op can. Ops torch
    decomposes itself (CompositeImplicitAutograd) keep decomposing: a kernel would hide their
    gradient."""
    library = torch.library.Library("aten", "IMPL")
    for name in json.loads(KERNELS_FILE.read_text())["kernel_ops"]:
        namespace, _, qualified = name.partition("::")
        base, _, overload = qualified.partition(".")
        packet = getattr(torch.ops.aten, base, None) if namespace == "aten" else None
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            continue
        library.impl(qualified, _kernel_of(op), "PrivateUse1")
    return library


def _kernel_of(op: Any) -> Callable[..., Any]:
    return lambda *args, **kwargs: _dispatch(op, args, kwargs)


def installed() -> bool:
    return bool(_LIBRARY)
