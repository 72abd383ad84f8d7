"""A batch over its id limits runs as several passes that each fit, and equals the unsplit step."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection
from tpurec.emulation import torchtpu_ops as tpu_standin

from .helpers import fused_optimizers

NUM_SC = 4
BATCH = 64
LIMIT = 16
TABLES = [
    EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=400, feature_names=["fa"]),
    EmbeddingBagConfig(
        name="b", embedding_dim=16, num_embeddings=3000, feature_names=["fb", "fc"], pooling=PoolingType.MEAN
    ),
    EmbeddingBagConfig(name="c", embedding_dim=12, num_embeddings=60, feature_names=["fd"]),  # stored 16 wide
]


def _heavy_batch(gen) -> KeyedJaggedTensor:
    """About 40x the ids the limits allow per (SparseCore, partition): long bags, some hot ids."""
    keys = ["fa", "fb", "fc", "fd"]
    rows = {"fa": 400, "fb": 3000, "fc": 3000, "fd": 60}
    lengths = torch.randint(30, 60, (len(keys) * BATCH,), generator=gen)
    values = []
    for k, key in enumerate(keys):
        n = int(lengths[k * BATCH : (k + 1) * BATCH].sum())
        ids = torch.randint(0, rows[key], (n,), generator=gen)
        hot = torch.rand(n, generator=gen) < 0.3  # a third of the ids are one of 3 hot rows
        ids[hot] = torch.randint(0, 3, (int(hot.sum()),), generator=gen)
        values.append(ids)
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=lengths)


def _pair(name, **kw):
    optim, kwargs = fused_optimizers()[name]
    torch.manual_seed(0)
    free = SparseCoreEmbeddingBagCollection(TABLES, optim, kwargs, num_sparsecores=NUM_SC, **kw)
    torch.manual_seed(0)
    limited = SparseCoreEmbeddingBagCollection(
        TABLES,
        optim,
        kwargs,
        num_sparsecores=NUM_SC,
        max_ids_per_partition=LIMIT,
        max_unique_ids_per_partition=LIMIT,
        fixed_limits=True,
        **kw,
    )
    return free, limited


def _close(got, want, rel=1e-5):
    """Equal up to float32 summation order: within `rel` of the largest magnitude (hot rows' SGD
    updates make some rows large, and then sums of them differ in their last bits)."""
    scale = max(1.0, float(want.abs().max()))
    diff = float((got - want).abs().max())
    assert diff <= rel * scale, f"max |difference| {diff:.3g} > {rel} x {scale:.3g}"


def _step(model, kjt, gen):
    out = model(kjt).values()
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return out.detach()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_batches_40x_over_the_limits_equal_the_unlimited_kernel(name, monkeypatch):
    # both on the layout path: the question is passes vs one pass, not the direct step's FBGEMM order
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    free, limited = _pair(name)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        kjt = _heavy_batch(gen)
        g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        want, got = _step(free, kjt, g1), _step(limited, kjt, g2)
        _close(got, want)
        stats = limited.id_stats()
        # really over: the batch's own demand is ~40x the limit, so it ran in many passes
        assert max(s.max_ids_per_partition for s in stats.values()) >= 20 * LIMIT
        assert min(s.passes for s in stats.values()) > 1
    assert limited.kernel.dropped_id_count == 0 and limited.kernel.multipass_batches == 3 * len(limited.kernel.stacks)
    assert [limited.kernel.stack_limits(i) for i in range(len(limited.kernel.stacks))] == [(LIMIT, LIMIT)] * len(
        limited.kernel.stacks
    )
    for t in ("a", "b", "c"):
        _close(limited.table_weight(t), free.table_weight(t))


def test_a_weighted_batch_over_the_limits_equals_the_unlimited_kernel():
    free, limited = _pair("rowwise_adagrad", is_weighted=True)
    gen = torch.Generator().manual_seed(6)
    plain = _heavy_batch(gen)
    kjt = KeyedJaggedTensor(
        keys=plain.keys(),
        values=plain.values(),
        lengths=plain.lengths(),
        weights=torch.rand(plain.values().numel(), generator=gen) + 0.5,
    )
    want = _step(free, kjt, torch.Generator().manual_seed(1))
    got = _step(limited, kjt, torch.Generator().manual_seed(1))
    _close(got, want)
    for t in ("a", "b", "c"):
        _close(limited.table_weight(t), free.table_weight(t))


def test_dropping_stays_available_when_asked_for_and_is_counted():
    _, dropping = _pair("sgd", allow_id_dropping=True)
    dropping(_heavy_batch(torch.Generator().manual_seed(5)))
    assert dropping.kernel.dropped_id_count > 0 and dropping.kernel.multipass_batches == 0


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_the_passes_run_through_torchtpus_ops_with_the_steps_programs(name):
    free, _ = _pair(name)
    standin = tpu_standin.install(sparsecores=NUM_SC)
    _, limited = _pair(name)
    gen = torch.Generator().manual_seed(5)
    batches = [_heavy_batch(gen) for _ in range(2)]
    with tpu_standin.adapter_on_cpu():
        for kjt in batches:
            got = _step(limited, kjt, torch.Generator().manual_seed(3))
    for kjt in batches:
        want = _step(free, kjt, torch.Generator().manual_seed(3))
    _close(got, want)
    for t in ("a", "b", "c"):
        _close(limited.table_weight(t), free.table_weight(t))
    keys = standin.compile_keys()
    stacks = len(limited.kernel.stacks)
    # every pass of every batch reused one lookup and one update program per stack
    assert len([k for k in keys if k[0] == "_sparse_dense_matmul"]) == stacks
    assert len([k for k in keys if k[0] != "_sparse_dense_matmul"]) == stacks
    assert sum(keys.values()) > 4 * stacks * len(batches)  # many passes, not one call per step


def test_a_sequence_table_over_its_partition_limits_equals_the_unlimited_one():
    tables = [EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=500, feature_names=["h"])]
    optim, kwargs = fused_optimizers()["adagrad"]
    torch.manual_seed(0)
    free = SparseCoreEmbeddingCollection(tables, optim, kwargs, num_sparsecores=NUM_SC)
    torch.manual_seed(0)
    limited = SparseCoreEmbeddingCollection(
        tables, optim, kwargs, num_sparsecores=NUM_SC, max_ids_per_partition=LIMIT, fixed_limits=True
    )
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(20, 40, (BATCH,), generator=gen)
    kjt = KeyedJaggedTensor(
        keys=["h"], values=torch.randint(0, 500, (int(lengths.sum()),), generator=gen), lengths=lengths
    )
    outs = []
    for model in (free, limited):
        out = model(kjt)["h"].values()
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
        outs.append(out.detach())
    _close(outs[1], outs[0])
    _close(limited.table_weight("s"), free.table_weight("s"))
    assert limited.kernel.multipass_batches == 1


def test_the_update_gather_has_shapes_fixed_by_the_limits_whatever_the_batch():
    """Each update pass's gradient is gathered in chunks of one size (a pass buffer's slots), each its
    own tensor: batches of any id or pass count share the gather's programs (on the emulated device:
    tests/embedding/test_fixed_programs_on_device.py)."""
    from tpurec.embedding.multipass import MultiPassInput, gather_chunk

    _, limited = _pair("sgd")
    shapes, passes = set(), set()
    for seed in (1, 2, 3):
        for x in limited.kernel.preprocess(_heavy_batch(torch.Generator().manual_seed(seed))):
            assert isinstance(x, MultiPassInput)
            passes.add(len(x.updates))
            chunk = gather_chunk(x.device_batch_size, NUM_SC, x.updates[0].max_ids_per_partition)
            for chunks in x.gather:
                for samples, slots, gains in chunks:
                    shapes.add((samples.shape, slots.shape, gains.shape))
                    assert int(slots.max()) <= x.device_batch_size  # the spare slot at most
    assert shapes == {((chunk,), (chunk,), (chunk,))}, shapes


SEQ_TABLES = [
    EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=500, feature_names=["h", "g"]),
    EmbeddingConfig(name="u", embedding_dim=8, num_embeddings=40, feature_names=["k"]),
]


def _sequence_pair(name, capacity=16, **limits):
    optim, kwargs = fused_optimizers()[name]
    torch.manual_seed(0)
    free = SparseCoreEmbeddingCollection(SEQ_TABLES, optim, kwargs, num_sparsecores=NUM_SC)
    torch.manual_seed(0)
    limited = SparseCoreEmbeddingCollection(
        SEQ_TABLES, optim, kwargs, num_sparsecores=NUM_SC, fixed_limits=True, max_ids_per_feature=capacity, **limits
    )
    return free, limited


def _long_sequences(gen, batch=6) -> KeyedJaggedTensor:
    """Features of 30-90 ids per batch, against a capacity of 16: up to 6 blocks; hot ids repeat
    within and across blocks."""
    keys, rows = ["h", "g", "k"], [500, 500, 40]
    lengths = torch.randint(5, 16, (len(keys) * batch,), generator=gen)
    values = []
    for k, r in enumerate(rows):
        ids = torch.randint(0, r, (int(lengths[k * batch : (k + 1) * batch].sum()),), generator=gen)
        ids[::4] = 7  # one hot row, in every block
        values.append(ids)
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=lengths)


def _seq_step(model, kjt, seed):
    out = model(kjt)
    flat = torch.cat([out[k].values() for k in ("h", "g", "k")])
    (flat * torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed))).sum().backward()
    return flat.detach()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_sequence_features_over_their_capacity_run_in_blocks_equal_to_the_unlimited_step(name):
    free, limited = _sequence_pair(name)
    gen = torch.Generator().manual_seed(8)
    for step in range(3):
        kjt = _long_sequences(gen)
        assert int(kjt.lengths().view(3, -1).sum(1).max()) > 2 * 16  # three blocks or more
        _close(_seq_step(limited, kjt, step), _seq_step(free, kjt, step))
    for t in ("s", "u"):
        _close(limited.table_weight(t), free.table_weight(t))
    assert limited.kernel.max_ids_per_feature == 16 and limited.kernel.multipass_batches == 3


def test_blocks_over_their_partition_limits_too_equal_the_unlimited_step():
    free, limited = _sequence_pair("rowwise_adagrad", max_ids_per_partition=8, max_unique_ids_per_partition=8)
    gen = torch.Generator().manual_seed(9)
    for step in range(2):
        kjt = _long_sequences(gen)
        _close(_seq_step(limited, kjt, step), _seq_step(free, kjt, step))
    for t in ("s", "u"):
        _close(limited.table_weight(t), free.table_weight(t))
    # blocks of a 16-id capacity hold 16 x 2 ids of table s's stack: over 8 per partition as well
    assert any(s.passes > 3 for s in limited.kernel.last_stats.values())


def test_sequence_blocks_run_through_torchtpus_ops_with_the_steps_programs():
    free, _ = _sequence_pair("adam")
    standin = tpu_standin.install(sparsecores=NUM_SC)
    _, limited = _sequence_pair("adam")
    gen = torch.Generator().manual_seed(10)
    batches = [_long_sequences(gen, batch=b) for b in (6, 4, 8)]  # 3, 2 and 5 blocks or so
    with tpu_standin.adapter_on_cpu():
        got = [_seq_step(limited, kjt, i) for i, kjt in enumerate(batches)]
    want = [_seq_step(free, kjt, i) for i, kjt in enumerate(batches)]
    for a, b in zip(got, want):
        _close(a, b)
    for t in ("s", "u"):
        _close(limited.table_weight(t), free.table_weight(t))
    keys = standin.compile_keys()
    stacks = len(limited.kernel.stacks)
    # whatever the number of blocks, one lookup and one update program per stack
    assert len([k for k in keys if k[0] == "_sparse_dense_matmul"]) == stacks
    assert len([k for k in keys if k[0] != "_sparse_dense_matmul"]) == stacks
    assert sum(v for k, v in keys.items() if k[0] == "_sparse_dense_matmul") >= 2 * stacks * len(batches)


def test_each_tables_passes_and_demand_are_counted_when_asked_for():
    _, limited = _pair("sgd")
    limited.kernel.table_demand = {}  # what a training run turns on (tpurec.dlrm.id_feedback.record)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        _step(limited, _heavy_batch(gen), gen)
    assert limited.kernel.table_passes == {"a": [2, 0], "b": [2, 0], "c": [2, 0]}  # every stack, both batches
    demand = limited.kernel.table_demand
    assert set(demand) == {"a", "b", "c"} and all(d[5] == 2 and d[0] > LIMIT for d in demand.values())
