"""Which embedding kernel runs: the one place a kernel implementation is picked.

Callers (the sharded lookups, tpurec/sharding/kernel_module.py) speak to kernels through
kernel_protocol.py and get the class from `kernel_classes`; the TPU backend (tpu.py) gets the ops'
device kernels from the same entry. A kind names one implementation: its pooled and unpooled
(sequence) class, and the TPU kernels of the `torch.ops.tpurec.*` ops it runs.

* "sparsecore" (kernel.py, sequence_kernel.py): TorchTPU's SparseCore ops (tpu.py) on v5p, v6e, v7x;
  on CPU the exact reference.
* "tensorcore" (tensorcore/): the same host half (CSR inputs, id limits, passes, state), whose ops run
  as JAX programs on the TensorCores of a TPU without SparseCore (v5e, v4; docs/tensorcore.md).

`kernel_kind(device_type, generation)` chooses by device and chip generation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tpurec.embedding.kernel import SparseCoreKernel
from tpurec.embedding.kernel_protocol import KernelFactory, SequenceKernelFactory
from tpurec.embedding.sequence_kernel import SparseCoreSequenceKernel
from tpurec.runtime import device as _device

SPARSECORE = "sparsecore"
TENSORCORE = "tensorcore"


class KernelKind(NamedTuple):
    """One implementation: the class a pooled lookup builds, the one a sequence lookup builds, and
    the TPU kernels of the ops it calls ({op: kernel}; imported only when asked, on a TPU host)."""

    pooled: KernelFactory
    sequence: SequenceKernelFactory
    device_kernels: Callable[[], dict[Any, Callable[..., Any]]]


def _sparsecore_device_kernels() -> dict[Any, Callable[..., Any]]:
    from tpurec.embedding import tpu

    return tpu.sparsecore_kernels()


def _tensorcore_device_kernels() -> dict[Any, Callable[..., Any]]:
    from tpurec.embedding.tensorcore import tpu_bridge  # imports jax: only on a TPU (or emulated) host

    return tpu_bridge.kernels()


KINDS: dict[str, KernelKind] = {
    SPARSECORE: KernelKind(SparseCoreKernel, SparseCoreSequenceKernel, _sparsecore_device_kernels),
    # the host half is shared: the same classes, other device kernels for their ops
    TENSORCORE: KernelKind(SparseCoreKernel, SparseCoreSequenceKernel, _tensorcore_device_kernels),
}


def kernel_kind(device_type: str | None = None, generation: str | None = None) -> str:
    """The kind of kernel for a device type ("cpu", "tpu", ...) and TPU generation ("v5p", ...; None:
    this host's chip, or the emulated slice's): "tensorcore" on the TPU path of a chip without usable
    SparseCores, "sparsecore" otherwise (on CPU its exact reference runs)."""
    if device_type is None or not _device.tpu_path(device_type):
        return SPARSECORE
    return TENSORCORE if _device.tensorcore_only(generation) else SPARSECORE


def device_kernels(generation: str | None = None) -> dict[Any, Callable[..., Any]]:
    """{tpurec op: its TPU kernel} for this chip's kind (`generation`: None, this host's or the emulated
    slice's): TorchTPU's SparseCore ops, or the TensorCore kernel's JAX programs on v5e and v4."""
    return kernel_classes(kernel_kind("tpu", generation)).device_kernels()


def kernel_classes(kind: str = SPARSECORE) -> KernelKind:
    """The classes of kernel kind `kind` (`KINDS`)."""
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown embedding kernel kind {kind!r}; known: {sorted(KINDS)}") from None
