"""A batch's SparseCore inputs moved to the device in one copy per dtype (tpurec/embedding/input_copy.py):
the same tensors, as views of one device tensor each."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpurec.embedding import input_copy
from tpurec.embedding.constraints import PADDING_ID
from tpurec.embedding.preprocess import SparseCoreInput


class _Copies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a move to another device (the widening casts on the device are _to_copy calls too)
        device = (kwargs or {}).get("device")
        if func.name() == "aten::_to_copy" and device is not None and device != args[0].device:
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


@pytest.fixture(autouse=True)
def _narrow_on(monkeypatch):
    """The narrow forms are opt-in (TPUREC_NARROW_INPUTS=1): on for these tests unless one says "0"."""
    monkeypatch.setenv(input_copy.NARROW_SWITCH, "1")


def test_inputs_cross_in_their_own_dtypes_unless_asked(monkeypatch):
    monkeypatch.delenv(input_copy.NARROW_SWITCH)
    with _Copies() as mode:
        input_copy.inputs_to_device(_mlperf_like(2), torch.device("meta"), input_copy.WireForms())
    assert [d for d, _ in mode.copies] == [torch.int32, torch.float32]


def test_every_stacks_inputs_move_in_one_copy_per_dtype(monkeypatch):
    monkeypatch.setenv(input_copy.NARROW_SWITCH, "0")
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


def test_the_moved_tensors_hold_the_inputs_values(monkeypatch):
    monkeypatch.setenv(input_copy.NARROW_SWITCH, "0")
    csrs = _inputs(3)
    moved = input_copy.inputs_to_device(csrs, torch.device("cpu"))
    for c, m in zip(csrs, moved, strict=True):
        assert torch.equal(m.row_pointers, c.row_pointers) and torch.equal(m.sample_ids, c.sample_ids)
        assert torch.equal(m.embedding_ids, c.embedding_ids) and torch.equal(m.gains, c.gains)
    # views of one tensor per dtype
    assert moved[0].embedding_ids.untyped_storage().data_ptr() == moved[2].row_pointers.untyped_storage().data_ptr()
    assert moved[0].gains.untyped_storage().data_ptr() == moved[1].gains.untyped_storage().data_ptr()


def _mlperf_like(stacks: int) -> list[SparseCoreInput]:
    """Inputs as the kernel makes them: sample ids below the device batch (49,152: 3 features of
    16,384) and the padding id in the padded slots, ids up to millions, gains that are repeat counts
    (NaN padding)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for s in range(stacks):
        slots, used = 4096 * (s + 1), 3900 * (s + 1)
        emb = torch.randint(0, 6_000_000, (slots,), dtype=torch.int32, generator=gen)
        smp = torch.randint(0, 49_152, (slots,), dtype=torch.int32, generator=gen)
        gains = torch.randint(1, 4, (slots,), generator=gen).float()
        emb[used:], smp[used:], gains[used:] = PADDING_ID, PADDING_ID, float("nan")
        rp = torch.arange(0, 8 * 512, 512, dtype=torch.int32)
        out.append(SparseCoreInput(rp, emb, smp, gains, 49_152, 1, 8, slots, slots))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _assert_bit_equal(moved: list[SparseCoreInput], csrs: list[SparseCoreInput]) -> None:
    for c, m in zip(csrs, moved, strict=True):
        for f in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            got, want = getattr(m, f), getattr(c, f)
            assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), f


def test_sample_ids_and_gains_cross_narrow_and_arrive_bit_equal():
    """MLPerf's inputs: the sample ids as int16 and the gains as bfloat16, 12 -> 8 bytes a slot,
    widened back to the same int32 and float32 bits (the padding id, NaN too); the row pointers (a
    few a stack, their fit changing with each batch's counts) stay int32."""
    csrs = _mlperf_like(3)
    with _Copies() as mode:
        input_copy.inputs_to_device(csrs, torch.device("meta"))
    moved = input_copy.inputs_to_device(csrs, torch.device("cpu"))
    slots = sum(c.embedding_ids.numel() for c in csrs)
    rps = sum(c.row_pointers.numel() for c in csrs)
    assert mode.copies == [(torch.int32, rps + slots), (torch.int16, slots), (torch.bfloat16, slots)]
    _assert_bit_equal(moved, csrs)
    # widened once per form: every stack's sample ids are views of one tensor
    assert moved[0].sample_ids.untyped_storage().data_ptr() == moved[2].sample_ids.untyped_storage().data_ptr()


def _layout(csrs: list[SparseCoreInput], forms: input_copy.WireForms) -> list[tuple[torch.dtype, int]]:
    """The copies (dtype, elements) a batch makes with the kept forms, and its values checked."""
    _assert_bit_equal(input_copy.inputs_to_device(csrs, torch.device("cpu"), forms), csrs)
    with _Copies() as mode:
        input_copy.inputs_to_device(csrs, torch.device("meta"), forms)
    return mode.copies


def test_a_kept_form_holds_the_layout_from_batch_to_batch_and_widens_once_for_good():
    """On a TPU each new layout of the copies is new programs (7.5-28 s a batch on the v5e, session
    35): with the kernel's kept forms a field that stops fitting widens once and never narrows again,
    while every batch arrives bit-equal."""
    forms = input_copy.WireForms()
    fits = _mlperf_like(2)
    first = _layout(fits, forms)
    assert first == _layout(_mlperf_like(2), forms)  # the same forms, the same copies
    wide = _mlperf_like(2)
    wide[1].sample_ids[5] = 65_535  # stack 1's sample ids no longer fit int16
    with pytest.warns(UserWarning, match="input 6 no longer fits i16; it crosses as torch.int32 from now on"):
        widened = _layout(wide, forms)
    assert widened != first and [d for d, _ in widened] == [torch.int32, torch.int16, torch.bfloat16]
    assert forms.widened == [6]
    assert _layout(fits, forms) == widened  # fits again, yet stays wide: no third layout
    assert forms.forms is not None and forms.forms[6] == torch.int32 and forms.forms[2] == input_copy.I16
    # a batch in passes moves more tensors (its own layout); the next batch is back to the kept forms
    _layout(_mlperf_like(3), forms)
    assert _layout(fits, forms) == widened and sorted(forms.kept) == [8, 12]


def test_a_field_that_does_not_fit_crosses_as_before(monkeypatch):
    csrs = _mlperf_like(2)
    csrs[1].sample_ids[5] = 65_535  # no int16 form: this stack's sample ids cross as int32
    csrs[0].gains[3] = 0.1  # not exact in bfloat16: this stack's gains cross as float32
    with _Copies() as mode:
        input_copy.inputs_to_device(csrs, torch.device("meta"))
    assert [d for d, _ in mode.copies] == [torch.int32, torch.int16, torch.float32, torch.bfloat16]
    _assert_bit_equal(input_copy.inputs_to_device(csrs, torch.device("cpu")), csrs)
    monkeypatch.setenv(input_copy.NARROW_SWITCH, "0")  # never narrowed
    with _Copies() as mode:
        input_copy.inputs_to_device(csrs, torch.device("meta"))
    assert [d for d, _ in mode.copies] == [torch.int32, torch.float32]
    _assert_bit_equal(input_copy.inputs_to_device(csrs, torch.device("cpu")), csrs)


def test_a_device_that_refuses_a_narrow_form_gets_the_wide_ones_from_then_on(monkeypatch):
    monkeypatch.setattr(input_copy, "_NARROW_REFUSED", [])
    real = input_copy._decode

    def refuse_int16(packed, form):
        if form == input_copy.I16:
            raise RuntimeError("int16 is not supported here")
        return real(packed, form)

    monkeypatch.setattr(input_copy, "_decode", refuse_int16)
    csrs = _mlperf_like(2)
    with pytest.warns(UserWarning, match="TPUREC_NARROW_INPUTS: RuntimeError: int16 is not supported here"):
        moved = input_copy.inputs_to_device(csrs, torch.device("cpu"))
    _assert_bit_equal(moved, csrs)
    with _Copies() as mode:  # no second try
        input_copy.inputs_to_device(csrs, torch.device("meta"))
    assert [d for d, _ in mode.copies] == [torch.int32, torch.float32]
