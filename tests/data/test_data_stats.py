"""Id limits measured from the data (`tpurec data stats`) and read back for a layout."""

from __future__ import annotations

import json
from dataclasses import astuple

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.cli import main
from tpurec.embedding.constraints import round_up
from tpurec.embedding.demand import partition_demand
from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
from tpurec.embedding.optimizers.sgd import SGDSpec
from tpurec.planner.id_limits import IdLimitsError, load_limits


@pytest.mark.parametrize("rows,num_sc,batch", [(1000, 4, 64), (37, 2, 10), (5000, 8, 100)])
def test_the_demand_is_counted_as_the_kernel_counts_it(rows, num_sc, batch):
    gen = torch.Generator().manual_seed(rows)
    table = KernelTable("t", rows, 8, ("f", "g"))
    kernel = SparseCoreKernel([table], SGDSpec(lr=0.1), num_sc, stack_tables=False)
    lengths = torch.randint(0, 9, (2 * batch,), generator=gen)
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    ids[::3] = ids[0]  # repeats, within samples too: merged entries
    kernel.preprocess(KeyedJaggedTensor(keys=["f", "g"], values=ids, lengths=lengths))
    stats = next(iter(kernel.last_stats.values()))
    samples = np.repeat(np.arange(2 * batch) % batch, lengths.numpy())
    features = np.repeat(np.arange(2 * batch) // batch, lengths.numpy())
    got = partition_demand(ids.numpy(), samples, features, rows=rows, num_partitions=num_sc, batch=batch)
    assert got[:2] == (stats.max_ids_per_partition, stats.max_unique_ids_per_partition)
    # per SparseCore slice: all partitions of the slice together
    per_sc = stats.ids_per_partition.sum(1).max(), stats.unique_ids_per_partition.sum(1).max()
    assert got[2:] == (int(per_sc[0]), int(per_sc[1]))
    # fields too wide to pack into one int64 take the lexsort route, with the same figures
    wide = partition_demand(ids.numpy(), samples, features + 2**50, rows=rows, num_partitions=num_sc, batch=batch)
    assert wide == got


def test_data_stats_writes_limits_for_the_plans_layout(synth_dir, tmp_path, capsys):
    out = tmp_path / "limits.json"
    assert (
        main(["data", "stats", str(synth_dir), "--model", "dlrm-tiny", "--topology", "v5p-8", "--out", str(out)]) == 0
    )
    doc = json.loads(out.read_text())
    layout = {"topology": "v5p-8", "world_size": 4, "sparsecores_per_device": 4, "batch_size_per_device": 512}
    assert doc["layout"] == layout and doc["rows"] == 5000 and doc["batches"] == 3
    assert len(doc["tables"]) == 26
    for t in doc["tables"].values():
        assert 8 <= t["max_unique_ids_per_partition"] <= t["max_ids_per_partition"]
        assert t["max_ids_per_partition"] % 8 == 0 and t["max_ids_per_partition"] >= t["observed"]["max_ids"]
        assert t["observed"]["p50_ids"] <= t["observed"]["max_ids"]
    # never above the worst case the planner assumes (every id of a slice in one partition: 512, which
    # the 3-row table reaches), and far below it over the tables
    limits = [t["max_ids_per_partition"] for t in doc["tables"].values()]
    assert max(limits) == 512 and sum(lim < 512 for lim in limits) >= 20
    limits = load_limits(str(out), layout)
    assert set(limits) == set(doc["tables"]) and all(
        v.max_ids_per_partition >= v.max_unique_ids_per_partition and v.max_ids_per_slice >= v.max_ids_per_partition
        for v in limits.values()
    )
    other = dict(layout, topology="v5p-16", world_size=8)
    with pytest.raises(IdLimitsError, match=r"measured for v5p-8 \(4 device\(s\).*not v5p-16 \(8 device\(s\)"):
        load_limits(str(out), other)


def test_a_limits_file_that_is_not_one_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(IdLimitsError, match="not a limits file"):
        load_limits(str(bad))
    bad.write_text(json.dumps({"format": "tpurec-id-limits", "tables": {"t": {"max_ids_per_partition": "x"}}}))
    with pytest.raises(IdLimitsError, match="table 't' needs integer"):
        load_limits(str(bad))
    with pytest.raises(IdLimitsError, match="No such file"):
        load_limits(str(tmp_path / "missing.json"))


def test_data_stats_refuses_an_unwritable_output_before_the_pass(synth_dir, tmp_path, capsys):
    args = ["data", "stats", str(synth_dir), "--model", "dlrm-tiny", "--topology", "v5p-8"]
    assert main([*args, "--out", str(tmp_path / "no" / "such" / "dir" / "l.json")]) == 2
    assert "cannot write into" in capsys.readouterr().err


@pytest.fixture(scope="module")
def limits_file(synth_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("limits") / "limits.json"
    assert (
        main(["data", "stats", str(synth_dir), "--model", "dlrm-tiny", "--topology", "v5p-8", "--out", str(out)]) == 0
    )
    return out


def test_the_planner_sizes_buffers_from_measured_limits_with_the_worst_case_beside(limits_file, tmp_path, capsys):
    worst, measured = tmp_path / "w.json", tmp_path / "m.json"
    base = ["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--format", "json", "--out"]
    assert main([*base, str(worst)]) == 0
    assert main([*base, str(measured), "--limits", str(limits_file)]) == 0
    w, m = json.loads(worst.read_text()), json.loads(measured.read_text())
    for dw, dm in zip(w["devices"], m["devices"]):
        assert dm["worst_case_buffers_bytes"] == dw["buffers_bytes"] == dw["worst_case_buffers_bytes"]
        assert dm["buffers_bytes"] < 0.7 * dw["buffers_bytes"]
    assert m["assumptions"]["id_limit"].startswith("measured")
    # a saved plan re-reports with the same figures
    assert main(["plan", "show", str(measured), "--format", "json", "--out", str(tmp_path / "s.json")]) == 0
    shown = json.loads((tmp_path / "s.json").read_text())
    assert [d["buffers_bytes"] for d in shown["devices"]] == [d["buffers_bytes"] for d in m["devices"]]
    # limits measured for another layout: one line naming both, exit 2
    capsys.readouterr()
    assert (
        main(
            ["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--batch-size", "256", "--limits", str(limits_file)]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "measured for v5p-8 (4 device(s), 4 SparseCores each, batch 512" in err and "batch 256 per device" in err
    assert len(err.strip().splitlines()) == 1


def _demand_of(batches, table: KernelTable, num_sc: int) -> tuple[int, ...]:
    """The table's figures over `batches` (KJTs of its features), as `tpurec data stats` counts them."""
    best: tuple[int, ...] = (0, 0, 0, 0)
    for kjt in batches:
        b = kjt.stride()
        ids, samples, feats = [], [], []
        for k, f in enumerate(table.feature_names):
            jt = kjt[f]
            ids.append(jt.values().numpy())
            samples.append(np.repeat(np.arange(b), jt.lengths().numpy()))
            feats.append(np.full(jt.values().numel(), k))
        d = partition_demand(
            np.concatenate(ids),
            np.concatenate(samples),
            np.concatenate(feats),
            rows=table.num_embeddings,
            num_partitions=num_sc,
            batch=b,
        )
        best = tuple(max(x, y) for x, y in zip(best, d))
    return best


def test_measured_limits_bound_every_stack_so_no_batch_needs_a_second_pass():
    gen = torch.Generator().manual_seed(4)
    sizes = {"small": 40, "mid": 3000, "big": 50_000, "hot": 20_000}
    tables = [KernelTable(n, r, 8, (f"f_{n}",)) for n, r in sizes.items()]
    batches = []
    for _ in range(6):
        lengths = torch.randint(1, 6, (4 * 64,), generator=gen)
        parts = []
        for k, r in enumerate(sizes.values()):
            n = int(lengths[k * 64 : (k + 1) * 64].sum())
            ids = torch.randint(0, r, (n,), generator=gen)
            if k == 3:
                ids = ids % 50  # hot: the low rows only
            parts.append(ids)
        batches.append(
            KeyedJaggedTensor(keys=[t.feature_names[0] for t in tables], values=torch.cat(parts), lengths=lengths)
        )
    limits = {t.name: _demand_of(batches, t, 4) for t in tables}
    stacked = SparseCoreKernel(tables, SGDSpec(lr=0.1), 4, id_limits=limits)
    alone = SparseCoreKernel(tables[2:3], SGDSpec(lr=0.1), 4, id_limits=limits)
    assert len(stacked.stacks) == 1 and stacked.fixed_limits
    for kjt in batches:
        stacked.preprocess(kjt)
        alone.preprocess(kjt)
    assert stacked.multipass_batches == 0 and alone.multipass_batches == 0
    # a table alone gets its own figures; the stack a bound below the worst case (every id of a
    # SparseCore's 16 samples x 5 ids x 4 features in one partition)
    assert alone.stack_limits(0) == (round_up(limits["big"][0], 8), round_up(limits["big"][1], 8))
    assert stacked.stack_limits(0)[0] < 16 * 5 * 4


def test_a_sequence_tables_capacity_comes_from_its_measured_ids_per_feature(synth_dir, tmp_path):
    from tpurec.embedding.sequence_kernel import SparseCoreSequenceKernel

    out = tmp_path / "limits.json"
    args = ["data", "stats", str(synth_dir), "--model", "dlrm-tiny", "--topology", "cpu-1", "--batch-size", "64"]
    assert main([*args, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())["tables"]
    # one-hot features: a batch of 64 samples has 64 ids per feature
    assert doc["t_C1"]["observed"]["max_ids_per_feature"] == 64 and doc["t_C1"]["max_ids_per_feature"] == 72
    limits = load_limits(str(out))
    kernel = SparseCoreSequenceKernel(
        [KernelTable("t_C1/0", 1000, 8, ("0:C1",), source="t_C1")], SGDSpec(lr=0.1), 4, id_limits=limits
    )
    assert kernel.max_ids_per_feature == 72 and kernel.fixed_limits
    # its id limits are what a SparseCore slice of its one-id bags holds (72 / 4 bags, 8-aligned), not the
    # pooled figures: 64 ids all in one partition (rows = 0 mod 4) fill slice 0 and still take one pass
    assert kernel.stack_limits(0) == (24, 24)
    one_partition = torch.arange(64) * 4
    kernel.preprocess_sequence(KeyedJaggedTensor(["0:C1"], one_partition, lengths=torch.ones(64, dtype=torch.int32)))
    assert kernel.multipass_batches == 0
    # and the planner sizes a sequence table's buffers from the same figure (a pooled one's from the file's)
    from tpurec.planner.id_limits import read_limits

    measured = read_limits(str(out), json.loads(out.read_text())["layout"])
    assert measured.max_ids("t_C1", 64, 1.0, 4, pooled=False) == kernel.stack_limits(0)[0] == 24
    assert measured.max_ids("t_C1", 64, 1.0, 4) == doc["t_C1"]["max_ids_per_partition"]


def test_data_stats_reads_the_layout_of_a_saved_plan(synth_dir, limits_file, tmp_path):
    plan, out = tmp_path / "P.json", tmp_path / "from_plan.json"
    assert main(["plan", "--model", "dlrm-tiny", "--topology", "v5p-8", "--format", "json", "--out", str(plan)]) == 0
    assert main(["data", "stats", str(synth_dir), "--model", "dlrm-tiny", "--plan", str(plan), "--out", str(out)]) == 0
    a, b = json.loads(limits_file.read_text()), json.loads(out.read_text())
    assert a["layout"] == b["layout"] and a["tables"] == b["tables"]


@pytest.mark.parametrize("route", ["compiled", "compiled_set", "numpy"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_all_tables_and_row_wise_shards_in_one_pass_count_as_each_shard_alone(one_hot, route, monkeypatch):
    """ShardsDemand's routes (compiled: small shards stamped, the rest in a set; compiled_set: every
    shard in the set; numpy) against partition_demand per table and shard (checked against the kernel)."""
    from tpurec.embedding import demand
    from tpurec.embedding.demand import ShardsDemand, TableShards

    if route == "numpy":
        monkeypatch.setenv("TPUREC_NO_NUMBA", "1")
    if route == "compiled_set":
        monkeypatch.setattr(demand, "STAMP_CELLS_PER_SHARD", 0)

    gen = np.random.default_rng(7)
    batch, num_sc = 96, 4
    tables = [
        TableShards("a", ("fa", "fa2"), 1000, ((0, 1000),)),
        TableShards("rw", ("frw",), 5000, ((0, 1700), (1700, 1700), (3400, 1600))),  # row-wise, uneven
        TableShards("tiny", ("ft",), 3, ((0, 3),)),
        # a row-wise sequence table: its most ids per feature counted per shard
        TableShards("seq", ("fs", "fs2"), 4000, ((0, 1000), (1000, 3000)), sequence=True),
    ]
    rows = {"fa": 1000, "fa2": 1000, "frw": 5000, "ft": 3, "unused": 10, "fs": 4000, "fs2": 4000}
    keys = ["unused", "frw", "fs2", "fa", "ft", "fa2", "fs"]  # not in table order, one column no table reads
    lengths = np.ones(len(keys) * batch, np.int64) if one_hot else gen.integers(0, 7, len(keys) * batch)
    values = np.concatenate(
        [gen.integers(0, rows[k], int(lengths[i * batch : (i + 1) * batch].sum())) for i, k in enumerate(keys)]
    )
    values[::5] = values[0] % 3  # repeats across and within bags
    counter = ShardsDemand(tables, keys, num_partitions=num_sc, batch=batch)
    assert (counter.stamp_cells > 0) == (route != "compiled_set")  # every shard here fits stamps
    got = counter.count(values, lengths, batch)
    assert counter.count(values, lengths, batch) == got  # a second batch: the first's stamps do not count

    offsets = np.concatenate([[0], np.cumsum(lengths)])
    columns = [values[offsets[k * batch] : offsets[(k + 1) * batch]] for k in range(len(keys))]
    assert counter.count_columns(columns, lengths, batch) == got  # the ids one array per key
    for t, figures in zip(tables, got):
        ids, samples, slots = [], [], []
        for slot, f in enumerate(t.features):
            k = keys.index(f)
            ls = lengths[k * batch : (k + 1) * batch]
            ids.append(values[offsets[k * batch] : offsets[(k + 1) * batch]])
            samples.append(np.repeat(np.arange(batch), ls))
            slots.append(np.full(int(ls.sum()), slot))
        ids, samples, slots = np.concatenate(ids), np.concatenate(samples), np.concatenate(slots)
        best: tuple[int, ...] = (0, 0, 0, 0)
        for first, n in t.shards:
            mine = (ids >= first) & (ids < first + n)
            d = partition_demand(
                ids[mine] - first, samples[mine], slots[mine], rows=n, num_partitions=num_sc, batch=batch
            )
            best = tuple(max(x, y) for x, y in zip(best, d))
        most = int(np.bincount(samples, minlength=batch).max())
        per_feature = int(np.bincount(slots).max())
        if t.sequence:  # per shard: the most of one feature's ids in one shard's rows
            per_feature = max(
                int(((ids >= first) & (ids < first + n) & (slots == slot)).sum())
                for first, n in t.shards
                for slot in range(len(t.features))
            )
            assert 0 < per_feature < int(np.bincount(slots).max())
        assert figures == (*best, most, per_feature), t.name
        assert best[0] > 0
    with pytest.raises(ValueError, match="table 'tiny': id 3 outside its 3 rows"):
        bad = values.copy()
        k = keys.index("ft")
        bad[offsets[k * batch]] = 3
        ShardsDemand(tables, keys, num_partitions=num_sc, batch=batch).count(bad, lengths, batch)


def test_bench_stats_reports_the_ratio_to_the_reader_with_its_worst_round(synth_dir, capsys):
    """`tpurec bench stats`, not a timing test: the code path, the equal-work check, the figures' order."""
    assert main(["bench", "stats", str(synth_dir), "--model", "dlrm-tiny", "--rounds", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["rows"] == 5000 and res["global_batch"] == 512 * 4 and res["rounds"] == 2
    assert 0 < res["worst_ratio_vs_reader"] <= res["ratio_vs_reader"] <= res["best_ratio_vs_reader"]
    assert len(res["load_average"]) == 2 and res["stats_rows_per_s"] > 0
    assert res["route"] == "split"  # dlrm-tiny's one-hot data: the reader's thread beside the counting caller


def test_data_stats_measures_a_users_own_model_module(synth_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "my_stats_model.py").write_text(
        "import torch\n"
        "from torchrec import EmbeddingBagCollection, EmbeddingBagConfig\n"
        "def build():\n"
        "    return EmbeddingBagCollection(device=torch.device('meta'), tables=[\n"
        "        EmbeddingBagConfig(name='pair', embedding_dim=16, num_embeddings=10**6, feature_names=['C1', 'C2']),\n"
        "        EmbeddingBagConfig(name='one', embedding_dim=16, num_embeddings=10**6, feature_names=['C3'])])\n"
        "def build_small():\n"
        "    return EmbeddingBagCollection(device=torch.device('meta'), tables=[\n"
        "        EmbeddingBagConfig(name='one', embedding_dim=16, num_embeddings=2, feature_names=['C3'])])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "l.json"
    args = ["data", "stats", str(synth_dir), "--topology", "v5p-8", "--out", str(out)]
    assert main([*args, "--model-module", "my_stats_model:build"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["tables"]) == {"pair", "one"} and doc["layout"]["batch_size_per_device"] == 512
    # two one-hot features in one table: up to twice the ids of a one-feature table per sample
    assert doc["tables"]["pair"]["observed"]["max_ids_per_sample"] == 2
    assert doc["tables"]["one"]["observed"]["max_ids_per_sample"] == 1
    # a model whose table is smaller than the data's ids: one line naming the table
    capsys.readouterr()
    assert main([*args, "--model-module", "my_stats_model:build_small"]) == 2
    assert "table 'one': id" in capsys.readouterr().err


def test_the_limits_file_reads_back_each_field_from_its_own_place(limits_file):
    """Exact figures, so that a reader taking the per-slice limits from the per-partition fields (or
    an alignment off by 8) fails. t_C1 of this data (seed 3) at v5p-8, batch 512: at most 124 ids
    (19 distinct) in a partition, 194 (59) in a SparseCore slice, 2048 in a feature; each +10%, 8-aligned."""
    layout = {"topology": "v5p-8", "world_size": 4, "sparsecores_per_device": 4, "batch_size_per_device": 512}
    doc = json.loads(limits_file.read_text())
    c1 = doc["tables"]["t_C1"]
    assert (c1["observed"]["max_ids"], c1["observed"]["max_unique_ids"]) == (124, 19)
    assert (c1["observed"]["max_ids_per_slice"], c1["observed"]["max_unique_ids_per_slice"]) == (194, 59)
    limits = load_limits(str(limits_file), layout)
    assert astuple(limits["t_C1"]) == (144, 24, 216, 72, 2256)
    fields = ("max_ids_per_partition", "max_unique_ids_per_partition", "max_ids_per_slice", "max_unique_ids_per_slice")
    for name, t in doc["tables"].items():
        assert astuple(limits[name]) == (*(t[f] for f in fields), t["max_ids_per_feature"]), name


def test_the_quantiles_are_the_next_observed_value_up():
    """`method="higher"`: a quantile is always a demand some batch had (a limit never below a real
    batch's). Ten batches of 10, 20, ..., 100 ids: p50 falls between 50 and 60 (linear would say
    55, lower or nearest 50), p99 and p99.9 between 90 and 100."""
    from tpurec.planner.id_limits import DemandTally

    tally = DemandTally([], {"sparsecores_per_device": 4, "batch_size_per_device": 64, "world_size": 1})
    tally.per_batch["t"] = [(10 * k, k, 10 * k, k, 1, 10 * k) for k in range(1, 11)]
    seen = tally.result()["t"]["observed"]
    assert [seen[f"p{q}_ids"] for q in ("50", "99", "999")] == [60, 100, 100]
    assert [seen[f"p{q}_unique_ids"] for q in ("50", "99", "999")] == [6, 10, 10]
    assert seen["max_ids"] == 100


def test_recommended_limits_are_the_maximum_plus_headroom_8_aligned():
    """Exact values: an aligned figure stays where it is (an alignment that adds 8 to it fails)."""
    from tpurec.planner.id_limits import recommended, table_entry

    # 80 x 1.1 = 88 and 0 -> the minimum 8 are already aligned; 124 x 1.1 = 136.4 -> 144
    assert [recommended(n) for n in (0, 1, 7, 8, 14, 15, 70, 80, 124, 2048)] == [8, 8, 8, 16, 16, 24, 80, 88, 144, 2256]
    entry = table_entry(124, 19, 194, 59, 1, per_slice=512, per_feature=2048)
    got = [entry[k] for k in ("max_ids_per_partition", "max_unique_ids_per_partition", "max_ids_per_slice")]
    assert got + [entry["max_unique_ids_per_slice"], entry["max_ids_per_feature"]] == [144, 24, 216, 72, 2256]
    # never above what a segment holds: 512 samples x 1 id
    assert table_entry(600, 10, 600, 10, 1, per_slice=512)["max_ids_per_partition"] == 512


def test_data_stats_prints_no_library_notice(synth_dir, tmp_path):
    """The reader's KeyedJaggedTensors made torch log its `is_fx_tracing` notice (a `W...` line) on
    every `data stats`; dropped at its logger (tpurec/runtime/library_notices.py). A process of its
    own: torch logs it once per process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    args = ["data", "stats", str(synth_dir), "--model", "dlrm-tiny", "--topology", "cpu-1", "--batch-size", "64"]
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *args, "--out", str(tmp_path / "l.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(repo)),
        cwd=repo,
    )
    assert p.returncode == 0, p.stderr
    assert [line for line in p.stderr.splitlines() if not line.startswith("wrote ")] == [], p.stderr


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_counting_on_threads_records_every_batch_in_order_as_one_thread_does(threads):
    """count_stream on threads (threads - 2 counting while the caller reads) records the same
    figures, batch by batch in order, as counting each batch in turn."""
    from types import SimpleNamespace

    from tpurec.embedding.demand import TableShards
    from tpurec.planner.id_limits import DemandTally

    gen = np.random.default_rng(threads)
    tables = [TableShards("a", ("fa",), 500, ((0, 500),)), TableShards("b", ("fb",), 40, ((0, 40),))]
    layout = {"sparsecores_per_device": 2, "batch_size_per_device": 8, "world_size": 2}
    batches = []
    for i in range(7):  # batches unlike each other: an out-of-order record would show
        lengths = gen.integers(0, 4 + i, 2 * 16)
        values = np.concatenate(
            [gen.integers(0, 500, int(lengths[:16].sum())), gen.integers(0, 40 - i, int(lengths[16:].sum()))]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], torch.from_numpy(values), torch.from_numpy(lengths))
        batches.append(SimpleNamespace(sparse_features=kjt))
    one = DemandTally(tables, layout)
    assert one.count_stream(batches, 1) == 7 * 16
    many = DemandTally(tables, layout)
    assert many.count_stream(batches, threads) == 7 * 16
    assert many.per_batch == one.per_batch
    assert len({f for f in one.per_batch["a"]}) > 1  # (the batches' figures differ)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_readers_id_columns_count_as_its_batches_do(tmp_path, threads, monkeypatch):
    """count_stream takes a ParquetReader's batches as `id_columns` (each key's ids where decoded):
    the same figures, batch by batch, as its KeyedJaggedTensors counted, on multi-hot data whose
    batches span row groups, with a row-wise table; and the numpy route (no numba) on the columns too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tpurec.data.reader import ParquetReader
    from tpurec.data.schema import DataSchema, SparseFeature
    from tpurec.embedding import csr_build
    from tpurec.embedding.demand import ShardsDemand, TableShards
    from tpurec.planner.id_limits import DemandTally

    schema = DataSchema(dense=["I1"], sparse=[SparseFeature("a", 90_000, multi_hot=True), SparseFeature("b", 40)])
    gen = np.random.default_rng(threads)
    rows = 700
    a = [gen.integers(0, 90_000, n).tolist() for n in gen.integers(0, 30, rows)]
    t = pa.Table.from_arrays(
        [
            pa.array(np.zeros(rows, np.int8)),
            pa.array(np.zeros(rows, np.float32)),
            pa.array(a, pa.list_(pa.int64())),
            pa.array(gen.integers(0, 40, rows)),
        ],
        schema=schema.arrow_schema(),
    )
    pq.write_table(t, tmp_path / "d.parquet", row_group_size=150)
    tables = [
        TableShards("ta", ("a",), 90_000, ((0, 45_000), (45_000, 45_000))),
        TableShards("tb", ("b",), 40, ((0, 40),)),
    ]
    layout = {"sparsecores_per_device": 4, "batch_size_per_device": 32, "world_size": 2}

    def reader():
        return ParquetReader(tmp_path, 64, ids_only=True)

    by_columns, by_kjt = DemandTally(tables, layout), DemandTally(tables, layout)
    assert by_columns.count_stream(reader(), threads) == by_kjt.count_stream(list(reader()), threads) == rows
    assert by_columns.per_batch == by_kjt.per_batch and len(by_kjt.per_batch["ta"]) == 11
    counter = ShardsDemand(tables, ["a", "b"], num_partitions=4, batch=64)
    first = next(reader().id_columns())
    want = counter.count(np.concatenate(first.columns), first.lengths, first.stride)
    assert counter.count_columns(first.columns, first.lengths, first.stride) == want
    monkeypatch.setattr(csr_build, "available", lambda: False)
    assert counter.count_columns(first.columns, first.lengths, first.stride) == want


def _multi_hot_dir(path, rows: int, bad_row: int | None = None):
    """A multi-hot feature `a` (90k rows) and a one-hot `b` in row groups of 150; `bad_row`'s first
    id of `a` is 90,000 (outside its table)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tpurec.data.schema import DataSchema, SparseFeature

    schema = DataSchema(dense=["I1"], sparse=[SparseFeature("a", 90_000, multi_hot=True), SparseFeature("b", 40)])
    gen = np.random.default_rng(rows)
    a = [gen.integers(0, 90_000, n).tolist() for n in gen.integers(1, 30, rows)]
    if bad_row is not None:
        a[bad_row][0] = 90_000
    ids = pa.array(a, pa.list_(pa.int64()))
    cols = [np.zeros(rows, np.int8), np.zeros(rows, np.float32), ids, gen.integers(0, 40, rows)]
    pq.write_table(pa.Table.from_arrays(cols, schema=schema.arrow_schema()), path / "d.parquet", row_group_size=150)


_TWO_TABLES = {"sparsecores_per_device": 4, "batch_size_per_device": 32, "world_size": 2}


def _two_tables():
    from tpurec.embedding.demand import TableShards

    return [TableShards("ta", ("a",), 90_000, ((0, 90_000),)), TableShards("tb", ("b",), 40, ((0, 40),))]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_multi_hot_reader_is_decoded_on_the_counting_pool(tmp_path, threads, monkeypatch):
    """With threads >= 2 a multi-hot reader's windows are decoded by the pool that counts its batches
    (threads named tpurec-stats), not by the reader's own decoding thread; with one thread, or on
    one-hot data, by the reader's thread (tpurec-data-prefetch). The figures equal one thread's."""
    import threading

    from tpurec.data.reader import ParquetReader
    from tpurec.planner.id_limits import DemandTally

    _multi_hot_dir(tmp_path, 1000)
    decoded_on: list[str] = []
    load = ParquetReader._load

    def recording(self, *args):
        decoded_on.append(threading.current_thread().name)
        return load(self, *args)

    monkeypatch.setattr(ParquetReader, "_load", recording)
    tally = DemandTally(_two_tables(), _TWO_TABLES)
    assert tally.count_stream(ParquetReader(tmp_path, 64, ids_only=True), threads) == 1000
    assert len(decoded_on) == 7  # row groups of 150
    want = "tpurec-stats" if threads >= 2 else "tpurec-data-prefetch"
    assert {name.split("_")[0] for name in decoded_on} == {want}
    serial = DemandTally(_two_tables(), _TWO_TABLES)
    serial.count_stream(list(ParquetReader(tmp_path, 64, ids_only=True)), 1)
    assert tally.per_batch == serial.per_batch and len(serial.per_batch["ta"]) == 16


def test_an_id_outside_its_table_stops_the_pooled_pass_with_its_row(tmp_path):
    """An id outside its table in a later row group, decoded on the counting pool, is the reader's
    one-line DataError naming file, row group and row; the pass stops (no thread left behind)."""
    import threading

    from tpurec.data.reader import ParquetReader
    from tpurec.data.schema import DataError
    from tpurec.planner.id_limits import DemandTally

    _multi_hot_dir(tmp_path, 1000, bad_row=700)
    before = threading.active_count()
    with pytest.raises(DataError, match=r"d\.parquet: row group 4.*'a'.*90000"):
        DemandTally(_two_tables(), _TWO_TABLES).count_stream(ParquetReader(tmp_path, 64, ids_only=True), 2)
    assert threading.active_count() == before


@pytest.mark.parametrize(("multi_hot", "threads"), [(True, 3), (False, 4), (False, 2)])
def test_the_batches_counted_at_once_stay_within_what_memory_holds(tmp_path, multi_hot, threads, monkeypatch):
    """max_held=1 (one batch fits the host's memory): one batch counted at a time whatever the
    threads; max_held=2: at most two; the same figures as one thread's. `batches_in_memory` is half
    the available memory over a global batch's bytes."""
    import threading

    from tpurec.data.reader import ParquetReader
    from tpurec.planner import limits_cli
    from tpurec.planner.id_limits import DemandTally

    if multi_hot:
        _multi_hot_dir(tmp_path, 1000)
    else:  # the multi-hot column dropped: one-hot data (the counting workers' route)
        import pyarrow.parquet as pq

        _multi_hot_dir(tmp_path, 1000)
        t = pq.read_table(tmp_path / "d.parquet").drop_columns(["a"])
        from tpurec.data.schema import DataSchema, SparseFeature

        schema = DataSchema(dense=["I1"], sparse=[SparseFeature("b", 40)])
        (tmp_path / "d.parquet").unlink()
        pq.write_table(t.cast(schema.arrow_schema()), tmp_path / "d.parquet", row_group_size=150)
    tables = _two_tables() if multi_hot else _two_tables()[1:]
    lock, busy, most = threading.Lock(), [0], [0]
    figures = DemandTally.figures

    def counting(self, ids):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            return figures(self, ids)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(DemandTally, "figures", counting)
    serial = DemandTally(tables, _TWO_TABLES)
    serial.count_stream(list(ParquetReader(tmp_path, 64, ids_only=True)), 1)
    for held in (1, 2):
        most[0] = 0
        tally = DemandTally(tables, _TWO_TABLES)
        assert tally.count_stream(ParquetReader(tmp_path, 64, ids_only=True), threads, max_held=held) == 1000
        assert 1 <= most[0] <= held
        assert tally.per_batch == serial.per_batch

    meta = {"dense": ["I1"], "sparse": [{"name": "a"}, {"name": "b"}], "multi_hot_sizes": [10, 1]}
    per_row = limits_cli.batch_bytes_per_row(meta)  # 4 + 4 + 8 * 11 + 4 * 2
    assert per_row == 104
    layout = {"batch_size_per_device": 1000, "world_size": 4}
    monkeypatch.setattr("tpurec.runtime.host_resources.available_bytes", lambda: 10 * 4000 * per_row)
    assert limits_cli.batches_in_memory("unused", layout, meta) == 5
    monkeypatch.setattr("tpurec.runtime.host_resources.available_bytes", lambda: 4000 * per_row)
    assert limits_cli.batches_in_memory("unused", layout, meta) == 1
