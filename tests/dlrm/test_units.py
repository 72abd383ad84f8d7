"""Fast checks of the pieces of `tpurec train`: configs, LR schedule, metrics, checkpoint discovery, CLI."""

import math

import numpy as np
import pytest

from tpurec.dlrm.ckpt import checkpoint as ckpt
from tpurec.dlrm.configs import CONFIGS, get_config, override
from tpurec.dlrm.metrics import compute


def test_named_configs():
    assert set(CONFIGS) == {"dlrm-tiny", "criteo-kaggle", "mlperf-dcnv2"}
    m = get_config("mlperf-dcnv2")
    assert (m.interaction, m.dense_arch, m.over_arch) == ("dcn", (512, 256, 128), (1024, 1024, 512, 256, 1))
    assert (m.dcn_num_layers, m.dcn_low_rank_dim) == (3, 512)
    assert (m.embedding_optimizer, m.dense_optimizer, m.embedding_lr) == ("adagrad", "adagrad", 0.005)
    assert get_config("dlrm-tiny").table_set == "dlrm-tiny"


def test_override_ignores_unset_and_validates():
    cfg = override(get_config("dlrm-tiny"), batch_size=64, steps=None)
    assert cfg.batch_size == 64 and cfg.steps is None
    with pytest.raises(ValueError, match="embedding dim 16"):
        override(get_config("dlrm-tiny"), dense_arch=(64, 32))
    with pytest.raises(ValueError, match="eval-fraction"):
        override(get_config("dlrm-tiny"), eval_fraction=1.5)
    with pytest.raises(ValueError, match="unknown model"):
        get_config("resnet")


def test_models_build_on_meta_tables():
    from tpurec.dlrm.model import build_model

    assert type(build_model(get_config("dlrm-tiny")).model).__name__ == "DLRM"
    model = build_model(
        override(get_config("dlrm-tiny"), interaction="dcn", dcn_low_rank_dim=8),
        table_sizes=[50] * 26,
        feature_names=[f"cat_{i}" for i in range(26)],
    )
    assert type(model.model).__name__ == "DLRM_DCN"
    bags = model.model.sparse_arch.embedding_bag_collection
    assert bags.embedding_bags["t_C1"].weight.device.type == "meta"
    assert bags.embedding_bags["t_C1"].weight.shape == (50, 16)
    assert bags.embedding_bag_configs()[0].feature_names == ["cat_0"]


def test_lr_schedule():
    import torch

    from tpurec.dlrm.model import LRSchedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = LRSchedule(opt, warmup_steps=4, decay_start=10, decay_steps=10)
    assert [s.factor(i) for i in (0, 3, 5, 10, 15, 20, 30)] == [0.25, 1.0, 1.0, 1.0, 0.25, 0.0, 0.0]
    s.set_step(0)
    assert opt.param_groups[0]["lr"] == 0.25
    off = LRSchedule(opt, 0, 0, 0)
    assert not off.active


def test_metrics():
    y = np.array([0, 0, 1, 1, 0, 1, 0, 0], np.float32)
    perfect = compute(np.where(y > 0, 3.0, -3.0), y)
    assert perfect["auc"] == 1.0 and perfect["accuracy"] == 1.0
    # predicting the label rate everywhere: NE is exactly 1 (the definition of NE's baseline)
    p = y.mean()
    base = compute(np.full(len(y), math.log(p / (1 - p))), y)
    assert base["auc"] == 0.5
    assert base["ne"] == pytest.approx(1.0, abs=1e-9)
    z = np.array([0.3, -1.2, 2.0, 0.1, -0.4, 1.5, -2.0, 0.0])
    q = 1 / (1 + np.exp(-z))
    want = -np.mean(y * np.log(q) + (1 - y) * np.log(1 - q))
    assert compute(z, y)["logloss"] == pytest.approx(want, rel=1e-9)


def test_incomplete_checkpoints_are_never_picked(tmp_path):
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / "step-00000010" / ckpt.MARKER).write_text("")
    (tmp_path / "step-00000020").mkdir()  # killed after the rename would be impossible; killed before: no marker
    (tmp_path / "step-00000030.tmp").mkdir()  # killed while writing
    assert ckpt.latest(tmp_path).name == "step-00000010"
    assert ckpt.resolve(tmp_path).name == "step-00000010"
    with pytest.raises(FileNotFoundError, match="interrupted"):
        ckpt.resolve(tmp_path / "step-00000030.tmp")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resolve(tmp_path / "empty")


def test_cli_user_errors_exit_2(capsys, tmp_path):
    from tpurec.cli import main

    assert main(["train", "--data", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "missing: no such directory" in err and "tpurec data convert" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:  # argparse refuses it, naming the flag (tests/test_bad_cli_inputs.py)
        main(["train", "--batch-size", "0"])
    assert e.value.code == 2 and "--batch-size: '0' must be > 0" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--checkpoint-dir" in capsys.readouterr().err
    assert main(["train", "--metrics-out", "m.txt"]) == 2
    assert main(["train", "--device", "tpu"]) == 2  # this host has no TPU
    err = capsys.readouterr().err
    # the command line's words for the dry run (issue 63 item 7: it said "use device='cpu'")
    assert "cannot run TPU kernels" in err and "or use --device cpu for a dry run" in err, err
    assert "device='cpu'" not in err, err
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "nope"])
    assert e.value.code == 2


def test_curves_png_goes_beside_metrics_else_checkpoints_else_the_cache(monkeypatch, tmp_path):
    from tpurec.dlrm.options import TrainOptions

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    both = TrainOptions(metrics_out="run/m.jsonl", checkpoint_dir="ck")
    assert both.curves_path("T") == "run/m.png"
    assert TrainOptions(checkpoint_dir="ck").curves_path("T") == "ck/curves.png"
    assert TrainOptions(model="dlrm-tiny").curves_path("T") == str(
        tmp_path / "cache" / "runs" / "curves-dlrm-tiny-T.png"
    )
    assert TrainOptions(curves_out="x.png", checkpoint_dir="ck").curves_path("T") == "x.png"
    assert TrainOptions(curves_out="none", metrics_out="m.csv").curves_path("T") is None
    assert TrainOptions(curves_out="c.jpg").check() == "--curves-out must end in .png (or be 'none')"


def test_worker_gets_the_launchers_options(monkeypatch):
    """The --nproc launcher hands its ranks the parsed options as JSON; torchrun users pass flags."""
    import argparse

    from tpurec.dlrm.__main__ import parse_options
    from tpurec.dlrm.options import OPTIONS_ENV, TrainOptions

    p = argparse.ArgumentParser()
    TrainOptions.add_arguments(p)
    argv = ["--steps", "5", "--resume", "--checkpoint-dir", "c", "--quiet", "--model", "dlrm-tiny"]
    options = TrainOptions.from_args(p.parse_args(argv))
    assert (options.steps, options.resume, options.checkpoint_dir, options.quiet) == (5, "latest", "c", True)
    monkeypatch.setenv(OPTIONS_ENV, options.to_json())
    assert parse_options([]) == options
    with pytest.raises(SystemExit):
        parse_options(["--steps", "6"])  # flags and the launcher's JSON: refused, not merged
    monkeypatch.delenv(OPTIONS_ENV)
    assert parse_options(argv) == options


def test_train_flags_come_from_the_config_fields():
    import argparse
    import dataclasses

    from tpurec.data.catalog import MODEL_NAMES
    from tpurec.dlrm.configs import DLRMConfig
    from tpurec.dlrm.flags import flag_kwargs, flagged_fields
    from tpurec.dlrm.options import TrainOptions

    option_names = [f.name for f in dataclasses.fields(TrainOptions)]
    assert {f.name for f in flagged_fields(DLRMConfig)} <= set(option_names)  # every overridable field is a flag
    p = argparse.ArgumentParser()
    TrainOptions.add_arguments(p)
    actions = {a.dest: a for a in p._actions}
    assert actions["batch_size"].help == flag_kwargs(DLRMConfig, "batch_size")["help"]
    from tpurec.argtypes import positive_float, positive_int

    assert actions["batch_size"].type is positive_int and actions["batch_size"].default is None
    assert actions["epochs"].type is positive_float and tuple(actions["interaction"].choices) == ("dot", "dcn")
    assert tuple(actions["model"].choices) == MODEL_NAMES == tuple(CONFIGS)
    assert actions["quiet"].default is False and actions["keep"].default == 2
    args = p.parse_args(["--batch-size", "64", "--embedding-lr", "0.5"])
    options = TrainOptions.from_args(args)
    assert options.config_overrides() == {"batch_size": 64, "embedding_lr": 0.5}
    cfg = options.config()
    assert (cfg.batch_size, cfg.embedding_lr, cfg.dense_lr) == (64, 0.5, get_config("dlrm-tiny").dense_lr)


def test_tables_too_big_for_this_host_are_refused_in_one_line():
    from tpurec.data.catalog import get_table_set
    from tpurec.dlrm.rank_setup import check_host_memory

    cfg = get_config("mlperf-dcnv2")  # 204 M rows x 128: about 100 GiB of weights + Adagrad state
    with pytest.raises(ValueError, match=r"training mlperf-dcnv2 on CPU needs about \d+\.\d GiB on this host"):
        check_host_memory(cfg, [t.num_embeddings for t in get_table_set("mlperf-dcnv2").tables], 1)
    tiny = get_config("dlrm-tiny")
    check_host_memory(tiny, [t.num_embeddings for t in get_table_set("dlrm-tiny").tables], 1)


def test_memory_projection_counts_tables_once_plus_a_rank_overhead(monkeypatch):
    """The projection behind the guard: 1.1 x (weights + state) of this host's share + 1 GiB per rank
    (measured: 2.30 GB of tables peaked at 3.23 GB RSS)."""
    from tpurec.dlrm import rank_setup

    cfg = get_config("dlrm-tiny")  # dim 16, row-wise Adagrad: 16 * 4 + 4 bytes per row
    sizes = [1_000_000] * 26
    tables, need = rank_setup.projected_host_bytes(cfg, sizes, world=2, local=2)
    assert tables == 26_000_000 * 68
    assert need == int(1.1 * tables) + 2 * 2**30
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(need - 1))
    with pytest.raises(ValueError, match=r"26,000,000 rows, sizes from X"):
        rank_setup.check_host_memory(cfg, sizes, 2, source=", sizes from X")
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(need))
    rank_setup.check_host_memory(cfg, sizes, 2)


def test_multi_hot_sizes_reach_the_planner_as_pooling_factors():
    from tpurec.data.catalog import get_table_set
    from tpurec.dlrm.model import planner_constraints

    cfg = override(get_config("dlrm-tiny"), multi_hot_sizes=[3, 1, 2] + [1] * 23)
    names = [t.name for t in get_table_set(cfg.table_set).tables]
    c = planner_constraints(cfg, "cpu", names)
    assert [c[n].pooling_factors for n in names[:3]] == [[3.0], [1.0], [2.0]]
    default = planner_constraints(get_config("dlrm-tiny"), "cpu", names)
    assert default[names[0]].pooling_factors == [1.0]  # dlrm-tiny's tables are one-hot
    with pytest.raises(ValueError, match="needs 26 sizes >= 1"):
        override(get_config("dlrm-tiny"), multi_hot_sizes=[1, 0] + [1] * 24)
