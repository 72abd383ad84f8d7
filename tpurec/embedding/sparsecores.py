"""How many SparseCores per device a layout is built for: the hardware's count on a TPU, never a guess.

TorchTPU's SparseCore ops take no SparseCore count; the compiled kernel uses the chip's own (v5p 4,
v6e 2, v7x 2 per device). A MOD layout and CSR built for another count are silently wrong there, so
on a tpu device the count comes from the chip (`tpurec.runtime.device.sparsecores_per_device`, PCI ids) and a
different explicit value is refused. On CPU the count only shapes the layout (results do not depend
on it), so any count >= 1 is accepted and the default is v5p's 4. On a TPU without SparseCores
(v5e, v4) the TensorCore kernel runs the same ops as JAX programs that read the layout for any count:
1 unless another is asked for.
"""

from __future__ import annotations

from tpurec.embedding.constraints import DEFAULT_NUM_SPARSECORES
from tpurec.errors import UserError
from tpurec.runtime import device as _device

# The layout the TensorCore kernel (tpurec/embedding/tensorcore) is given on a chip without
# SparseCores: one "SparseCore" per device, so one CSR segment per partition and no per-core padding.
TENSORCORE_LAYOUT_SPARSECORES = 1


def resolve_num_sparsecores(requested: int | None, device_type: str, *, generation: str | None = None) -> int:
    """The SparseCore count for tables on `device_type` ("tpu", "cpu", "meta").

    `generation` overrides PCI detection (tests, and callers that already know the chip).
    """
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise UserError(f"num_sparsecores must be a whole number >= 1, got {requested!r}")
    if not _device.tpu_path(device_type):
        return requested or DEFAULT_NUM_SPARSECORES
    generation = generation or _device.tpu_generation()
    if generation is None:
        raise RuntimeError(
            "cannot tell this TPU's SparseCore count: no Google TPU (PCI vendor 0x1ae0 with a known device id) "
            "under /sys/bus/pci/devices"
        )
    hardware = _device.sparsecores_per_device(generation)
    if hardware == 0:  # v5e, v4: the TensorCore kernel, which reads the same layout for any count
        return requested or TENSORCORE_LAYOUT_SPARSECORES
    if not hardware:
        raise UserError(
            f"TPU {generation} has no SparseCore the embedding kernels can drive; tpurec's SparseCore kernels "
            "need v5p, v6e or v7x (use device='cpu' for a dry run)"
        )
    if requested is not None and requested != hardware:
        raise UserError(
            f"num_sparsecores={requested}, but this TPU {generation} has {hardware} SparseCores per device; "
            f"TorchTPU's ops use the chip's own count, so a layout for {requested} would be silently wrong "
            "(leave num_sparsecores unset)"
        )
    return hardware
