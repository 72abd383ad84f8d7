"""`ShardedTensor.device` on a rank holding none of its shards, for tpurec's two-backend group.

torch answers `.device` of a ShardedTensor without local shards with "cpu" only when its process
group's backend is exactly "gloo", and with `torch.cuda.current_device()` otherwise
(torch/distributed/_shard/sharded_tensor/_ops/tensor_ops.py, `tensor_device`). On the TPU path the
group is `cpu:gloo,tpu:tpu_dist`, so a rank that holds no shard of some table (table-wise plans,
most tables) crashed in DCP's save ("Found no NVIDIA driver", on a TPU VM as on this machine; found
by the TPU-slice emulation). Here such a tensor is on the CPU when the group has a gloo backend for
CPU tensors, as torch intends for gloo; every other case keeps torch's answer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import custom_sharded_op_impl
from torch.distributed._shard.sharded_tensor._ops.tensor_ops import tensor_device as _torch_tensor_device


def _has_cpu_gloo(pg: dist.ProcessGroup) -> bool:
    try:
        backend = str(dist.get_backend(pg))
    except (RuntimeError, ValueError):
        return False
    return backend == "gloo" or "cpu:gloo" in backend


@custom_sharded_op_impl(torch.Tensor.device.__get__)
def tensor_device(types: Any, args: Any = (), kwargs: Any = None, pg: Any = None) -> torch.device:
    st = args[0]
    if not st._local_shards and pg is not None and _has_cpu_gloo(pg):
        return torch.device("cpu")
    return _torch_tensor_device(types, args, kwargs, pg)
