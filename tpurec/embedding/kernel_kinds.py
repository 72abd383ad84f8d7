"""Which embedding kernel class a lookup builds: the one place a kernel implementation is picked.

Callers (the sharded lookups, tpurec/sharding/kernel_module.py) speak to kernels through
kernel_protocol.py and get the class from `kernel_classes`. A kind names one implementation, its
pooled and its unpooled (sequence) class; "sparsecore" (kernel.py, sequence_kernel.py) is the only
one so far. A new kind (e.g. a TensorCore kernel) is its package under embedding/ plus an entry in
`KINDS`, and `kernel_kind` is where a device generation would select it.
"""

from __future__ import annotations

from typing import NamedTuple

from tpurec.embedding.kernel import SparseCoreKernel
from tpurec.embedding.kernel_protocol import KernelFactory, SequenceKernelFactory
from tpurec.embedding.sequence_kernel import SparseCoreSequenceKernel

SPARSECORE = "sparsecore"


class KernelKind(NamedTuple):
    """One implementation: the class a pooled lookup builds, and the one a sequence lookup builds."""

    pooled: KernelFactory
    sequence: SequenceKernelFactory


KINDS: dict[str, KernelKind] = {
    SPARSECORE: KernelKind(SparseCoreKernel, SparseCoreSequenceKernel),
}


def kernel_kind(device_type: str | None = None, generation: str | None = None) -> str:
    """The kind of kernel for a device type ("cpu", "tpu", ...) and TPU generation ("v5p", ...).

    Every device runs the SparseCore kernel today (on CPU its reference path), so this answers
    "sparsecore" whatever it is given: a generation without SparseCores would pick its kind here."""
    del device_type, generation  # one kind so far: nothing to choose between
    return SPARSECORE


def kernel_classes(kind: str = SPARSECORE) -> KernelKind:
    """The classes of kernel kind `kind` (`KINDS`)."""
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown embedding kernel kind {kind!r}; known: {sorted(KINDS)}") from None
