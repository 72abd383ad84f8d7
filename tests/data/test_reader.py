import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.data.reader import ParquetReader
from tpurec.data.schema import DataError, DataSchema, SparseFeature, dataset_metadata
from tpurec.data.shards import scan, split_train_eval
from tpurec.errors import UserError

FEATS = [f"C{i}" for i in range(1, 27)]
DENSE = [f"I{i}" for i in range(1, 14)]


def _rows(batches):
    """Batches -> one [rows, 1 + 13 + 26] float64 matrix (label, dense, ids), one-hot data."""
    out = []
    for b in batches:
        ids = b.sparse_features.values().view(len(FEATS), -1).T.double()
        out.append(torch.cat([b.labels.double()[:, None], b.dense_features.double(), ids], 1))
    return torch.cat(out).numpy()


def _table_rows(t):
    cols = [t.column("label").to_numpy()] + [t.column(n).to_numpy() for n in DENSE + FEATS]
    return np.stack([c.astype(np.float64) for c in cols], axis=1)


def _sorted(m):
    return m[np.lexsort(m.T[::-1])]


def test_round_trip_exact_in_file_order(synth_dir, synth_table):
    r = ParquetReader(synth_dir, 512)
    batches = list(r)
    assert len(batches) == len(r) == 10  # 5000 rows: 9 full + 1 of 392
    b = batches[0]
    assert isinstance(b, Batch) and isinstance(b.sparse_features, KeyedJaggedTensor)
    assert b.sparse_features.keys() == FEATS
    assert b.sparse_features.values().dtype == torch.int64 and b.dense_features.dtype == torch.float32
    assert b.sparse_features.lengths().tolist() == [1] * (26 * 512)
    assert batches[-1].labels.shape == (392,)
    np.testing.assert_array_equal(_rows(batches), _table_rows(synth_table))
    # Per-key access agrees with the column too.
    np.testing.assert_array_equal(
        batches[1].sparse_features["C3"].values().numpy(), synth_table.column("C3").to_numpy()[512:1024]
    )


def test_drop_last_and_pad_last(synth_dir):
    r = ParquetReader(synth_dir, 512, drop_last=True)
    assert len(r) == 9 and sum(b.labels.shape[0] for b in r) == 4608
    r = ParquetReader(synth_dir, 512, pad_last=True)
    batches = list(r)
    last = batches[-1]
    assert last.labels.shape == (512,) and r.last_padding == 120
    lengths = last.sparse_features.lengths().view(26, 512)
    assert lengths[:, :392].eq(1).all() and lengths[:, 392:].eq(0).all()
    assert last.dense_features[392:].abs().sum() == 0 and last.labels[392:].sum() == 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_cover_the_dataset(synth_dir, synth_table, world_size):
    parts = [_rows(ParquetReader(synth_dir, 300, r, world_size, shuffle=True, seed=1)) for r in range(world_size)]
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 5000 and max(sizes) - min(sizes) <= 1000  # within one row group
    np.testing.assert_array_equal(_sorted(np.concatenate(parts)), _sorted(_table_rows(synth_table)))


def test_more_ranks_than_row_groups_still_gives_every_rank_rows(tmp_path):
    from tpurec.data.synth import synthesize

    synthesize(100, str(tmp_path), seed=0, row_group_size=1000, show_progress=False)
    sizes = [ParquetReader(tmp_path, 8, r, 4).num_rows for r in range(4)]
    assert sum(sizes) == 100 and min(sizes) >= 25


def test_shuffle_is_epoch_seeded(synth_dir):
    def order(seed, epoch):
        r = ParquetReader(synth_dir, 1000, shuffle=True, seed=seed, shuffle_buffer=2000)
        r.set_epoch(epoch)
        return _rows(r)

    a, b, c, d = order(0, 0), order(0, 0), order(0, 1), order(1, 0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, d)
    np.testing.assert_array_equal(_sorted(a), _sorted(c))


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_continues_exactly(synth_dir, shuffle):
    kw = dict(batch_size=384, rank=1, world_size=2, shuffle=shuffle, seed=5, shuffle_buffer=1500)
    full = ParquetReader(synth_dir, **kw)
    epoch0, epoch1 = _rows(full), _rows(full)

    r = ParquetReader(synth_dir, **kw)
    it = iter(r)
    head = [next(it) for _ in range(4)]
    state = r.state_dict()
    it.close()
    r2 = ParquetReader(synth_dir, **kw)
    r2.load_state_dict(state)
    rest = list(r2)
    np.testing.assert_array_equal(np.concatenate([_rows(head), _rows(rest)]), epoch0)
    assert r2.state_dict()["epoch"] == 1
    np.testing.assert_array_equal(_rows(r2), epoch1)  # and the next epoch is the same as uninterrupted


@pytest.mark.parametrize("shuffle", [False, True])
def test_training_stream_resumed_after_an_epochs_last_batch_goes_on_with_the_next_epoch(synth_dir, shuffle):
    from tpurec.dlrm.training.data import endless

    kw = dict(batch_size=384, shuffle=shuffle, seed=5, shuffle_buffer=1500, drop_last=True)
    full = ParquetReader(synth_dir, **kw)
    epoch0, epoch1 = list(full), list(full)
    r = ParquetReader(synth_dir, **kw)
    it = iter(r)
    for _ in epoch0:  # every batch of epoch 0; the iterator has not yet moved past the last one
        next(it)
    state = r.state_dict()  # the rest of epoch 0: no batch (test_reader_properties: resume anywhere)
    r2 = ParquetReader(synth_dir, **kw)
    r2.load_state_dict(state)
    first = next(endless(r2), None)  # was None: the empty rest of epoch 0 ended the training stream
    assert first is not None
    np.testing.assert_array_equal(_rows([first]), _rows(epoch1[:1]))
    empty = ParquetReader(synth_dir, **dict(kw, batch_size=10**7))  # drop_last: no batch in any epoch
    assert next(endless(empty), None) is None  # still ends, after two empty passes


def test_resume_state_refuses_another_world_size(synth_dir):
    state = ParquetReader(synth_dir, 100, 0, 2).state_dict()
    with pytest.raises(ValueError, match="world_size"):
        ParquetReader(synth_dir, 100, 0, 3).load_state_dict(state)


def test_cache_gives_the_same_batches(synth_dir):
    a = ParquetReader(synth_dir, 700, shuffle=True, cache=True)
    first, second = _rows(a), _rows(a)
    b = ParquetReader(synth_dir, 700, shuffle=True)
    np.testing.assert_array_equal(first, _rows(b))
    np.testing.assert_array_equal(second, _rows(b))


def test_dataset_metadata_has_oracle_auc_and_tables(synth_dir):
    m = dataset_metadata(synth_dir)
    assert 0.6 < m["oracle_auc"] < 0.95 and m["rows"] == 5000
    assert m["table_sizes"]["C1"] == 1000 and m["table_sizes"]["C9"] == 3
    assert m["dense_transform"] == "log1p_clamp0"


def test_split_train_eval_by_row_group(synth_dir, synth_table):
    train, ev = split_train_eval(synth_dir, 0.2)
    assert ev and train and not set(train) & set(ev)
    assert len(ev) == 1 and ev[0].row_group == 1 and sum(u.rows for u in train + ev) == 5000
    tr_rows = _rows(ParquetReader(train, 500))
    ev_rows = _rows(ParquetReader(ev, 500))
    np.testing.assert_array_equal(_sorted(np.concatenate([tr_rows, ev_rows])), _sorted(_table_rows(synth_table)))


def test_split_train_eval_tiny_dataset_never_empty(tmp_path):
    from tpurec.data.synth import synthesize

    synthesize(7, str(tmp_path), seed=0, show_progress=False)
    train, ev = split_train_eval(tmp_path, 0.1)
    assert sum(u.rows for u in ev) == 1 and sum(u.rows for u in train) == 6
    assert ParquetReader(ev, 4).num_rows == 1


# ---- multi-hot and weights ----------------------------------------------------------------------


def _nullable_items(schema: pa.Schema) -> pa.Schema:
    """The same schema with list elements nullable, as tpurec wrote files before 2026-12-01."""
    fields = [pa.field(f.name, pa.list_(f.type.value_type), nullable=False) if pa.types.is_list(f.type) else f
              for f in schema]  # fmt: skip
    return pa.schema(fields, metadata=schema.metadata)


def _write_multi_hot(path, rows=60, nullable_items=False):
    schema = DataSchema(
        dense=["I1"],
        sparse=[
            SparseFeature("a", 50, multi_hot=True, weights="a_w"),
            SparseFeature("b", 10),
        ],
    )
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 4, rows)
    a = [rng.integers(0, 50, n).tolist() for n in lens]
    t = pa.Table.from_arrays(
        [
            pa.array(np.arange(rows) % 2, pa.int8()),
            pa.array(np.arange(rows, dtype=np.float32)),  # I1 = row number: identifies each row
            pa.array(a, pa.list_(pa.int64())),
            pa.array([[float(x) / 10 for x in r] for r in a], pa.list_(pa.float32())),
            pa.array(np.arange(rows) % 10),
        ],
        schema=_nullable_items(schema.arrow_schema()) if nullable_items else schema.arrow_schema(),
    )
    pq.write_table(t, path, row_group_size=25)
    item = pq.ParquetFile(path).schema_arrow.field("a").type.value_field
    assert item.nullable == nullable_items  # the file really has the element form asked for
    return a


@pytest.mark.parametrize("nullable_items", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_multi_hot_with_weights(tmp_path, shuffle, nullable_items):
    a = _write_multi_hot(tmp_path / "mh.parquet", nullable_items=nullable_items)
    seen = 0
    for b in ParquetReader(tmp_path, 16, shuffle=shuffle, shuffle_buffer=50, seed=2):
        kjt = b.sparse_features
        rows = b.dense_features[:, 0].long().tolist()
        ka = kjt["a"]
        got = [ka.values()[int(o) : int(o) + int(n)].tolist() for o, n in zip(ka.offsets()[:-1], ka.lengths())]
        assert got == [a[r] for r in rows]
        wts = ka.weights()
        assert torch.allclose(wts, ka.values().float() / 10)
        assert kjt["b"].values().tolist() == [r % 10 for r in rows]
        assert kjt["b"].weights().eq(1).all()  # one-hot feature without weights gets weight 1
        seen += len(rows)
    assert seen == 60


@pytest.mark.parametrize("multi_hot", [False, True])
def test_ids_only_gives_the_same_ids_without_reading_dense_or_labels(synth_dir, tmp_path, multi_hot):
    """`ids_only` (tpurec data stats): the same KJTs as a full read; the label and dense columns are not
    read, so a dense column of the wrong type is not even noticed."""
    if multi_hot:
        _write_multi_hot(tmp_path / "mh.parquet")
        data = tmp_path
    else:
        data = synth_dir
    full = list(ParquetReader(data, 16 if multi_hot else 512))
    ids = list(ParquetReader(data, 16 if multi_hot else 512, ids_only=True))
    assert len(ids) == len(full)
    for a, b in zip(full, ids):
        ka, kb = a.sparse_features, b.sparse_features
        assert ka.keys() == kb.keys() and ka.stride() == kb.stride()
        assert torch.equal(ka.values(), kb.values()) and torch.equal(ka.lengths(), kb.lengths())
        assert b.dense_features.shape == (ka.stride(), 0) and b.labels.eq(0).all()
    if not multi_hot:
        t = pq.read_table(synth_dir / "part-00000.parquet").slice(0, 600)
        _copy_with(t, tmp_path / "x.parquet", I4=t.column("I4").cast(pa.string()))
        with pytest.raises(DataError, match="column 'I4' has type string"):
            list(ParquetReader(tmp_path, 100))
        got = [b.sparse_features.values().view(26, -1) for b in ParquetReader(tmp_path, 100, ids_only=True)]
        want = np.stack([t.column(f).to_numpy() for f in FEATS])
        np.testing.assert_array_equal(torch.cat(got, 1).numpy(), want)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("multi_hot", [False, True])
def test_id_columns_are_the_batches_ids_key_by_key(synth_dir, tmp_path, multi_hot, shuffle):
    """`id_columns` (what data stats counts): per batch, each key's ids and the lengths exactly as the
    KJT of the same batch holds them, for one-hot and multi-hot windows, batches that span row
    groups (25-row groups, batches of 16; 1,000-row groups, batches of 384), shuffled or not, a short
    padded last batch; resuming mid-epoch resumes at the same batch."""
    if multi_hot:
        _write_multi_hot(tmp_path / "mh.parquet")
        data, batch = tmp_path, 16
    else:
        data, batch = synth_dir, 384

    def reader():
        return ParquetReader(data, batch, ids_only=True, shuffle=shuffle, shuffle_buffer=50, seed=4, pad_last=True)

    kjts = [b.sparse_features for b in reader()]
    cols = list(reader().id_columns())
    assert len(cols) == len(kjts) > 2 and cols[-1].stride == kjts[-1].stride() == batch
    for kjt, c in zip(kjts, cols):
        assert c.keys == kjt.keys() and c.stride == kjt.stride()
        np.testing.assert_array_equal(c.lengths, kjt.lengths().numpy())
        per_key = kjt.to_dict()
        for k, col in zip(c.keys, c.columns):
            assert col.dtype == np.int64
            np.testing.assert_array_equal(col, per_key[k].values().numpy())
    r = reader()
    it = r.id_columns()
    next(it), next(it)
    state = r.state_dict()
    again = reader()
    again.load_state_dict(state)
    np.testing.assert_array_equal(next(again.id_columns()).lengths, cols[2].lengths)


# ---- bad inputs ---------------------------------------------------------------------------------


def _copy_with(src_table, path, **replace):
    t = src_table
    for name, arr in replace.items():
        t = t.set_column(t.schema.get_field_index(name), pa.field(name, arr.type), arr)
    pq.write_table(t, path, row_group_size=1000)


def test_truncated_parquet_file_is_named(synth_dir, tmp_path):
    data = (synth_dir / "part-00000.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.parquet: not a readable Parquet file"):
        ParquetReader(tmp_path, 100)


def test_wrong_column_type_names_file_row_group_column(synth_table, tmp_path):
    t = synth_table.slice(0, 2000)
    _copy_with(t, tmp_path / "x.parquet", I4=t.column("I4").cast(pa.string()))
    with pytest.raises(DataError, match=r"x\.parquet: row group 0: column 'I4' has type string"):
        list(ParquetReader(tmp_path, 100))


def test_missing_column_is_named(synth_table, tmp_path):
    t = synth_table.slice(0, 100)
    pq.write_table(t.drop_columns(["C7"]), tmp_path / "m.parquet")
    with pytest.raises(DataError, match=r"m\.parquet: missing column\(s\) 'C7'"):
        list(ParquetReader(tmp_path, 10))


def test_nulls_in_categorical_are_named(synth_table, tmp_path):
    t = synth_table.slice(0, 2000)
    c5 = t.column("C5").to_pylist()
    c5[1500] = None
    _copy_with(t, tmp_path / "n.parquet", C5=pa.array(c5, pa.int64()))
    with pytest.raises(DataError, match=r"n\.parquet: row group 1: column 'C5' has 1 nulls"):
        list(ParquetReader(tmp_path, 100))


@pytest.mark.parametrize("stats", [True, False])
def test_ids_out_of_range_are_named(synth_table, tmp_path, stats):
    t = synth_table.slice(0, 2000)
    c9 = t.column("C9").to_numpy().copy()  # table C9 has 3 rows
    c9[1200] = 3
    t = t.set_column(t.schema.get_field_index("C9"), t.schema.field("C9"), pa.array(c9))
    pq.write_table(t, tmp_path / "r.parquet", row_group_size=1000, write_statistics=stats)
    with pytest.raises(DataError, match=r"r\.parquet: row group 1: column 'C9': id 3 out of range \[0, 3\)"):
        list(ParquetReader(tmp_path, 100))


def test_files_without_tpurec_metadata_are_refused(tmp_path):
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "plain.parquet")
    with pytest.raises(DataError, match="no tpurec metadata"):
        scan(tmp_path)


def test_package_exports_and_light_cli_import():
    import subprocess
    import sys

    # Registering `tpurec data` and `tpurec bench` must not load torch or pyarrow.
    code = (
        "import argparse, sys, tpurec.data.cli as c, tpurec.bench.cli as b; "
        "s = argparse.ArgumentParser().add_subparsers(); c.register(s); b.register(s); "
        "print('torch' in sys.modules, 'pyarrow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    import tpurec.data as d

    assert d.ParquetReader is ParquetReader and d.DataError is DataError


def test_equal_rows_gives_every_rank_the_same_batch_count(synth_dir):
    plain = [ParquetReader(synth_dir, 256, r, 3) for r in range(3)]
    assert len({p.num_rows for p in plain}) > 1  # 5 row groups over 3 ranks: uneven
    readers = [ParquetReader(synth_dir, 256, r, 3, shuffle=True, equal_rows=True) for r in range(3)]
    smallest = min(p.num_rows for p in plain)
    assert [len(list(r)) for r in readers] == [-(-smallest // 256)] * 3
    assert all(r.state_dict()["epoch"] == 1 for r in readers)


@pytest.mark.timeout(60)
def test_abandoning_an_epoch_with_prefetch_does_not_hang(synth_dir):
    r = ParquetReader(synth_dir, 100, prefetch=1)  # 5 windows, queue of 1: producer blocks on put
    for _ in range(3):
        it = iter(r)
        next(it)
        it.close()
    assert r.state_dict()["rows_consumed"] == 300


def test_transforms_recorded_as_raw_are_applied_at_read_time(criteo_sample, tmp_path):
    from tpurec.data.catalog import DLRM_TINY_ROWS
    from tpurec.data.convert import ConvertOptions, convert
    from tpurec.data.schema import CAT_RAW, DENSE_RAW, criteo_schema

    convert(
        [str(criteo_sample)],
        str(tmp_path / "raw"),
        ConvertOptions(criteo_schema(dense_transform=DENSE_RAW, categorical=CAT_RAW)),
        show_progress=False,
    )
    convert(
        [str(criteo_sample)],
        str(tmp_path / "hashed"),
        ConvertOptions(criteo_schema(DLRM_TINY_ROWS)),
        show_progress=False,
    )
    r = ParquetReader(tmp_path / "raw", 64, dense_transform="log1p_clamp0", table_sizes=DLRM_TINY_ROWS)
    assert r.table_sizes == DLRM_TINY_ROWS
    got, want = list(r), list(ParquetReader(tmp_path / "hashed", 64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.dense_features, b.dense_features)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    with pytest.raises(ValueError, match="already hashed"):
        ParquetReader(tmp_path / "hashed", 64, table_sizes=[10] * 26)
    with pytest.raises(ValueError, match="cannot turn dense"):
        ParquetReader(tmp_path / "hashed", 64, dense_transform="raw")


def test_resume_with_another_batch_size_continues_at_the_same_row(synth_dir):
    full = _rows(ParquetReader(synth_dir, 1000, shuffle=True, seed=9, shuffle_buffer=1500))
    r = ParquetReader(synth_dir, 300, shuffle=True, seed=9, shuffle_buffer=1500)
    it = iter(r)
    head = [next(it) for _ in range(5)]  # 1500 rows
    state = r.state_dict()
    it.close()
    r2 = ParquetReader(synth_dir, 700, shuffle=True, seed=9, shuffle_buffer=1500)
    r2.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate([_rows(head), _rows(r2)]), full)


def test_corrupt_row_group_is_named(tmp_path):
    from tpurec.data.synth import synthesize

    synthesize(3000, str(tmp_path), row_group_size=1000, compression="snappy", show_progress=False)
    p = tmp_path / "part-00000.parquet"
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 2000] = b"\x5a" * 2000  # garbage inside row group 1's pages; footer intact
    p.write_bytes(bytes(data))
    with pytest.raises(
        DataError, match=r"part-00000\.parquet: row group 1: column .*(cannot decode|page checksum mismatch)"
    ):
        list(ParquetReader(tmp_path, 500))


def test_batches_feed_a_torchrec_embedding_bag_collection(synth_dir):
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from tpurec.data.catalog import TABLE_SETS
    from tpurec.dlrm.model import embedding_bag_configs

    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(TABLE_SETS["dlrm-tiny"]))
    b = next(iter(ParquetReader(synth_dir, 128, shuffle=True))).to(torch.device("cpu"))
    out = ebc(b.sparse_features)
    assert out.values().shape == (128, 26 * 16)
    # C9's bag for row 0 is exactly its table row for that id (one-hot, sum pooling).
    row = b.sparse_features["C9"].values()[0]
    torch.testing.assert_close(out["C9"][0], ebc.embedding_bags["t_C9"].weight[row])


# ---- decoding on several threads ----------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [False, True])
def test_windows_decoded_on_several_threads_give_the_same_batches(synth_dir, shuffle, monkeypatch):
    """decode_threads=3: the windows decoded on three threads (named tpurec-data-decode), the batches
    exactly those of one thread, in order, over two epochs; a resume mid-epoch continues at the same
    row; an epoch abandoned early leaves no thread behind."""
    import threading
    import time

    kw = dict(batch_size=384, rank=1, world_size=2, shuffle=shuffle, seed=5, shuffle_buffer=500)
    one = ParquetReader(synth_dir, **kw)
    want = [_rows(one), _rows(one)]
    decoded_on: list[str] = []
    load = ParquetReader._load

    def recording(self, *args):
        decoded_on.append(threading.current_thread().name)
        time.sleep(0.02)  # (a window that takes a while: the next ones go to other threads meanwhile)
        return load(self, *args)

    monkeypatch.setattr(ParquetReader, "_load", recording)
    many = ParquetReader(synth_dir, decode_threads=3, **kw)
    for epoch in want:
        np.testing.assert_array_equal(_rows(many), epoch)
    assert decoded_on and {n.split("_")[0] for n in decoded_on} == {"tpurec-data-decode"}
    assert len({n for n in decoded_on}) > 1  # (windows really went to several threads)
    r = ParquetReader(synth_dir, decode_threads=3, **kw)
    before = threading.active_count()
    it = iter(r)
    head = [next(it) for _ in range(3)]
    state = r.state_dict()
    assert threading.active_count() > before
    it.close()
    assert threading.active_count() == before  # the decoding threads ended with the epoch
    again = ParquetReader(synth_dir, decode_threads=3, **kw)
    again.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate([_rows(head), _rows(again)]), want[0])


def test_an_error_in_a_window_decoded_on_another_thread_is_the_readers_line(synth_table, tmp_path):
    t = synth_table.slice(0, 4000)
    c9 = t.column("C9").to_numpy().copy()  # table C9 has 3 rows
    c9[3500] = 3
    t = t.set_column(t.schema.get_field_index("C9"), t.schema.field("C9"), pa.array(c9))
    pq.write_table(t, tmp_path / "r.parquet", row_group_size=1000)
    with pytest.raises(DataError, match=r"r\.parquet: row group 3: column 'C9': id 3 out of range \[0, 3\)"):
        list(ParquetReader(tmp_path, 100, decode_threads=2))
    with pytest.raises(UserError, match="decode_threads must be >= 1"):
        ParquetReader(tmp_path, 100, decode_threads=0)


def test_each_decoding_thread_reads_a_file_through_its_own_handle(tmp_path):
    # pyarrow's ParquetFile pre-buffers a read into one cache per handle, which a second thread's read
    # replaces (CI once failed with "ReadRangeCache did not find matching cache entry")
    from concurrent.futures import ThreadPoolExecutor

    from tpurec.data import validate

    pq.write_table(pa.table({"a": list(range(10))}), tmp_path / "a.parquet", row_group_size=5)
    files = validate.OpenFiles(["a"])
    here = files.get(tmp_path / "a.parquet")
    assert files.get(tmp_path / "a.parquet") is here  # opened once per thread
    with ThreadPoolExecutor(1) as pool:
        there = pool.submit(files.get, tmp_path / "a.parquet").result()
    assert there is not here
    assert there.read_row_group(1).column("a").to_pylist() == [5, 6, 7, 8, 9]


def test_the_training_readers_decoding_threads_follow_the_cores_per_rank(monkeypatch):
    from tpurec.data import reader

    monkeypatch.setattr(reader.os, "sched_getaffinity", lambda pid: set(range(208)))  # a v5p host's vCPUs
    assert reader.default_decode_threads({}) == 4  # 208 cores for one rank: at most 4
    assert reader.default_decode_threads({"LOCAL_WORLD_SIZE": "4"}) == 4  # 52 each
    assert reader.default_decode_threads({"LOCAL_WORLD_SIZE": "8"}) == 3  # 26 each
    monkeypatch.setattr(reader.os, "sched_getaffinity", lambda pid: {0, 1})  # this host
    assert reader.default_decode_threads({}) == 1
    assert reader.default_decode_threads({"TPUREC_DECODE_THREADS": "6"}) == 6  # the user's choice
    with pytest.raises(UserError, match="TPUREC_DECODE_THREADS must be a whole number >= 1, got 'x'"):
        reader.default_decode_threads({"TPUREC_DECODE_THREADS": "x"})
