"""A TPU route for the FBGEMM index ops TorchRec runs on the device during input distribution.

TorchRec permutes, bucketizes and cumsums KeyedJaggedTensor lengths and ids with FBGEMM ops
(`torch.ops.fbgemm.*`) on whatever device the KJT lives on. FBGEMM has CPU and CUDA kernels only, so
on a TPU device these ops have no kernel. They are small integer bookkeeping, so the route is the
one TorchRec's own TPU path takes: run them on the host CPU and move the results back. `register()`
installs such PrivateUse1 ("tpu") kernels; it is called by `tpurec.embedding.backend` on a TPU host
only. Not yet run on TPU hardware.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

logger = logging.getLogger(__name__)

# The FBGEMM ops on TorchRec 1.9.2's input-distribution and KJT paths (dist_data.py,
# sharding/*_sharding.py, sparse/jagged_tensor.py), all integer/index bookkeeping.
HOST_OPS = (
    "asynchronous_complete_cumsum",
    "asynchronous_inclusive_cumsum",
    "asynchronous_exclusive_cumsum",
    "offsets_range",
    "permute_1D_sparse_data",
    "permute_2D_sparse_data",
    "permute_2D_sparse_data_input1D",
    "block_bucketize_sparse_features",
    "segment_sum_csr",
    "keyed_jagged_index_select_dim1",
    "expand_into_jagged_permute",
    "invert_permute",
)


def on_host(op: Callable[..., Any]) -> Callable[..., Any]:
    """A kernel that runs `op` on CPU copies of its tensor arguments and returns results on their device."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        devices = [a.device for a in args if isinstance(a, torch.Tensor)]
        device = devices[0] if devices else torch.device("cpu")
        to_cpu = lambda x: x.cpu() if isinstance(x, torch.Tensor) else x  # noqa: E731
        out = op(*tree_map(to_cpu, args), **tree_map(to_cpu, kwargs))
        return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, out)

    return kernel


_registered: list = []


def kernels() -> dict[str, Callable[..., Any]]:
    """{"fbgemm::op[.overload]": its host-route kernel} for HOST_OPS (the emulated TPU device calls them)."""
    import fbgemm_gpu  # noqa: F401  (defines torch.ops.fbgemm)

    out = {}
    for name in HOST_OPS:
        packet = getattr(torch.ops.fbgemm, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            out[op.name()] = on_host(op)
    return out


def register(dispatch_key: str = "PrivateUse1") -> list[str]:
    """Install host-fallback kernels for HOST_OPS on `dispatch_key`; returns the ops covered."""
    if _registered:
        return list(_registered[0][0])
    # torch.ops.fbgemm is empty until fbgemm_gpu is imported; registering before that would cover
    # nothing, and caching that would leave TorchRec's input distribution without kernels for good.
    import fbgemm_gpu  # noqa: F401

    lib = torch.library.Library("fbgemm", "IMPL")
    covered = []
    for name in HOST_OPS:
        packet = getattr(torch.ops.fbgemm, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            qualified = name if overload == "default" else f"{name}.{overload}"
            try:
                lib.impl(qualified, on_host(op), dispatch_key)
                covered.append(qualified)
            except RuntimeError as e:  # a kernel for this key exists already: keep it
                logger.info("fbgemm::%s keeps its %s kernel (%s)", qualified, dispatch_key, e)
    if not covered:
        raise RuntimeError(f"no FBGEMM op of {HOST_OPS} found to route through the host; is fbgemm_gpu installed?")
    _registered.append((tuple(covered), lib))  # the Library must stay alive for its kernels to stay
    return covered
