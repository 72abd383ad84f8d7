"""A batch's SparseCore inputs moved to the device in one copy per dtype (tpurec/embedding/input_copy.py):
the same tensors, as views of one device tensor each."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpurec.embedding import input_copy
from tpurec.embedding.preprocess import SparseCoreInput


class _Copies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "aten::_to_copy":
            self.copies.append((args[0].dtype, args[0].numel()))
        return func(*args, **(kwargs or {}))


def _inputs(stacks: int) -> list[SparseCoreInput]:
    gen = torch.Generator().manual_seed(stacks)
    out = []
    for s in range(stacks):
        slots = 8 * (s + 1)
        out.append(
            SparseCoreInput(
                torch.randint(0, 99, (8,), dtype=torch.int32, generator=gen),
                torch.randint(0, 99, (slots,), dtype=torch.int32, generator=gen),
                torch.randint(0, 99, (slots,), dtype=torch.int32, generator=gen),
                torch.rand(slots, generator=gen),
                16,
                1,
                1,
                slots,
                slots,
            )
        )
    return out


def test_every_stacks_inputs_move_in_one_copy_per_dtype():
    csrs = _inputs(8)
    with _Copies() as mode:
        moved = input_copy.inputs_to_device(csrs, torch.device("meta"))
    ints = sum(c.row_pointers.numel() + c.embedding_ids.numel() + c.sample_ids.numel() for c in csrs)
    floats = sum(c.gains.numel() for c in csrs)
    assert mode.copies == [(torch.int32, ints), (torch.float32, floats)]  # 2 copies, not 32
    for c, m in zip(csrs, moved, strict=True):
        for f in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            got, want = getattr(m, f), getattr(c, f)
            assert got.device.type == "meta" and (got.shape, got.dtype) == (want.shape, want.dtype)
        assert (m.device_batch_size, m.max_ids_per_partition) == (c.device_batch_size, c.max_ids_per_partition)


def test_the_moved_tensors_hold_the_inputs_values():
    csrs = _inputs(3)
    moved = input_copy.inputs_to_device(csrs, torch.device("cpu"))
    for c, m in zip(csrs, moved, strict=True):
        assert torch.equal(m.row_pointers, c.row_pointers) and torch.equal(m.sample_ids, c.sample_ids)
        assert torch.equal(m.embedding_ids, c.embedding_ids) and torch.equal(m.gains, c.gains)
    # views of one tensor per dtype
    assert moved[0].embedding_ids.untyped_storage().data_ptr() == moved[2].row_pointers.untyped_storage().data_ptr()
    assert moved[0].gains.untyped_storage().data_ptr() == moved[1].gains.untyped_storage().data_ptr()
