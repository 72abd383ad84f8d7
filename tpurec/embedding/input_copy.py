"""A batch's SparseCore inputs to the device in one copy per dtype, not four copies per stack.

Each host->device copy through TorchTPU is a synchronous call with a fixed cost of its own: the host
tier's row copies went from ~3.7 us to a fraction of that a row when their 24 copies a step became 3
(device_copies.py, session 31), and a step of MLPerf DLRM-DCNv2 (8 stacks on a v5e) copied its inputs
in 32 (row pointers, ids, sample ids and gains of each stack), in the 283 ms of host work a step that
`bench tpu-train`'s split contender measured (session 32). So the int32 arrays of every stack are laid
end to end in one host tensor, the float32 gains in another, each moved in one copy, and every input
is a view of those on the device. TPUREC_ONE_INPUT_COPY=0 moves each tensor on its own (an A/B switch).

Fewer bytes too (session 34: the copies' bytes, not their number, look like the cost on the chip:
~42 MB of inputs a step for MLPerf DLRM-DCNv2, the host half 282 ms where building them takes ~60):
the sample ids cross as int16 when every value is in [0, 65535) or the padding id (`I16`), the gains
as bfloat16 when each is exact there (sum pooling's repeat counts, NaN padding), widened back on the
device to the same int32 and float32 values, bit for bit; a field that does not fit crosses as before.
42 MB -> ~29 MB at MLPerf's shapes. Opt-in, TPUREC_NARROW_INPUTS=1: on the v5e the narrow inputs
recompiled (below) and the step they shorten is the device's, not the host's (session 35: the host half
215 ms, the device's 300); off until a chip run shows them no slower.

Each field's form is kept from batch to batch (`WireForms`): on TorchTPU every new layout of the
packed tensors (which fields share a copy, at which offsets) is a new program for the widening and
for every kernel op reading the views: on the v5e a batch whose fields narrowed differently from the
one before took 7.5-28 s instead of ~0.3 (session 35: `tpurec train` at 1,167 ms a step, 307 without
narrowing). So a field crosses in its first batch's form while it fits; the first batch it does not
fit widens it for good (one new layout, said once), and no batch narrows it again. Row pointers are
not narrowed at all: a few values a stack, and they follow each batch's per-partition counts, so
whether they fit int16 changed from batch to batch.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tpurec.embedding import csr_build
from tpurec.embedding.constraints import PADDING_ID
from tpurec.embedding.preprocess import SparseCoreInput
from tpurec.runtime import env_flags

SWITCH = "TPUREC_ONE_INPUT_COPY"
NARROW_SWITCH = "TPUREC_NARROW_INPUTS"
_FIELDS = ("row_pointers", "embedding_ids", "sample_ids", "gains")
_NARROW = {"sample_ids", "gains"}  # fields whose values usually fit a narrower type, batch after batch
I16 = "i16"  # int32 in [0, 65535) or PADDING_ID, sent as int16 (value - 32768; the padding id as 32767)
BF16 = "bf16"  # float32 exact in bfloat16 (NaN too), sent as bfloat16


def wanted() -> bool:
    return env_flags.get(SWITCH) != "0"


def narrow_wanted() -> bool:
    return env_flags.get(NARROW_SWITCH) == "1"


def narrowed(t: torch.Tensor) -> tuple[str | torch.dtype, torch.Tensor]:
    """(form, the tensor as it crosses): I16 or BF16 with its encoding where every value fits exactly
    (narrow_kernels.py, one pass), else (its dtype, itself). Without numba nothing narrows."""
    kernels = _kernels()
    if kernels is None or t.numel() == 0 or t.dtype not in (torch.int32, torch.float32):
        return t.dtype, t
    src = t.reshape(-1).contiguous().numpy()
    out = np.empty(src.size, np.int16)
    if t.dtype == torch.int32:
        return (I16, torch.from_numpy(out)) if kernels.to_i16(src, out) else (t.dtype, t)
    if kernels.to_bf16_bits(src.view(np.int32), out):
        return BF16, torch.from_numpy(out).view(torch.bfloat16)
    return t.dtype, t


_KERNELS: Any = None


def _kernels() -> Any:
    """narrow_kernels (numba), or None where numba is switched off or missing (csr_build's rule)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = False
        if csr_build.available():
            from tpurec.embedding import narrow_kernels

            _KERNELS = narrow_kernels
    return _KERNELS or None


def _decode(packed: torch.Tensor, form: str | torch.dtype) -> torch.Tensor:
    """On the device: the narrow form widened back (`narrowed`'s inverse, exact)."""
    if form == I16:
        wide = packed.to(torch.int32).add_(32768)
        return wide.masked_fill_(wide == 65535, PADDING_ID)
    if form == BF16:
        return packed.float()
    return packed


class WireForms:
    """The form each tensor of a caller's batches crossed in (`to_device`'s `forms`): kept, so the
    packed layout stays the same from batch to batch (module docstring); a field widened once stays wide."""

    def __init__(self) -> None:
        # by the number of tensors: a batch run in passes (`preprocess_blocks`) moves more, and the
        # batches after it go back to the forms of their own kind
        self.kept: dict[int, list[str | torch.dtype]] = {}
        self._last = 0  # the number of tensors of the last batch
        self.widened: list[int] = []  # tensors widened after their first batch, in order (said once)

    @property
    def forms(self) -> list[str | torch.dtype] | None:
        """The forms of the last layout decided (None before any)."""
        return self.kept[self._last] if self.kept else None

    def wire(self, tensors: list[torch.Tensor], narrow: list[bool]) -> list[tuple[str | torch.dtype, torch.Tensor]]:
        """Each tensor in the form it crosses in: its kept form while it fits, else its own dtype."""
        forms = self.kept.get(len(tensors))
        out: list[tuple[str | torch.dtype, torch.Tensor]] = []
        for i, t in enumerate(tensors):
            kept = None if forms is None else forms[i]
            if not narrow[i] or kept == t.dtype:
                out.append((t.dtype, t))
                continue
            form, wire = narrowed(t)
            if kept is not None and form != kept:  # no longer fits its narrow form: wide from now on
                self.widened.append(i)
                if len(self.widened) == 1:
                    warnings.warn(
                        f"{NARROW_SWITCH}: input {i} no longer fits {kept}; it crosses as {t.dtype} from now on "
                        "(a new input layout: on a TPU, programs compiled once more)",
                        stacklevel=3,
                    )
                form, wire = t.dtype, t
            out.append((form, wire))
        self._last = len(tensors)
        self.kept[self._last] = [form for form, _ in out]
        return out


def to_device(
    tensors: list[torch.Tensor],
    device: torch.device,
    narrow: list[bool] | None = None,
    forms: WireForms | None = None,
) -> list[torch.Tensor]:
    """`tensors` (host) on `device`, one copy per form: views of one device tensor each, their shapes
    and dtypes kept. narrow[i]: tensor i may cross in a narrower form (`narrowed`), widened there;
    `forms`: the caller's kept forms (`WireForms`: the layout stays put from batch to batch). A
    device that refuses a narrow form (its copy or its widening raises) gets none again (said once)."""
    if narrow and not _NARROW_REFUSED:
        try:
            return _moved(tensors, device, narrow, forms)
        except RuntimeError as ex:  # e.g. a dtype the device has no copy or cast for: the wide forms
            _NARROW_REFUSED.append(f"{type(ex).__name__}: {str(ex)[:300]}")
            warnings.warn(f"{NARROW_SWITCH}: {_NARROW_REFUSED[0]}; inputs cross in their own dtypes", stacklevel=2)
    return _moved(tensors, device, None)


_NARROW_REFUSED: list[str] = []


def _moved(
    tensors: list[torch.Tensor], device: torch.device, narrow: list[bool] | None, kept: WireForms | None = None
) -> list[torch.Tensor]:
    if narrow and kept is not None:
        wire = kept.wire(tensors, narrow)
    else:
        wire = [narrowed(t) if narrow and narrow[i] else (t.dtype, t) for i, t in enumerate(tensors)]
    forms = [form for form, _ in wire]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for form in dict.fromkeys(forms):
        picked = [i for i, f in enumerate(forms) if f == form]
        packed = torch.cat([wire[i][1].reshape(-1) for i in picked]).to(device)
        parts = torch.split(_decode(packed, form), [tensors[i].numel() for i in picked])
        for i, part in zip(picked, parts):
            out[i] = part.view(tensors[i].shape)
    return [t for t in out if t is not None]


def inputs_to_device(
    csrs: list[SparseCoreInput], device: torch.device, forms: WireForms | None = None
) -> list[SparseCoreInput]:
    """Every stack's input on `device`, its four tensors moved with every other stack's (`to_device`),
    the narrowable fields in their narrow forms where they fit (`narrow_wanted`), in the forms kept in
    `forms` (the caller's, one per kernel: the layout then stays the same from batch to batch)."""
    tensors = [getattr(c, f) for c in csrs for f in _FIELDS]
    narrow = [f in _NARROW for _ in csrs for f in _FIELDS] if narrow_wanted() else None
    moved = iter(to_device(tensors, device, narrow, forms))
    out = []
    for c in csrs:  # (each stack's four, in _FIELDS order)
        rp, emb, smp, gains = (next(moved) for _ in _FIELDS)
        out.append(replace(c, row_pointers=rp, embedding_ids=emb, sample_ids=smp, gains=gains))
    return out
