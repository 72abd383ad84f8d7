"""A process group of one process that opens no socket: every collective is a copy (or nothing).

gloo opens a TCP socket even for a world of one (its device binds to the host's address), and a TPU
VM sandbox may refuse every internet socket: on the v5e chip tpurec was lent, `init_process_group(
"cpu:gloo,tpu:tpu_dist", world_size=1)` failed with "Cannot resolve 127.0.0.1 to a (local) address"
(docs/tpu.md). With one rank each collective's result is its input, so this group computes it
directly for tensors on any device (CPU or TPU: a `copy_` on the tensors' own device).

Registered as the c10d backend `tpurec_local` (a Python ProcessGroup, as torch's own test backend
`threaded` is, torch/testing/_internal/distributed/multi_threaded_pg.py); `runtime/process_group.py`
picks it for a one-process group where this host refuses sockets.
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "tpurec_local"


def _done(result: Any) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _copy(out: torch.Tensor, src: torch.Tensor) -> None:
    if out.data_ptr() != src.data_ptr() or out.device != src.device:
        out.copy_(src.reshape(out.shape))


# c10d's stubs type each collective with overloads and options classes; this group takes what c10d's
# Python functions pass and answers alike, so it is checked as a plain class over an Any base.
_ProcessGroup: Any = dist.ProcessGroup


class LocalGroup(_ProcessGroup):
    """World size 1: reductions, broadcasts and barriers change nothing; gathers, scatters and
    all-to-alls copy the one rank's input into its output."""

    def __init__(self) -> None:
        super().__init__(0, 1)

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND

    @property
    def group_name(self) -> str:
        # c10d names a Python group in its own table only (ProcessGroup::getGroupName raises), as
        # torch's `threaded` group reads it; DeviceMesh and functional collectives ask for it
        return dist.distributed_c10d._world.pg_names[self]

    # reductions and broadcasts over one rank: the tensors already hold the result
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return _done(None)

    # gathers, scatters, all-to-alls: output = input
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for out, src in zip(outputs, inputs):
            _copy(out[0], src)
        return _done(outputs)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather(outputs, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        _copy(output, input)
        return _done([output])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, src in zip(outputs, inputs):
            _copy(out, src)
        return _done(outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allgather(outputs, inputs, opts)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        for out, src in zip(outputs, inputs):
            _copy(out, src[0])
        return _done(outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        return self.scatter(outputs, inputs, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        _copy(output, input)
        return _done([output])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        _copy(output, input)
        return _done([output])

    # the names torch.distributed's Python functions call on a group (torch 2.14, distributed_c10d.py)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def gather_single(self, outputs: list[torch.Tensor], input: torch.Tensor, opts: Any = None) -> Any:
        if outputs:
            _copy(outputs[0], input)
        return _done(outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for out, src in zip(outputs, inputs):
            _copy(out, src)
        return _done(outputs)


def _create(store: Any, rank: int, world_size: int, timeout: Any) -> LocalGroup:
    if world_size != 1:
        raise ValueError(f"the {BACKEND} process group is for one process; world_size={world_size}")
    return LocalGroup()


def register() -> None:
    """Make `tpurec_local` a c10d backend name (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def sockets_refused() -> bool:
    """Whether this host refuses internet sockets (a sandboxed TPU VM: errno 97), so gloo cannot
    start even for one process."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM):
            return False
    except OSError:
        return True
