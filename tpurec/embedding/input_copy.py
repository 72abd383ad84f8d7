"""A batch's SparseCore inputs to the device in one copy per dtype, not four copies per stack.

Each host->device copy through TorchTPU is a synchronous call with a fixed cost of its own: the host
tier's row copies went from ~3.7 us to a fraction of that a row when their 24 copies a step became 3
(device_copies.py, session 31), and a step of MLPerf DLRM-DCNv2 (8 stacks on a v5e) copied its inputs
in 32 (row pointers, ids, sample ids and gains of each stack), in the 283 ms of host work a step that
`bench tpu-train`'s split contender measured (session 32). So the int32 arrays of every stack are laid
end to end in one host tensor, the float32 gains in another, each moved in one copy, and every input
is a view of those on the device. TPUREC_ONE_INPUT_COPY=0 moves each tensor on its own (an A/B switch).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tpurec.embedding.preprocess import SparseCoreInput
from tpurec.runtime import env_flags

SWITCH = "TPUREC_ONE_INPUT_COPY"
_FIELDS = ("row_pointers", "embedding_ids", "sample_ids", "gains")


def wanted() -> bool:
    return env_flags.get(SWITCH) != "0"


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`tensors` (host) on `device`, one copy per dtype: views of one device tensor each, their shapes kept."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        picked = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        packed = torch.cat([tensors[i].reshape(-1) for i in picked]).to(device)
        parts = torch.split(packed, [tensors[i].numel() for i in picked])
        for i, part in zip(picked, parts):
            out[i] = part.view(tensors[i].shape)
    return [t for t in out if t is not None]


def inputs_to_device(csrs: list[SparseCoreInput], device: torch.device) -> list[SparseCoreInput]:
    """Every stack's input on `device`, its four tensors moved with every other stack's (`to_device`)."""
    moved = iter(to_device([getattr(c, f) for c in csrs for f in _FIELDS], device))
    out = []
    for c in csrs:  # (each stack's four, in _FIELDS order)
        rp, emb, smp, gains = (next(moved) for _ in _FIELDS)
        out.append(replace(c, row_pointers=rp, embedding_ids=emb, sample_ids=smp, gains=gains))
    return out
