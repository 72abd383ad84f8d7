"""The planner and inspector count a table's real bytes: FP16 is 2 bytes per element where it is stored
as FP16 (CPU), 4 where a TPU widens it to float32 (said in the report); optimizer state stays float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tpurec.data.catalog import TableSpec
from tpurec.planner import planners as P
from tpurec.planner import report as I
from tpurec.planner.estimators import shard_cost, table_elem_bytes
from tpurec.planner.plan_io import plan_from_dict
from tpurec.planner.topology import parse_slice

TABLES = [TableSpec("a", "fa", 100_000, 64, 1.0), TableSpec("b", "fb", 40_000, 32, 2.0)]


def test_elem_bytes_fp16_is_2_on_cpu_and_4_widened_on_tpu():
    assert table_elem_bytes(torch.float32, "cpu") == table_elem_bytes(torch.float32, "tpu") == 4
    assert table_elem_bytes(torch.float16, "cpu") == table_elem_bytes(DataType.BF16, "cpu") == 2
    assert table_elem_bytes(DataType.FP16, "tpu") == 4


def test_fp16_shard_costs_half_the_weight_bytes_and_the_same_state():
    common = dict(
        sharding_type="table_wise",
        rows=100_000,
        cols=64,
        pooling_factor=1.0,
        batch_per_device=512,
        world_size=4,
        num_shards=1,
        spec=parse_slice("v5p-8"),
        optimizer="rowwise_adagrad",
    )
    fp32, fp16 = shard_cost(**common), shard_cost(**common, elem_bytes=2)
    assert fp32.weights == 100_000 * 64 * 4 == 25_600_000
    assert fp16.weights == 100_000 * 64 * 2 == 12_800_000
    # row-wise Adagrad state (float32 per row), SparseCore buffers and float32 activations: unchanged
    assert (fp16.optimizer, fp16.buffers, fp16.activations) == (fp32.optimizer, fp32.buffers, fp32.activations)
    assert fp16.optimizer == 100_000 * 4
    assert fp16.lookup_ms == pytest.approx(fp32.lookup_ms / 2)  # half the bytes gathered per id


@pytest.mark.parametrize("topology,weights_ratio", [("cpu-2", 0.5), ("v5p-8", 1.0)])
def test_report_counts_fp16_weights_as_stored(topology, weights_ratio):
    fp16 = [dataclasses.replace(t, data_type="fp16") for t in TABLES]
    kw = dict(batch_size=64, optimizer="rowwise_adagrad")
    r32, r16 = I.plan_tables(TABLES, topology, **kw), I.plan_tables(fp16, topology, **kw)
    w32 = sum(d["weights_bytes"] for d in r32["devices"])
    w16 = sum(d["weights_bytes"] for d in r16["devices"])
    assert w16 == w32 * weights_ratio
    o32 = sum(d["optimizer_bytes"] for d in r32["devices"])
    assert sum(d["optimizer_bytes"] for d in r16["devices"]) == o32
    notes = {t["name"]: t["note"] for t in r16["tables"]}
    if weights_ratio == 1.0:  # widened on the TPU: counted at 4 bytes and said so, per table
        assert all("fp16 stored as fp32 on tpu" in n and "float32 tables" in n for n in notes.values())
        assert "fp16 stored as fp32" in I.format_text(r16)
        assert {t["stored_as"] for t in r16["tables"]} == {"fp32"}
    else:
        assert set(notes.values()) == {None} and {t["stored_as"] for t in r16["tables"]} == {"fp16"}
    assert all(t["note"] is None for t in r32["tables"])
    # the saved meta carries the dtype, so a report recomputed from a plan file counts the same
    again = I.report_from_plan_and_meta(plan_from_dict(r16["plan"]), r16["meta"])
    assert sum(d["weights_bytes"] for d in again["devices"]) == w16


def test_planner_lower_bound_counts_fp16_at_2_bytes_on_cpu():
    def ebc(data_type):
        return EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t", embedding_dim=64, num_embeddings=1000, feature_names=["f"], data_type=data_type
                )
            ],
            device=torch.device("meta"),
        )

    assert P._lower_bound_bytes(ebc(DataType.FP16), "sgd", "cpu") == 1000 * 64 * 2
    assert P._lower_bound_bytes(ebc(DataType.FP16), "sgd", "tpu") == 1000 * 64 * 4
    assert P._lower_bound_bytes(ebc(DataType.FP32), "sgd", "cpu") == 1000 * 64 * 4


def test_tables_file_carries_data_type(tmp_path):
    import json

    from tpurec.planner.tables_file import load_tables

    path = tmp_path / "tables.json"
    path.write_text(
        json.dumps([{"name": "a", "rows": 10, "dim": 8, "data_type": "FP16"}, {"name": "b", "rows": 5, "dim": 8}])
    )
    assert [t.spec.data_type for t in load_tables(str(path))] == ["fp16", "fp32"]
    path.write_text(json.dumps([{"name": "a", "rows": 10, "dim": 8, "data_type": "int8"}]))
    with pytest.raises(ValueError, match="table #0 .'a'.: data_type 'int8' must be one of fp32, fp16, bf16"):
        load_tables(str(path))
