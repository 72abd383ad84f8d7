"""`tpurec plan` plans what training runs: a named model with its training config's optimizer and
batch size, and on `cpu-N` only the sharding types `tpurec train` uses on CPU."""

from __future__ import annotations

import json

import pytest

from tests.helpers.plans import run_plan
from tpurec.data.catalog import MODEL_NAMES, TRAINING_DEFAULTS


def test_catalog_defaults_are_the_training_configs():
    from tpurec.dlrm.configs import CONFIGS
    from tpurec.planner import cli as plan_cli
    from tpurec.sharding import dmp

    for name in MODEL_NAMES:
        cfg = CONFIGS[name]
        assert (cfg.embedding_optimizer, cfg.batch_size) == (
            TRAINING_DEFAULTS[name].embedding_optimizer,
            TRAINING_DEFAULTS[name].batch_size,
        )
    assert (CONFIGS["mlperf-dcnv2"].embedding_optimizer, CONFIGS["mlperf-dcnv2"].batch_size) == ("adagrad", 8192)
    assert plan_cli.DMP_PLANNING_BATCH_SIZE == dmp.DEFAULT_PLANNING_BATCH_SIZE


def _report(capsys, *args) -> dict:
    assert run_plan(*args, "--format", "json") == 0
    return json.loads(capsys.readouterr().out)


def test_named_model_plans_with_its_training_optimizer_and_batch(capsys):
    r = _report(capsys, "--model", "mlperf-dcnv2", "--topology", "v5p-128")
    assert (r["optimizer"], r["batch_size_per_device"], r["fits"]) == ("adagrad", 8192, True)
    # flags still win
    r = _report(capsys, "--model", "dlrm-tiny", "--topology", "v5p-8", "--batch-size", "64", "--optimizer", "sgd")
    assert (r["optimizer"], r["batch_size_per_device"]) == ("sgd", 64)


def test_cpu_plan_is_the_plan_cpu_training_makes(capsys):
    import torch

    from tpurec.data.catalog import get_table_set
    from tpurec.dlrm.configs import CONFIGS
    from tpurec.dlrm.model import embedding_bag_configs, planner_constraints
    from tpurec.planner import planners as P
    from tpurec.planner.plan_io import plan_to_dict
    from tpurec.planner.topology import make_topology

    r = _report(capsys, "--model", "dlrm-tiny", "--topology", "cpu-2")
    assert {t["sharding_type"] for t in r["tables"]} <= {"table_wise", "row_wise"}
    # what `tpurec train --model dlrm-tiny --nproc 2` on CPU plans (tpurec.dlrm.model.shard)
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfg = CONFIGS["dlrm-tiny"]
    ebc = EmbeddingBagCollection(embedding_bag_configs(get_table_set("dlrm-tiny")), device=torch.device("meta"))
    names = [c.name for c in ebc.embedding_bag_configs()]
    trained = P.plan(
        ebc,
        make_topology("cpu-2"),
        batch_size=cfg.batch_size,
        optimizer=cfg.embedding_optimizer,
        constraints=planner_constraints(cfg, "cpu", names),
    )
    assert plan_to_dict(trained)["modules"] == r["plan"]["modules"]


def test_cpu_plan_refuses_a_table_cpu_training_cannot_shard(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text('[{"name": "x", "rows": 1000, "dim": 64, "sharding_types": ["column_wise"]}]')
    assert run_plan("--tables", str(path), "--topology", "cpu-2") == 2
    assert "table 'x': sharding_types ['column_wise'] include none that CPU training runs" in capsys.readouterr().err
    # a TPU slice plans it as asked
    r = _report(capsys, "--tables", str(path), "--topology", "v6e-4")
    assert r["tables"][0]["sharding_type"] == "column_wise"


def test_help_says_where_the_defaults_come_from(capsys):
    with pytest.raises(SystemExit):
        run_plan("-h")
    out = " ".join(capsys.readouterr().out.split())
    assert "batch size per device (default: --model: its training config's;" in out
    assert "(default: --model: its training config's;" in out
    assert "apply_optimizer_in_backward, else what `tpurec train --model-module` fuses" in out
