"""KernelSettings: its checks, its device defaults, and that the modules' loose keywords and
settings= build the same kernel."""

import pytest
import torch

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection
from tpurec.embedding.settings import KernelSettings, TableLimits
from tpurec.errors import UserError

from .helpers import fused_optimizers, make_tables, random_kjt, seq_batch, seq_tables


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"max_ids_per_partition": 0}, "KernelSettings.max_ids_per_partition"),
        ({"max_unique_ids_per_partition": -3}, "KernelSettings.max_unique_ids_per_partition"),
        ({"id_limits": {"t1": (8,)}}, "KernelSettings.id_limits['t1']"),
    ],
)
def test_bad_values_are_one_line_naming_the_field(kwargs, names):
    with pytest.raises(UserError) as err:
        KernelSettings(**kwargs)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_settings_and_its_keywords_together_are_refused():
    with pytest.raises(UserError, match=r"not both \(got \['pad_dims'\]\)"):
        KernelSettings.of(KernelSettings(), pad_dims=True, stack_tables=True)  # stack_tables: its default
    assert KernelSettings.of(None, max_ids_per_partition=16).max_ids_per_partition == 16


def test_defaults_are_decided_by_the_device():
    on_cpu, on_tpu = KernelSettings().resolved_for("cpu"), KernelSettings().resolved_for("tpu")
    assert (on_cpu.pad_dims, on_cpu.widen_tables, on_cpu.fixed_limits) == (False, False, None)
    assert (on_tpu.pad_dims, on_tpu.widen_tables, on_tpu.fixed_limits) == (True, True, None)
    given = KernelSettings(pad_dims=True, widen_tables=False, fixed_limits=False).resolved_for("tpu")
    assert (given.pad_dims, given.widen_tables, given.fixed_limits) == (True, False, False)
    # Measured table limits turn fixed limits on unless they were set.
    measured = KernelSettings(id_limits={"t1": (8, 4)})
    assert measured.resolved_for("cpu").fixed_limits is True
    assert KernelSettings(id_limits={"t1": (8, 4)}, fixed_limits=False).resolved_for("cpu").fixed_limits is False


def test_the_tensorcore_kernel_on_a_tpu_caps_its_stacks(monkeypatch):
    from tpurec.embedding.settings import TENSORCORE_MAX_STACK_BYTES
    from tpurec.runtime import device as _device

    monkeypatch.setattr(_device, "tensorcore_only", lambda generation=None: True)
    assert KernelSettings().resolved_for("tpu").max_stack_bytes == TENSORCORE_MAX_STACK_BYTES
    assert KernelSettings().resolved_for("cpu").max_stack_bytes is None
    assert KernelSettings(max_stack_bytes=4096).resolved_for("tpu").max_stack_bytes == 4096
    monkeypatch.setattr(_device, "tensorcore_only", lambda generation=None: False)  # SparseCore: in place
    assert KernelSettings().resolved_for("tpu").max_stack_bytes is None
    with pytest.raises(UserError, match="KernelSettings.max_stack_bytes must be >= 1"):
        KernelSettings(max_stack_bytes=0)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_stacks_cut_by_bytes_train_as_one_stack(optimizer):
    """t1 and t3 share dim 8: under a cap smaller than both they go to two stacks, and training gives
    the same outputs and tables as one stack (each table's rows are updated on their own either way)."""

    def ebc(settings):
        torch.manual_seed(0)
        opt, kw = fused_optimizers()[optimizer]
        return SparseCoreEmbeddingBagCollection(make_tables(), opt, kw, num_sparsecores=2, settings=settings)

    one, cut = ebc(KernelSettings()), ebc(KernelSettings(max_stack_bytes=48 * 4 * 8))
    assert [len(s.layout.tables) for s in one.kernel.stacks] == [2, 1]
    assert [[t.name for t in s.layout.tables] for s in cut.kernel.stacks] == [["t1"], ["t3"], ["t2"]]
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        kjt = random_kjt(make_tables(), 6, gen, hot_ids=True)
        a, b = one(kjt).values(), cut(kjt).values()
        assert torch.equal(a, b)
        grad = torch.randn(a.shape, generator=gen)
        a.backward(grad)
        b.backward(grad)
    for name, value in one.state_dict().items():
        assert torch.equal(value, cut.state_dict()[name]), name


def _ebc(**kwargs):
    torch.manual_seed(0)
    return SparseCoreEmbeddingBagCollection(make_tables(), torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2, **kwargs)


def test_ebc_keywords_and_settings_build_the_same_kernel():
    loose = _ebc(stack_tables=False, pad_dims=True, fixed_limits=True, max_ids_per_partition=40)
    whole = _ebc(
        settings=KernelSettings(stack_tables=False, pad_dims=True, fixed_limits=True, max_ids_per_partition=40)
    )
    assert loose.kernel.settings == whole.kernel.settings
    assert whole.kernel.settings.pad_dims and not whole.kernel.settings.widen_tables
    assert len(whole.kernel.stacks) == 3 and whole.kernel.stack_limits(0) == (40, 40)
    shapes = [tuple(whole.kernel.stack_weight(i).shape) for i in range(3)]
    assert shapes == [tuple(loose.kernel.stack_weight(i).shape) for i in range(3)]
    assert shapes[1][1] == 16 and shapes[2][1] == 8  # padded to 8 floats
    kjt = random_kjt(make_tables(), 5, torch.Generator().manual_seed(1))
    assert torch.equal(loose(kjt).values(), whole(kjt).values())


def test_ec_keywords_and_settings_build_the_same_kernel():
    def ec(**kwargs):
        torch.manual_seed(0)
        return SparseCoreEmbeddingCollection(seq_tables(), torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2, **kwargs)

    loose = ec(stack_tables=False, max_ids_per_partition=24)
    whole = ec(settings=KernelSettings(stack_tables=False, max_ids_per_partition=24))
    assert loose.kernel.settings == whole.kernel.settings and len(whole.kernel.stacks) == 3
    kjt = seq_batch(torch.Generator().manual_seed(2))
    out_loose, out_whole = loose(kjt), whole(kjt)
    assert all(torch.equal(out_loose[k].values(), out_whole[k].values()) for k in out_whole.keys())
    with pytest.raises(UserError, match="not both"):
        ec(settings=KernelSettings(), max_ids_per_partition=24)


def test_fixed_limits_left_to_the_first_batch_are_twice_its_fullest_partition():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
    from tpurec.embedding.optimizers.sgd import SGDSpec

    kernel = SparseCoreKernel([KernelTable("t", 64, 8, ("f",))], SGDSpec(lr=0.1), 4, fixed_limits=True)
    assert kernel.stack_limits(0) is None
    # 8 samples over 4 SparseCores: samples 0 and 1 are SparseCore 0's; their 10 ids are rows 0-4 (5
    # distinct), all of partition 0 (rows 0-15): limits 2 * 10 -> 24 ids and 2 * 5 -> 16 unique (8-aligned)
    ids = torch.tensor([0, 1, 2, 3, 4, 4, 3, 2, 1, 0])
    lengths = torch.tensor([5, 5, 0, 0, 0, 0, 0, 0], dtype=torch.int32)
    kernel.preprocess(KeyedJaggedTensor(["f"], ids, lengths=lengths))
    assert kernel.stack_limits(0) == (24, 16) and kernel.multipass_batches == 0
    # a later batch with twice as many ids runs within them, and leaves them as they are
    kernel.preprocess(KeyedJaggedTensor(["f"], torch.cat([ids, ids]), lengths=lengths * 2))
    assert kernel.stack_limits(0) == (24, 16) and kernel.multipass_batches == 0


def test_the_tensorcore_kernel_sets_its_first_batch_limits_10_percent_over_the_batch(monkeypatch):
    """On a TPU without driven SparseCores every slot of the buffers is worked on: the first batch's
    ids plus 10% (8-aligned), not twice them; a later batch over them runs in two passes, exact."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
    from tpurec.embedding.optimizers.sgd import SGDSpec
    from tpurec.embedding.settings import FIRST_BATCH_HEADROOM, FIRST_BATCH_HEADROOM_TENSORCORE
    from tpurec.runtime import device as _device

    monkeypatch.setattr(_device, "tensorcore_only", lambda generation=None: True)
    assert KernelSettings().resolved_for("tpu").first_batch_headroom == FIRST_BATCH_HEADROOM_TENSORCORE == 0.1
    assert KernelSettings().resolved_for("cpu").first_batch_headroom == FIRST_BATCH_HEADROOM == 1.0
    assert KernelSettings(first_batch_headroom=0.5).resolved_for("tpu").first_batch_headroom == 0.5
    with pytest.raises(UserError, match=r"^KernelSettings.first_batch_headroom must be in \[0, 100\] or None"):
        KernelSettings(first_batch_headroom=-0.1)
    settings = KernelSettings(fixed_limits=True, first_batch_headroom=0.1)
    kernel = SparseCoreKernel([KernelTable("t", 512, 8, ("f",))], SGDSpec(lr=0.1), 1, settings=settings)
    # 2 samples of the same 50 rows, 100 ids of 50 distinct rows in one partition: 110 -> 112 ids; distinct
    # ids 1 + 6 / sqrt(50) = 1.85 times, 92.5 -> 96 (a small count varies by its square root)
    lengths = torch.tensor([50, 50, 0, 0], dtype=torch.int32)
    kernel.preprocess(KeyedJaggedTensor(["f"], torch.cat([torch.arange(50), torch.arange(50)]), lengths=lengths))
    assert kernel.stack_limits(0) == (112, 96) and kernel.multipass_batches == 0
    # 100 ids of 75 distinct rows: within both (with distinct ids 10% over the first batch's: two passes)
    kernel.preprocess(KeyedJaggedTensor(["f"], torch.cat([torch.arange(50), torch.arange(25, 75)]), lengths=lengths))
    assert kernel.stack_limits(0) == (112, 96) and kernel.multipass_batches == 0
    kernel.preprocess(KeyedJaggedTensor(["f"], torch.arange(120), lengths=torch.tensor([60, 60, 0, 0])))
    assert kernel.stack_limits(0) == (112, 96) and kernel.multipass_batches == 1


def test_distinct_ids_get_the_ids_headroom_where_their_count_is_large():
    """The TensorCore update's optimizer works on as many rows as the unique-id limit allows: a large
    first count gets the ids' 10% (MLPerf's largest stack: 370,073 distinct rows, 2x was 740k rows to
    update), a small one 6 Poisson deviations, never over 2x; SparseCore chips keep 2x."""
    from tpurec.embedding.kernel_input import unique_factor

    assert unique_factor(370_073, 0.1) == 1.1 and unique_factor(3_600, 0.1) == 1.1
    assert unique_factor(100, 0.1) == pytest.approx(1.6) and unique_factor(10_000, 0.05) == pytest.approx(1.06)
    assert unique_factor(1, 0.1) == unique_factor(4, 0.1) == 2.0
    assert unique_factor(370_073, 1.0) == unique_factor(100, 1.0) == 2.0


@pytest.mark.parametrize(
    "value,says",
    [
        ((0, 4), "KernelSettings.id_limits['t1'] max_ids_per_partition: 0 is not a whole number in [1, 2,147,483,647]"),
        ((8, -8), "KernelSettings.id_limits['t1'] max_unique_ids_per_partition: -8 is not a whole number in [1, "),
        (("8", 4), "KernelSettings.id_limits['t1'] max_ids_per_partition: '8' is not a whole number in [1, "),
        ((float("nan"), 4), "KernelSettings.id_limits['t1'] max_ids_per_partition: nan is not a whole number in [1, "),
        ((8.5, 4), "KernelSettings.id_limits['t1'] max_ids_per_partition: 8.5 is not a whole number in [1, "),
        ((True, 4), "KernelSettings.id_limits['t1'] max_ids_per_partition: True is not a whole number in [1, "),
        (
            (8, 4, 16, 2**31),
            "KernelSettings.id_limits['t1'] max_unique_ids_per_slice: 2147483648 is not a whole number",
        ),
    ],
)
def test_id_limits_values_are_whole_numbers_in_range(value, says):
    """0 and -8 were kept (and failed in the kernel), "8" was taken as 8, NaN was a bare ValueError."""
    with pytest.raises(UserError) as err:
        KernelSettings(id_limits={"t1": value})
    assert str(err.value).startswith(says), str(err.value)
    with pytest.raises(UserError, match=r"^TableLimits max_ids_per_partition: 0 is not a whole number"):
        TableLimits(0, 4)


def test_id_limits_of_a_table_the_module_lacks_are_refused():
    with pytest.raises(UserError) as err:
        _ebc(settings=KernelSettings(id_limits={"t1": (8, 4), "t_nope": (8, 4)}))
    assert str(err.value) == (
        "KernelSettings.id_limits: table(s) 't_nope' are not this SparseCoreEmbeddingBagCollection's "
        "(its tables: t1, t2, t3)"
    )
    assert _ebc(settings=KernelSettings(id_limits={"t1": (8, 4)})).kernel.settings.id_limits["t1"] == TableLimits(8, 4)
