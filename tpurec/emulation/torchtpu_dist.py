"""TorchTPU 0.2.0's distributed rules, enforced on CPU ranks: `torch.tpu`, `tpu_dist`, DDP's check.

An emulated rank (`tpurec.emulation.rank.activate`) installs three stand-ins. Each enforces what
torch-tpu 0.2.0 does, read from its wheel (docs/tpu.md lists every fact with the file it came from):

* `torch.tpu`, the device module: `is_available()`, `current_stream()`, `synchronize()` and
  `device_count()` are *strict internal*: called from outside torch/torch_tpu (TorchRec calls them)
  they raise, unless `TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS` was set when the module loaded
  (`_STRICT_INTERNAL_DEVICE_APIS`, frozen then). The device is available (tpurec.emulation.device),
  so TorchRec takes its own TPU branches (its uneven all-to-all padding, `torchrec/experimental/torch_tpu`);
  the current device is index 0 in every process, as TorchTPU numbers a process's own device.
* the `tpu_dist` c10d backend (registered for device "tpu", as `torch_tpu/_loader.py` does), created
  with every process group whose backend names it (`cpu:gloo,tpu:tpu_dist`): it refuses a rank
  without the launch environment ("missing required environment variables for distributed
  training"), a `LOCAL_RANK` outside `[0, TORCH_TPU_DEVICES_PER_HOST)`, and any group other than the
  global one (TorchTPU lowers a sub-group's collectives as SPMD over every device and refuses
  incomplete or overlapping sub-groups; its torchcomms `split_group` is "not yet implemented";
  its compile-time handshake runs on the global group only). The emulation does not try to tell which
  sub-groups TorchTPU would accept: it accepts none. The tensors themselves go through gloo.
* DDP's `_verify_param_shape_across_processes`, a device->CPU transfer that fails on multi-host
  TorchTPU ("transfer to 'cpu' device failed", torchrec PR #4597): it raises on a slice of several
  hosts, as the real run would at model construction.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from typing import Any

import torch
import torch.distributed as dist

from tpurec.emulation.rule_error import TorchTpuRuleError
from tpurec.runtime.device import LEGACY_DEVICE_APIS_ENV, DeviceKind

# torch_tpu/_internal/distributed/distributed.py: the variables `set_tpu_launch_env()` decides in the
# parent; the binary refuses a distributed run without them.
LAUNCH_ENV = ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID")
_FRAMEWORK = ("torch", "torch_tpu")


def _framework_caller(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    module = frame.f_globals.get("__name__", "") if frame else ""
    return module.split(".")[0] in _FRAMEWORK


class EmulatedStream:
    """TorchTPU's TpuStream as far as callers can tell (torch_tpu/_internal/stream/streams.py): the work
    is in order on one queue, so waiting and synchronising return at once."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_STREAM = EmulatedStream()


class EmulatedTpuModule(types.ModuleType):
    """`torch.tpu` of an emulated rank: strict-internal device APIs, as TorchTPU 0.2.0 has them
    (`torch_tpu/_internal/device/_device_module.py`, `_internal/utils/annotations.py`)."""

    _tpurec_emulated_device = True  # tpurec.runtime.device.resolve_device: "tpu" is tpu:0 here

    def __init__(self, local_rank: int, local_devices: int) -> None:
        super().__init__("torch.tpu")
        # Read once, when the module loads: later changes of the variable do nothing.
        self._STRICT_INTERNAL_DEVICE_APIS = os.environ.get(LEGACY_DEVICE_APIS_ENV, "0") in ("", "0")
        self._local_rank = local_rank
        self._local_devices = local_devices

    def _check(self, name: str) -> bool:
        """True (the device is there); raises where TorchTPU would for a caller outside torch. Not
        while torch.compile traces: Dynamo cannot trace `sys._getframe`, and TorchTPU skips the
        caller check then too (`_internal/utils/annotations.py`, `torch.compiler.is_compiling()`)."""
        if torch.compiler.is_compiling() or _framework_caller(3):
            return True
        if self._STRICT_INTERNAL_DEVICE_APIS:
            raise TorchTpuRuleError(
                f"{name} is internal to TorchTPU and can only be called by the PyTorch framework (torch and "
                f"torch_tpu). (emulated torch-tpu 0.2.0: {LEGACY_DEVICE_APIS_ENV} was not set when it loaded)"
            )
        return True

    def is_available(self) -> bool:
        return self._check("is_available")

    def device_count(self) -> int:
        self._check("device_count")
        return self._local_devices

    def current_device(self) -> int:
        # Each TorchTPU process drives one device, its index 0 ("device_ids=[0] which names this process's
        # own device"), whatever its local rank.
        self._check("current_device")
        return 0

    def current_stream(self, device: object = None) -> EmulatedStream:
        self._check("current_stream")
        return _STREAM

    def synchronize(self, device: object = None) -> None:
        self._check("synchronize")

    def stream(self, stream: object = None) -> contextlib.nullcontext:
        # TorchTPU's stream() and Stream() are experimental and "currently non-functional" (TpuStreamContext
        # in torch_tpu/_internal/device/_device_module.py); DCP's writer enters one around every copy.
        return contextlib.nullcontext()

    def Stream(self, device: object = None, priority: int = 0, **kwargs: object) -> EmulatedStream:  # noqa: N802
        return EmulatedStream()

    # What torch itself asks of a backend's device module (torch/utils/backend_registration.py).
    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed(self, seed: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass


def install_device_module(local_rank: int, local_devices: int) -> EmulatedTpuModule:
    """Make "tpu" this process's emulated device (tpurec.emulation.device), torch.tpu the emulated module."""
    from tpurec.emulation import device

    module = EmulatedTpuModule(local_rank, local_devices)
    device.install(module)
    return module


def _check_launch_env(world_size: int) -> None:
    missing = [k for k in LAUNCH_ENV if not os.environ.get(k)]
    if missing:
        # The binary's own words (strings on libpywrap_2_14_0_common.so).
        raise TorchTpuRuleError(
            f"missing required environment variables for distributed training: {', '.join(missing)} "
            "(TorchTPU decides them in the launching process: torch.tpu.distributed.set_tpu_launch_env())"
        )
    addresses = [a for a in os.environ["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",") if a]
    if len(addresses) != world_size:
        raise TorchTpuRuleError(
            f"TORCH_TPU_SLICEBUILDER_ADDRESSES has {len(addresses)} address(es) for {world_size} ranks "
            "(TorchTPU wants one host:port per rank)"
        )


def _check_local_rank() -> None:
    per_host = os.environ.get("TORCH_TPU_DEVICES_PER_HOST")
    local = os.environ.get("LOCAL_RANK")
    if per_host is None or local is None:
        return
    if not 0 <= int(local) < int(per_host):
        raise TorchTpuRuleError(
            f"expected environment variable LOCAL_RANK to be in [0, {per_host}) (TORCH_TPU_DEVICES_PER_HOST), "
            f"got {local}"
        )


def _create_tpu_dist(options: Any, backend_options: Any = None) -> Any:
    """c10d's extended-API creator for `tpu_dist`: TorchTPU's rules, then gloo carries the tensors."""
    try:
        _check_rules(options)
    except TorchTpuRuleError:
        _all_ranks_refused(options)
        raise
    return dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)


def _all_ranks_refused(options: Any) -> None:
    """Wait until every rank of the group has reached its refusal. torch builds a "cpu:gloo,tpu:tpu_dist"
    group's gloo half first; a rank that raised at once dropped its half while another rank was still
    connecting to it ("Gloo connectFullMesh failed ... Connection closed by peer", seen under load)."""
    key, size = "tpurec_tpu_dist_refused", options.group_size
    options.store.add(key, 1)
    timeout = getattr(options, "timeout", None)
    deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else 300.0)
    while options.store.add(key, 0) < size and time.monotonic() < deadline:
        time.sleep(0.005)


def _check_rules(options: Any) -> None:
    ranks = list(options.global_ranks_in_group)
    world = dist.get_world_size() if dist.is_initialized() else options.group_size
    _check_launch_env(world if dist.is_initialized() else options.group_size)
    _check_local_rank()
    if dist.is_initialized() and sorted(ranks) != list(range(world)):
        raise TorchTpuRuleError(
            f"tpu_dist cannot form a sub-group of ranks {ranks} out of {world}: TorchTPU 0.2.0 lowers sub-group "
            "collectives as SPMD programs over every device ('Incomplete or overlapping subgroups are not "
            "supported in SPMD.'), its split_group is not yet implemented, and its handshake runs on the global "
            "group only; the emulation allows the global group alone"
        )


def register_backend() -> None:
    if "tpu_dist" not in dist.Backend.backend_list:
        dist.Backend.register_backend("tpu_dist", _create_tpu_dist, extended_api=True, devices=["tpu"])


def ddp_without_pinned_host_memory() -> None:
    """DDP on the emulated device, without what needs pinned host memory.

    DDP's reducer copies its unused-parameter map through a pinned host buffer on a PrivateUse1 device
    (reducer.cpp, `all_reduce_local_used_map`), which `static_graph=True` (TorchRec's default) makes it
    do in the first backward. TorchTPU provides a pinned allocator (`torch_tpu::TpuPinnedAllocator`,
    strings on its glue library); torch gives a Python backend no way to register one, so on the
    emulated device DDP runs with `static_graph=False` (the same gradients, without the graph reuse)."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if getattr(init, "_tpurec_emulated", False):
        return

    def __init__(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if any(p.device.type == DeviceKind.TPU for p in module.parameters()):
            kwargs["static_graph"] = False
        init(self, module, *args, **kwargs)

    __init__._tpurec_emulated = True  # type: ignore[attr-defined]
    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]


def refuse_ddp_shape_check_across_hosts(hosts: int) -> None:
    """On several hosts, DDP's parameter check fails as it does on TorchTPU 0.2.0 (torchrec PR #4597)."""
    if hosts <= 1:
        return
    import torch.nn.parallel.distributed as ddp

    def _transfer_fails(process_group: Any, tensors: Any, logger: Any = None) -> None:
        raise TorchTpuRuleError(
            "transfer to 'cpu' device failed with: cHLO => [StableHLO+Shape] => StableHLO failed (emulated "
            f"torch-tpu 0.2.0 on {hosts} hosts: DDP's _verify_param_shape_across_processes copies to the host)"
        )

    ddp._verify_param_shape_across_processes = _transfer_fails
