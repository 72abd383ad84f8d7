"""The compiled demand count (demand_kernels: stamps and a set, no sort) against a plain numpy
reference written here: np.unique over each id's (shard, SparseCore slice, partition, row[, feature,
sample]) tuple, for random and skewed ids, one-hot and multi-hot bags, power-of-two and other
partition counts, even and uneven row-wise shards, and a short last batch."""

from __future__ import annotations

import numpy as np
import pytest

from tpurec.embedding import csr_build, demand
from tpurec.embedding.constraints import padded_rows
from tpurec.embedding.demand import ShardsDemand, TableShards

pytestmark = pytest.mark.skipif(not csr_build.available(), reason="numba not installed")


def reference(t: TableShards, keys: list[str], values, lengths, stride: int, p: int, batch: int) -> tuple[int, ...]:
    """One table's six figures, from scratch."""
    per_slice = -(-batch // p)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows, samples, slots = [], [], []
    for slot, f in enumerate(t.features):
        k = keys.index(f)
        ls = lengths[k * stride : (k + 1) * stride]
        rows.append(values[offsets[k * stride] : offsets[(k + 1) * stride]])
        samples.append(np.repeat(np.arange(stride), ls))
        slots.append(np.full(int(ls.sum()), slot))
    r, sample, feature = (np.concatenate(a).astype(np.int64) for a in (rows, samples, slots))
    starts = np.array([first for first, _ in t.shards])
    sizes = np.array([n for _, n in t.shards])
    shard = np.searchsorted(starts, r, side="right") - 1
    local = r - starts[shard]
    part = local // (np.array([padded_rows(n, p) for n in sizes]) // p)[shard]
    slc = sample // per_slice
    seg = (shard * p + slc) * p + part
    size = len(t.shards) * p * p
    entries = np.bincount(np.unique(np.stack([seg, local, feature, sample]), axis=1)[0], minlength=size)
    distinct = np.bincount(np.unique(np.stack([seg, local]), axis=1)[0], minlength=size)
    entries, distinct = entries.reshape(-1, p, p), distinct.reshape(-1, p, p)
    per_sample = np.bincount(sample, minlength=stride) if r.size else np.zeros(1, np.int64)
    return (
        int(entries.max()),
        int(distinct.max()),
        int(entries.sum(2).max()),
        int(distinct.sum(2).max()),
        int(per_sample.max()),
        int(max(int((lengths[keys.index(f) * stride : (keys.index(f) + 1) * stride]).sum()) for f in t.features)),
    )


def _batch(gen, keys, rows, stride, one_hot, skewed):
    lengths = np.ones(len(keys) * stride, np.int32) if one_hot else gen.integers(0, 9, len(keys) * stride, np.int32)
    parts = []
    for i, k in enumerate(keys):
        n = int(lengths[i * stride : (i + 1) * stride].sum())
        if skewed:  # Zipf-like: most ids in a few hot rows, the rest spread over the table
            ids = np.minimum(gen.zipf(1.3, n) - 1, rows[k] - 1)
        else:
            ids = gen.integers(0, rows[k], n)
        parts.append(ids)
    return np.concatenate(parts).astype(np.int64), lengths


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("p", [1, 3, 4, 5, 8])
def test_the_compiled_count_equals_a_numpy_reference(p, one_hot, skewed, monkeypatch):
    gen = np.random.default_rng(p * 4 + 2 * one_hot + skewed)
    tables = [
        TableShards("big", ("fb",), 200_000, ((0, 200_000),)),  # the set (over STAMP_CELLS_PER_SHARD)
        TableShards("two", ("f2a", "f2b"), 1000, ((0, 1000),)),  # two features: bags per feature
        TableShards("even", ("fe",), 90_000, ((0, 30_000), (30_000, 30_000), (60_000, 30_000))),
        TableShards("uneven", ("fu",), 5000, ((0, 1700), (1700, 1700), (3400, 1600))),
        TableShards("tiny", ("ft",), 3, ((0, 3),)),
    ]
    rows = {"fb": 200_000, "f2a": 1000, "f2b": 1000, "fe": 90_000, "fu": 5000, "ft": 3, "unused": 7}
    keys = ["unused", "fu", "f2b", "fb", "ft", "fe", "f2a"]  # not in table order; one column unread
    batch = 101  # not a multiple of p: the last SparseCore slice is short
    monkeypatch.setattr(demand, "SET_SLOTS", 16)  # a set that must grow (the batch counted again)
    counter = ShardsDemand(tables, keys, num_partitions=p, batch=batch)
    assert counter.stamp_cells > 0 and (counter.shard_stamp_at < 0).any()  # both routes taken
    for stride in (batch, batch, 40):  # the stamps and set of a batch before do not count; a short last batch
        values, lengths = _batch(gen, keys, rows, stride, one_hot, skewed)
        got = counter.count(values, lengths, stride)
        want = [reference(t, keys, values, lengths, stride, p, batch) for t in tables]
        assert got == want
    if not one_hot:  # (one-hot tables of one shard take their own route: _one_hot_group)
        assert counter._set is not None and counter._set.size > 2 * 16  # the set grew


def test_every_shard_in_the_set_equals_every_shard_stamped(monkeypatch):
    gen = np.random.default_rng(5)
    tables = [TableShards("a", ("fa",), 4000, ((0, 2000), (2000, 2000))), TableShards("b", ("fb",), 999, ((0, 999),))]
    keys = ["fa", "fb"]
    values, lengths = _batch(gen, keys, {"fa": 4000, "fb": 999}, 64, False, True)
    stamped = ShardsDemand(tables, keys, num_partitions=4, batch=64).count(values, lengths, 64)
    monkeypatch.setattr(demand, "STAMP_CELLS_PER_SHARD", 0)
    hashed = ShardsDemand(tables, keys, num_partitions=4, batch=64)
    assert hashed.stamp_cells == 0
    want = [reference(t, keys, values, lengths, 64, 4, 64) for t in tables]
    assert hashed.count(values, lengths, 64) == stamped == want


def test_an_id_outside_its_table_is_named_with_its_table():
    tables = [TableShards("a", ("fa",), 10, ((0, 10),)), TableShards("b", ("fb",), 500_000, ((0, 500_000),))]
    counter = ShardsDemand(tables, ["fa", "fb"], num_partitions=4, batch=4)
    values = np.array([1, 2, 3, 4, 7, 500_000, 8, 9], np.int64)
    with pytest.raises(ValueError, match="table 'b': id 500000 outside its 500000 rows"):
        counter.count(values, np.ones(8, np.int32), 4)


@pytest.mark.parametrize("bitmap", [True, False])
@pytest.mark.parametrize("p", [1, 3, 4, 8])
def test_one_hot_tables_by_marks_and_by_a_set_equal_the_reference(p, bitmap, monkeypatch):
    """The one-hot route (demand_kernels._one_hot_group): tables of few rows marked in a byte array,
    the others in a bitmap of rows (or, over BITMAP_ROWS, a set of rows), two features in one table,
    on random, all-one-row, partition-boundary and bitmap-word-boundary ids; the same counter over
    several batches (no marks, bits or slots left behind)."""
    from tpurec.embedding import demand_kernels

    if not bitmap:  # every table over the bitmap's rows: the set of rows
        monkeypatch.setattr(demand_kernels, "BITMAP_ROWS", 0)
    gen = np.random.default_rng(p)
    tables = [
        TableShards("marks", ("fm",), 700, ((0, 700),)),  # padded rows <= 8 x a group's ids: marks
        TableShards("set", ("fs",), 50_000, ((0, 50_000),)),  # stamped shard, but one-hot: the set of rows
        TableShards("huge", ("fh",), 3_000_000, ((0, 3_000_000),)),  # a set-counted shard
        TableShards("pair", ("fa", "fb"), 300, ((0, 300),)),  # two features: each id its own bag still
        TableShards("one", ("f1",), 1, ((0, 1),)),
    ]
    rows = {"fm": 700, "fs": 50_000, "fh": 3_000_000, "fa": 300, "fb": 300, "f1": 1}
    keys = ["fs", "fa", "f1", "fm", "fh", "fb"]
    batch = 403
    counter = ShardsDemand(tables, keys, num_partitions=p, batch=batch)
    lengths = np.ones(len(keys) * batch, np.int32)
    for kind in ("random", "one row", "boundaries", "words", "random"):
        parts = []
        for k in keys:
            r = rows[k]
            chunk = padded_rows(r, p) // p
            if kind == "random":
                ids = gen.integers(0, r, batch)
            elif kind == "one row":
                ids = np.full(batch, r - 1)
            elif kind == "words":  # a bitmap word's first and last bits (bit 63: the sign), a hot row
                ids = np.minimum(gen.choice([0, 1, 63, 64, 127, 128, 191, 4095, 4096, r - 1], batch), r - 1)
            else:  # each partition's first and last rows, and the table's last
                edges = [x for q in range(p) for x in (q * chunk - 1, q * chunk) if 0 <= x < r] + [r - 1]
                ids = gen.choice(edges, batch)
            parts.append(ids)
        values = np.concatenate(parts).astype(np.int64)
        got = counter.count(values, lengths, batch)
        assert got == [reference(t, keys, values, lengths, batch, p, batch) for t in tables], kind
    assert counter._flags is not None and not counter._flags.any()  # every mark cleared after its group
    assert counter._bitmap is not None and not counter._bitmap.any()  # and every bit
    assert (counter._bitmap.size > 0) == bitmap  # (the route meant was taken)


def test_an_id_outside_a_one_hot_table_leaves_no_marks():
    tables = [TableShards("a", ("fa", "fb"), 10, ((0, 10),))]
    counter = ShardsDemand(tables, ["fa", "fb"], num_partitions=2, batch=4)
    with pytest.raises(ValueError, match="table 'a': id 10 outside its 10 rows"):
        counter.count(np.array([1, 2, 3, 4, 5, 10, 6, 7], np.int64), np.ones(8, np.int32), 4)
    assert counter._flags is not None and not counter._flags.any()
    values = np.array([1, 1, 3, 4, 1, 9, 6, 6], np.int64)
    want = [reference(tables[0], ["fa", "fb"], values, np.ones(8, np.int32), 4, 2, 4)]
    assert counter.count(values, np.ones(8, np.int32), 4) == want


def _multi_hot_batch(gen, keys, rows, chunks, stride, kind):
    """Multi-hot bags of `kind`: random, skewed (hot rows repeated in bags), boundaries (ids on both
    sides of every partition and shard start), long (bags of hundreds: slot collisions), with empty bags."""
    if kind == "long":
        lengths = gen.integers(0, 300, len(keys) * stride, np.int32)
    else:
        lengths = gen.integers(0, 12, len(keys) * stride, np.int32)
        lengths[gen.random(lengths.size) < 0.2] = 0  # empty bags
    parts = []
    for i, k in enumerate(keys):
        n = int(lengths[i * stride : (i + 1) * stride].sum())
        if kind == "skewed":
            ids = np.minimum(gen.zipf(1.2, n) - 1, rows[k] - 1)
        elif kind == "boundaries":
            edges = np.array(sorted({e + d for e in chunks[k] for d in (-1, 0, 1)} - {-1, rows[k]}))
            ids = gen.choice(edges[edges < rows[k]], n)
        else:
            ids = gen.integers(0, rows[k], n)
        parts.append(ids)
    return np.concatenate(parts).astype(np.int64), lengths


@pytest.mark.parametrize("p", [1, 3, 4, 8])
def test_multi_hot_tables_by_a_bitmap_equal_the_reference(p):
    """The multi-hot bitmap route (demand_kernels._multi_hot_bits: a group dense in its table's rows,
    distinct ids by bits, entries by a bag's slots): one-shard tables, row-wise shards of P whole
    partitions each (the shard by division) and uneven ones (by the ranges), two features in a table,
    bags long enough for slot collisions and one longer than the slots allow (the set instead);
    random, skewed, boundary and long-bag ids, several batches on one counter (bits cleared)."""
    gen = np.random.default_rng(100 + p)
    chunk = padded_rows(90_000, p) // p
    tables = [
        TableShards("one", ("fo",), 70_000, ((0, 70_000),)),
        TableShards("even", ("fe",), 4 * p * chunk, tuple((s * p * chunk, p * chunk) for s in range(4))),
        TableShards("uneven", ("fu",), 250_000, ((0, 100_000), (100_000, 70_000), (170_000, 80_000))),
        TableShards("pair", ("fa", "fb"), 80_000, ((0, 80_000),)),
    ]
    rows = {"fo": 70_000, "fe": 4 * p * chunk, "fu": 250_000, "fa": 80_000, "fb": 80_000}
    edges = {}
    for t in tables:
        e = []
        for first, size in t.shards:
            c = padded_rows(size, p) // p
            e += [first + q * c for q in range(p) if q * c < size]
        for f in t.features:
            edges[f] = e
    keys = ["fu", "fa", "fe", "fo", "fb"]
    batch = 1001  # the last SparseCore slice short
    counter = ShardsDemand(tables, keys, num_partitions=p, batch=batch)
    assert counter.table_uniform.tolist() == [0, 1, 0, 0]
    for kind in ("random", "skewed", "boundaries", "long", "random"):
        values, lengths = _multi_hot_batch(gen, keys, rows, edges, batch, kind)
        want = [reference(t, keys, values, lengths, batch, p, batch) for t in tables]
        assert counter.count(values, lengths, batch) == want, kind
        assert counter._bitmap is not None and not counter._bitmap.any()
    # a bag longer than the slots allow: that table's groups go through the set, the others still by bits
    values, lengths = _multi_hot_batch(gen, keys, rows, edges, batch, "random")
    first = keys.index("fo") * batch
    values = np.insert(values, int(lengths[:first].sum()), gen.integers(0, 70_000, 3000))
    lengths[first] += 3000
    want = [reference(t, keys, values, lengths, batch, p, batch) for t in tables]
    assert counter.count(values, lengths, batch) == want
    # an id outside its table, in either of the route's loops (the shard by division, or by the ranges)
    for name, feature, bad in (("even", "fe", 4 * p * chunk), ("uneven", "fu", -3)):
        values, lengths = _multi_hot_batch(gen, keys, rows, edges, batch, "random")
        at = int(lengths[: keys.index(feature) * batch].sum()) + 5
        values[at] = bad
        with pytest.raises(ValueError, match=f"table '{name}': id {bad} outside its {rows[feature]} rows"):
            counter.count(values, lengths, batch)
        assert not counter._bitmap.any()


def _route_calls(monkeypatch, route: str) -> list[int]:
    """count_groups and _routed_group run uncompiled, each call of its compiled `route` recorded (the group's first
    feature, its seventh argument): which groups took that route."""
    from tpurec.embedding import demand_kernels

    calls: list[int] = []
    kernel = getattr(demand_kernels, route)

    def counted(*args):
        calls.append(args[6])
        return kernel(*args)

    monkeypatch.setattr(demand_kernels, route, counted)
    monkeypatch.setattr(demand_kernels, "count_groups", demand_kernels.count_groups.py_func)
    monkeypatch.setattr(demand_kernels, "_routed_group", demand_kernels._routed_group.py_func)  # (it calls the route)
    return calls


def test_dense_multi_hot_groups_take_the_bitmap_and_sparse_ones_the_set(monkeypatch):
    """Which route a group takes (run uncompiled, the bitmap route's calls counted): a group with an
    id per 16 words of its table's rows or more takes the bitmap, a sparser one the set."""
    calls = _route_calls(monkeypatch, "_multi_hot_bits")
    # 64 samples of 4 ids on one slice: 256 ids; 4096 rows are 64 words (dense), 10^6 rows 15,625 (sparse)
    tables = [TableShards("dense", ("fd",), 4096, ((0, 4096),)), TableShards("sparse", ("fs",), 10**6, ((0, 10**6),))]
    monkeypatch.setattr(demand, "STAMP_CELLS_PER_SHARD", 0)  # (small tables are otherwise stamped)
    counter = ShardsDemand(tables, ["fd", "fs"], num_partitions=1, batch=64)
    gen = np.random.default_rng(3)
    lengths = np.full(128, 4, np.int32)
    values = np.concatenate([gen.integers(0, 4096, 256), gen.integers(0, 10**6, 256)]).astype(np.int64)
    want = [reference(t, ["fd", "fs"], values, lengths, 64, 1, 64) for t in tables]
    assert counter.count(values, lengths, 64) == want
    assert calls == [0]


def test_one_shard_stamped_multi_hot_groups_take_their_own_loop(monkeypatch):
    """A one-shard table small enough for stamps, multi-hot, is counted by `_stamped_group` (run
    uncompiled, its calls counted), a stamped row-wise one by count_groups' own loop; both equal the
    reference, on skewed ids (a hot row's stamp read right after its write), and an id outside the
    stamped table is named with the table (negative ids included)."""
    calls = _route_calls(monkeypatch, "_stamped_group")
    tables = [
        TableShards("one", ("fo", "fp"), 300, ((0, 300),)),
        TableShards("rw", ("fr",), 600, ((0, 250), (250, 350))),
    ]
    keys = ["fr", "fo", "fp"]
    rows = {"fo": 300, "fp": 300, "fr": 600}
    counter = ShardsDemand(tables, keys, num_partitions=3, batch=40)
    assert (counter.shard_stamp_at >= 0).all()
    gen = np.random.default_rng(11)
    for skewed in (True, False):
        values, lengths = _batch(gen, keys, rows, 40, False, skewed)
        want = [reference(t, keys, values, lengths, 40, 3, 40) for t in tables]
        assert counter.count(values, lengths, 40) == want
    assert calls and set(calls) == {0}  # the table "one" (first feature: index 0 of its table's list)
    for bad in (300, -2):
        values, lengths = _batch(gen, keys, rows, 40, False, False)
        lengths[40 + 7] = max(lengths[40 + 7], 1)  # feature fo, sample 7: at least one id
        at = int(lengths[:47].sum())
        values[at] = bad
        with pytest.raises(ValueError, match=f"table 'one': id {bad} outside its 300 rows"):
            counter.count(values, lengths, 40)


def test_the_divider_equals_integer_division_below_2_to_the_27():
    """`_divider`'s multiply and shift against numpy's floor division, in int64 as the kernels
    compute it: every partition size kind (1, powers of two and their neighbours, primes, the
    largest), rows at and around each multiple of the size and the last row below 2^27."""
    from tpurec.embedding.demand_kernels import ROW_BITS, _divider

    top = 1 << ROW_BITS
    gen = np.random.default_rng(7)
    sizes = [1, 2, 3, 7, 8, 9, 1000, 2_500_000, 10_000_019, (1 << 26) - 1, 1 << 26, (1 << 26) + 1, top - 1, top]
    sizes += gen.integers(1, top, 40).tolist()
    for d in sizes:
        m, s = _divider(d)
        k = np.arange(0, top // d + 1, max(1, top // d // 4096), dtype=np.int64)
        r = np.concatenate([k * d - 1, k * d, k * d + 1, gen.integers(0, top, 4096), [top - 1]]).astype(np.int64)
        r = r[(r >= 0) & (r < top)]
        assert np.array_equal((r * np.int64(m)) >> np.int64(s), r // d), d
