"""`tpurec plan --tables FILE`: the strict schema (tables_file.py). A bad entry is one line naming the
file, the table and the key; the sample file in examples/ plans with every key honoured."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.plans import run_plan
from tpurec.planner import tables_file
from tpurec.planner.estimators import shard_cost
from tpurec.planner.topology import parse_slice

GOOD = '{"name": "x", "num_embeddings": 5000, "embedding_dim": 32}'
SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tables.yaml"


@pytest.mark.parametrize(
    "entry,message",
    [
        ('{"name": "x", "rows": 0, "dim": 8}', "table #0 ('x'): rows 0 must be in [1, 1,099,511,627,776]"),
        ('{"name": "x", "num_embeddings": -5, "dim": 8}', "num_embeddings -5 must be in [1,"),
        ('{"name": "x", "rows": 1e20, "dim": 8}', "rows 1e+20 must be in [1,"),
        ('{"name": "x", "rows": "abc", "dim": 8}', "rows 'abc' is not a whole number"),
        ('{"name": "x", "rows": 10.5, "dim": 8}', "rows 10.5 is not a whole number"),
        ('{"name": "x", "rows": 10, "dim": 8, "poolng": 3}', "table #0 ('x'): unknown field(s) ['poolng']; known:"),
        (
            '{"name": "x", "rows": 10, "dim": 8, "pooling_factor": -1}',
            "pooling_factor -1.0 must be a finite number in (0, 2,147,483,647]",
        ),
        # both were OverflowError tracebacks (#61): an int past a float's range, a factor whose buffers overflow
        (
            '{"name": "x", "rows": 1' + "0" * 400 + ', "dim": 8}',
            "rows 1" + "0" * 400 + " must be in [1, 1,099,511,627,776]",
        ),
        (
            '{"name": "x", "rows": 10, "dim": 8, "pooling_factor": 1e308}',
            "pooling_factor 1e+308 must be a finite number in (0, 2,147,483,647]",
        ),
        (
            '{"name": "x", "rows": 10, "dim": 8, "pooling_factor": 1' + "0" * 400 + "}",
            "pooling_factor 1" + "0" * 400 + " is not a number",
        ),
        ('{"name": "x", "rows": 10}', "table #0 ('x'): needs 'embedding_dim' (or 'dim')"),
        ('{"rows": 10, "dim": 8}', "table #0: needs 'name'"),
        ('"x"', "table #0 is str, expected an object"),
        ('{"name": "x", "rows": 10, "dim": 8, "dim_": 1}', "unknown field(s) ['dim_']"),
        ('{"name": "x", "rows": 10, "num_embeddings": 10, "dim": 8}', "give 'num_embeddings' or 'rows', not both"),
        (
            '{"name": "x", "rows": 10, "dim": 8, "data_type": "fp64"}',
            "data_type 'fp64' must be one of fp32, fp16, bf16",
        ),
        ('{"name": "x", "rows": 10, "dim": 8, "pooling": "max"}', "pooling 'max' must be one of sum, mean, none"),
        ('{"name": "x", "rows": 10, "dim": 8, "weighted": "yes"}', "weighted 'yes' must be true or false"),
        (
            '{"name": "x", "rows": 10, "dim": 8, "sharding_types": ["data_parallel"]}',
            "sharding_types ['data_parallel'] not among",
        ),
        ('{"name": "x", "rows": 10, "dim": 8, "min_partition": 0}', "min_partition 0 must be in [1, 65,536]"),
        (
            '{"name": "x", "rows": 10, "dim": 8, "features": ["a", "b"], "pooling_factor": [1, 2, 3]}',
            "pooling_factor has 3 values for 2 feature(s) ['a', 'b']",
        ),
        ('{"name": "x", "rows": 10, "dim": 8, "features": ["a", "a"]}', "features ['a', 'a'] names a feature twice"),
        ('{"name": "half", "rows": 10, "dim": 8}', "('half'): name cannot name a TorchRec table"),
        ('{"name": "user.id", "rows": 10, "dim": 8}', "('user.id'): name cannot name a TorchRec table"),
    ],
)
def test_bad_table_entry_is_named(tmp_path, capsys, entry, message):
    path = tmp_path / "t.json"
    path.write_text(f"[{entry}]")
    assert run_plan("--tables", str(path), "--topology", "v6e-4") == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_truncated_duplicate_and_shared_feature_files(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(f"[{GOOD}, {GOOD[:20]}")
    assert run_plan("--tables", str(path), "--topology", "v6e-4") == 2
    assert f"{path}: not a valid tables file (JSONDecodeError" in capsys.readouterr().err
    path.write_text(f"[{GOOD}, {GOOD}]")
    assert run_plan("--tables", str(path), "--topology", "v6e-4") == 2
    assert "table #1: name 'x' is used twice" in capsys.readouterr().err
    path.write_text(
        '[{"name": "a", "rows": 9, "dim": 8, "feature": "f"}, {"name": "b", "rows": 9, "dim": 8, "feature": "f"}]'
    )
    assert run_plan("--tables", str(path), "--topology", "v6e-4") == 2
    assert "table #1 ('b'): feature 'f' is already served by table 'a'" in capsys.readouterr().err
    path.write_text(f'{{"tables": [{GOOD}], "optimiser": "adam"}}')
    assert run_plan("--tables", str(path), "--topology", "v6e-4") == 2
    assert "unknown top-level key(s) ['optimiser']" in capsys.readouterr().err
    yaml_path = tmp_path / "t.yaml"
    yaml_path.write_text("tables:\n  - {name: x, rows: [1\n")
    assert run_plan("--tables", str(yaml_path), "--topology", "v6e-4") == 2
    assert f"{yaml_path}: not a valid tables file" in capsys.readouterr().err


def test_schema_sharding_types_are_the_kernels():
    from tpurec.planner.kernel_choice import SHARDING_TYPES

    assert list(tables_file.SHARDING_TYPES) == SHARDING_TYPES


def test_sample_tables_file_plans_with_every_key_honoured():
    from tpurec.planner import report as plan_report

    entries = tables_file.load_tables(str(SAMPLE))
    r = plan_report.plan_tables(entries, "v6e-8", batch_size=256, optimizer="rowwise_adagrad")
    assert r["fits"]
    t = {x["name"]: x for x in r["tables"]}
    # weighted tables sit in their own EBC (TorchRec's is_weighted is per collection)
    assert set(r["plan"]["modules"]) == {"unweighted", "weighted"} and t["query_terms"]["module"] == "weighted"
    assert t["query_terms"]["weighted"] and t["query_terms"]["sharding_type"] == "table_wise"  # sharding_types
    assert min(s["sizes"][1] for s in t["device_type"]["shards"]) >= 16  # min_partition
    assert (t["clicked_items"]["pooling"], t["clicked_items"]["data_type"], t["clicked_items"]["stored_as"]) == (
        "mean",
        "bf16",
        "fp32",  # widened on a TPU
    )
    # a two-feature table: ids of both features, two pooled outputs per sample
    cat = t["category"]
    assert (cat["features"], cat["pooling_factor"], cat["sharding_type"]) == (
        ["user_category", "ad_category"],
        4.0,
        "table_wise",
    )
    kw = dict(
        sharding_type="table_wise", rows=20_000, cols=64, pooling_factor=4.0, batch_per_device=256, world_size=8,
        num_shards=1, spec=parse_slice("v6e-8"), optimizer="rowwise_adagrad",
    )  # fmt: skip
    two, one = shard_cost(**kw, num_features=2), shard_cost(**kw)
    assert two.activations == 2 * (256 * 8) * 64 * 4 * 2 == 2 * one.activations
    assert cat["bytes"] == two.bytes
    # a weighted table's ids carry a float32 weight each: 8 bytes per id instead of 4, lengths unchanged
    ids, lengths = 256 * 8 * 4.0, 256 * 8 * 4
    weighted = shard_cost(**kw, weighted=True).input_comm_ms / one.input_comm_ms
    assert weighted == pytest.approx((ids * 8 + lengths) / (ids * 4 + lengths))


def test_sequence_tables_plan_as_embedding_collections_with_one_output_row_per_id(tmp_path):
    from tpurec.planner import report as plan_report

    path = tmp_path / "t.yaml"
    path.write_text(
        "- {name: history, rows: 50000, dim: 64, pooling: none, pooling_factor: 50}\n"
        "- {name: genre, rows: 1000, dim: 64, pooling: none, features: [genres], pooling_factor: 3}\n"
        "- {name: user, rows: 50000, dim: 64, pooling: sum, pooling_factor: 50}\n"
    )
    entries = tables_file.load_tables(str(path))
    r = plan_report.plan_tables(entries, "v6e-4", batch_size=128, optimizer="sgd")
    assert r["fits"]
    t = {x["name"]: x for x in r["tables"]}
    assert t["history"]["module"] == t["genre"]["module"] == "sequence_d64" and t["user"]["module"] == "unweighted"
    # The report's figures are the planner's: shard_cost of each shard, unpooled for sequence tables.
    for name, pooled in (("history", False), ("user", True)):
        shards = t[name]["shards"]
        want = sum(
            shard_cost(
                sharding_type=t[name]["sharding_type"], rows=s["sizes"][0], cols=s["sizes"][1], pooling_factor=50.0,
                batch_per_device=128, world_size=4, num_shards=len(shards), spec=parse_slice("v6e-4"),
                optimizer="sgd", pooled=pooled,
            ).bytes
            for s in shards
        )  # fmt: skip
        assert t[name]["bytes"] == want
    # same rows and ids per sample: the sequence table returns one row per id (50 per sample)
    assert t["history"]["bytes"] > t["user"]["bytes"]
