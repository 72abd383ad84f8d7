"""tpurec.data.catalog: the named table sets and model names, plain data every layer and CLI shares."""

import subprocess
import sys

import pytest

from tpurec.data.catalog import FEATURE_NAMES, MODEL_NAMES, NUM_SPARSE, TABLE_SETS, get_table_set


def test_catalog_imports_no_torch():
    code = "import sys, tpurec.data.catalog; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_model_names_are_the_table_sets_and_the_dlrm_configs():
    from tpurec.dlrm.configs import CONFIGS

    assert MODEL_NAMES == ("dlrm-tiny", "criteo-kaggle", "mlperf-dcnv2") == tuple(TABLE_SETS)
    assert set(CONFIGS) == set(MODEL_NAMES)
    assert all(CONFIGS[name].table_set == name for name in MODEL_NAMES)


def test_every_cli_offers_the_catalogs_models():
    import argparse

    from tpurec.dlrm.cli import register as register_train
    from tpurec.planner.cli import register as register_plan

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register_train(sub)
    register_plan(sub)
    for command in ("train", "plan"):
        model = next(a for a in sub.choices[command]._actions if a.dest == "model")
        assert tuple(model.choices) == MODEL_NAMES, command


def test_table_sets_and_their_torchrec_configs():
    from tpurec.dlrm.model import embedding_bag_configs

    tiny = get_table_set("dlrm-tiny")
    assert [t.feature for t in tiny.tables] == FEATURE_NAMES and len(tiny.tables) == NUM_SPARSE
    configs = embedding_bag_configs(tiny)
    assert [(c.name, c.num_embeddings, c.embedding_dim, c.feature_names) for c in configs] == [
        (t.name, t.num_embeddings, t.embedding_dim, [t.feature]) for t in tiny.tables
    ]
    with pytest.raises(ValueError, match="unknown model/table set 'nope'"):
        get_table_set("nope")
