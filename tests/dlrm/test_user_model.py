"""`tpurec train --model-module` and `tpurec data synth --model-module`: the user's own model
(examples/my_model.py) through the built-in models' trainer (docs/your_model.md)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.reliability.inproc import assert_refused, run_cli

from .helpers import REPO, checkpoint_tensors, train

EXAMPLE = f"{REPO / 'examples' / 'my_model.py'}:build"


@pytest.fixture(scope="module")
def my_data(tmp_path_factory):
    """20,000 rows for the example's features, written by `data synth --model-module` (in this process)."""
    from tpurec.cli import main

    out = tmp_path_factory.mktemp("my-data") / "data"
    argv = ["data", "synth", "--model-module", EXAMPLE, "--rows", "20000", "--row-group-size", "4096", "--out", out]
    assert main([str(a) for a in argv]) == 0
    return out


def test_data_synth_writes_a_column_per_feature_of_the_model(my_data):
    """The example's tables (tpurec's reading of them checked against the file the synth wrote): 8
    dense columns; user_id, item_id one id in their table's rows; recent_items 4 ids (its pooling
    factor) in 10,000 rows; hour and device (one 500-row table) one id each."""
    import sys as _sys

    _sys.path.insert(0, str(REPO / "examples"))
    try:
        import my_model
    finally:
        _sys.path.remove(str(REPO / "examples"))
    meta = json.loads((my_data / "_dataset.json").read_text())
    assert meta["dense"] == [f"I{i}" for i in range(1, 9)] and meta["rows"] == 20000
    rows = {f: t.num_embeddings for t in my_model.TABLES for f in t.feature_names}
    assert meta["table_sizes"] == rows
    assert rows == {"user_id": 20000, "item_id": 10000, "recent_items": 10000, "hour": 500, "device": 500}
    table = pq.read_table(my_data / "part-00000.parquet")
    assert table.num_rows == 20000
    lengths = {len(v) for v in table.column("recent_items").to_pylist()[:1000]}
    assert lengths == {4}
    for name, n in rows.items():
        col = table.column(name).combine_chunks()
        values = col.flatten() if name == "recent_items" else col
        assert 0 <= min(values.to_pylist()) and max(values.to_pylist()) < n, name
    assert 0.55 < meta["oracle_auc"] < 0.95  # the hidden logistic model's signal


def _train_here(capsys, *args) -> tuple[dict, str]:
    """`tpurec train ARGS` in this process (torch is imported once for the module's runs)."""
    code, out, err = run_cli(["train", "--quiet", *args], capsys)
    assert code == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_train_my_model_learns_and_resumes_to_the_uninterrupted_runs_numbers(my_data, tmp_path, capsys, monkeypatch):
    """60 steps of batch 256 on 1 CPU rank: the loss falls and the eval AUC is above chance; stopped
    at step 30 and resumed, the run ends with the same tables, optimizer state and figures."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    common = ["--model-module", EXAMPLE, "--data", my_data, "--batch-size", 256, "--eval-every", 30, "--keep", 0]
    metrics = tmp_path / "a.csv"
    a, err = _train_here(capsys, *common, "--steps", 60, "--checkpoint-dir", tmp_path / "a", "--metrics-out", metrics)
    assert a["model"] == EXAMPLE and a["steps"] == 60 and a["world_size"] == 1
    assert f"tpurec plan: {EXAMPLE} on cpu-1" in err and "tables: 4:" in err
    losses = [float(r["loss"]) for r in csv.DictReader(metrics.open()) if r["kind"] == "train"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.05, (first, last)  # measured: 0.61 -> 0.51
    assert a["auc"] > 0.6, a  # measured 0.665 on 1,001 eval rows (the data's best, oracle_auc, 0.709)
    assert a["ne"] < 0.97, a  # measured 0.949: below 1, the log loss of always predicting the label rate
    _train_here(capsys, *common, "--steps", 30, "--checkpoint-dir", tmp_path / "b")
    b, err = _train_here(capsys, *common, "--steps", 60, "--checkpoint-dir", tmp_path / "b", "--resume")
    assert "at step 30, exact" in err
    want = checkpoint_tensors(tmp_path / "a" / "step-00000060")
    got = checkpoint_tensors(tmp_path / "b" / "step-00000060")
    assert set(want) == set(got) and any("t_history" in k for k in want)
    assert [k for k in want if not (want[k] == got[k]).all()] == []
    assert (a["auc"], a["logloss"]) == (b["auc"], b["logloss"])


def _every_step(capsys, target: str, data, tmp_path) -> tuple[dict, dict, dict]:
    """Limits measured by `data stats --model-module` (cpu-1, batch 256), then 20 steps of each
    --step with them: (result lines, per-step train losses, stderr) by step."""
    from tpurec.cli import main

    limits = str(tmp_path / "limits.json")
    stats = ["data", "stats", str(data), "--model-module", target, "--topology", "cpu-1", "--batch-size", "256"]
    assert main([*stats, "--out", limits, "--quiet"]) == 0
    capsys.readouterr()
    common = ["--model-module", target, "--data", data, "--batch-size", 256, "--steps", 20, "--eval-every", 20]
    runs, losses, errs = {}, {}, {}
    for step in ("eager", "compiled", "pipelined"):
        metrics = tmp_path / f"{step}.csv"
        flags = ("--step", step, "--limits", limits, "--keep", 0, "--metrics-out", metrics)
        runs[step], errs[step] = _train_here(capsys, *common, *flags)
        losses[step] = [float(r["loss"]) for r in csv.DictReader(metrics.open()) if r["kind"] == "train"]
    assert runs["compiled"]["eager_steps"] == runs["pipelined"]["eager_steps"] == 0  # every batch in the graph
    assert len(losses["eager"]) == 20 and losses["compiled"] == losses["eager"]  # every step's, bit for bit
    assert (runs["compiled"]["auc"], runs["compiled"]["logloss"]) == (runs["eager"]["auc"], runs["eager"]["logloss"])
    return runs, losses, errs


def test_my_model_trains_with_the_compiled_and_pipelined_steps(my_data, tmp_path, capsys, monkeypatch):
    """--step compiled with limits measured by `data stats --model-module`: one graph, every step's loss
    and the eval figures bit-equal to the eager step's (a MEAN table and a table two features share
    among the model's); --step pipelined, compiled too, within its one step of table staleness."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    runs, losses, errs = _every_step(capsys, EXAMPLE, my_data, tmp_path)
    for step in ("compiled", "pipelined"):
        assert f"--step {step}: the steady step runs under torch.compile" in errs[step]
    assert losses["pipelined"][0] == losses["eager"][0] and losses["pipelined"] != losses["eager"]  # stale from then on
    assert abs(runs["pipelined"]["logloss"] - runs["eager"]["logloss"]) < 5e-3  # measured: 0.5024 against 0.5047


def _example_data(example: str, tmp_path) -> tuple[str, str]:
    """examples/EXAMPLE's `--model-module` target and 8,000 rows `data synth` wrote for it (tmp_path/data)."""
    from tpurec.cli import main

    target, data = f"{REPO / 'examples' / example}:build", str(tmp_path / "data")
    synth = ["data", "synth", "--model-module", target, "--rows", "8000", "--row-group-size", "2048"]
    assert main([*synth, "--out", data]) == 0
    return target, data


@pytest.mark.slow  # (tests/sharding/test_several_ebcs_step.py covers two EBCs in the default suite)
def test_a_model_of_two_ebcs_trains_with_every_step(tmp_path, capsys, monkeypatch):
    """examples/two_ebcs.py (two EBCs handed one KJT): data synth, data stats and 20 steps of
    each --step from its --model-module; the compiled step's losses and eval figures are the eager
    step's bit for bit, the pipelined step's within its staleness."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    target, data = _example_data("two_ebcs.py", tmp_path)
    runs, _, _ = _every_step(capsys, target, data, tmp_path)
    assert abs(runs["pipelined"]["logloss"] - runs["eager"]["logloss"]) < 5e-3


def test_a_model_with_an_embedding_collection_trains_with_every_step(tmp_path, capsys, monkeypatch):
    """examples/history_ranker.py (an EmbeddingCollection of 8 recent items per user, gathered by the
    offsets, beside an EBC): under --step compiled the EC is on its fixed-shape output path (zero rows
    past each feature's ids), under --step eager on TorchRec's; with the limits `data stats` measured no
    training batch leaves the graph (the sequence kernel's limits follow its capacity), every loss and
    the eval figures agree bit for bit, and the pipelined step is within its staleness."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    target, data = _example_data("history_ranker.py", tmp_path)
    runs, losses, errs = _every_step(capsys, target, data, tmp_path)
    assert "--step compiled: the steady step runs under torch.compile" in errs["compiled"]
    assert losses["pipelined"][0] == losses["eager"][0] and losses["pipelined"] != losses["eager"]
    assert abs(runs["pipelined"]["logloss"] - runs["eager"]["logloss"]) < 5e-3  # measured: 0.51553 against 0.51560


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("nope:fn", "--model-module 'nope:fn': no module 'nope'"),
        ("examples/my_model.py", "expected MODULE:FUNCTION"),
        ("examples/my_model.py:nothing", "examples/my_model.py has no function 'nothing'"),
    ],
)
def test_a_bad_target_is_one_line_before_torch(target, says, my_data, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, _, err = run_cli(["train", "--model-module", target, "--data", my_data], capsys)
    assert_refused(code, err, says)


def test_model_module_needs_data_and_refuses_the_built_in_models_flags(capsys, my_data, monkeypatch):
    monkeypatch.chdir(REPO)
    code, _, err = run_cli(["train", "--model-module", EXAMPLE], capsys)
    says = "--model-module trains on --data DIR; make one for the model's features with `tpurec data synth --model-"
    says += f"module {EXAMPLE} --out DIR`"
    assert_refused(code, err, says)
    code, _, err = run_cli(["train", "--model-module", EXAMPLE, "--data", my_data, "--dense-arch", "8,16"], capsys)
    assert_refused(code, err, "--dense-arch shapes the built-in DLRM; --model-module builds its own model")


WRONG = """
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

def just_tables():  # the embeddings alone: no dense part, no logits
    config = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=20_000, feature_names=["user_id"])
    return EmbeddingBagCollection(tables=[config], device=torch.device("meta"))

def a_string():
    return "model"

class Logits(torch.nn.Module):
    def __init__(self, feature="user_id", logits=1, returns=None):
        super().__init__()
        config = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=20_000, feature_names=[feature])
        self.ebc = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))
        self.top = torch.nn.Linear(8 + 8, logits)
        self.returns = returns

    def forward(self, dense_features, sparse_features):
        out = self.top(torch.cat([dense_features, self.ebc(sparse_features).values()], dim=1))
        if self.returns == "raise":
            raise RuntimeError("my forward broke\\nits second line")  # line 23 of wrong.py
        return "logits" if self.returns == "str" else out

def two_logits():
    return Logits(logits=2)

def other_columns():
    return Logits(feature="clicks")

def forward_raises():
    return Logits(returns="raise")

def forward_returns_a_string():
    return Logits(returns="str")

class OneArgument(Logits):  # forward(batch): trained as it is, so it must return DLRMTrain's tuple
    def __init__(self, as_tensor=False):
        super().__init__()
        self.as_tensor = as_tensor

    def forward(self, batch):
        if self.as_tensor:  # takes the argument for the dense tensor
            return self.top(torch.cat([batch, batch], dim=1))  # line 45 of wrong.py
        return self.top(torch.cat([batch.dense_features, self.ebc(batch.sparse_features).values()], dim=1))

def batch_returns_logits():
    return OneArgument()

def batch_as_a_tensor():
    return OneArgument(as_tensor=True)

class AsDLRMTrain(OneArgument):
    def forward(self, batch):
        logits = super().forward(batch).reshape(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())

def batch_as_dlrm_train():
    return AsDLRMTrain()
"""


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        ("a_string", "a_string() returned str, not an nn.Module"),
        ("just_tables", "EmbeddingBagCollection.forward takes neither (dense_features, sparse_features) nor (batch)"),
        ("two_logits", "the model returned logits of shape [256, 2] for a batch of 256; expected [256] or [256, 1]"),
        # #61 item 6: these two were tracebacks through TorchRec's pipeline (its torch.fx trace of the forward)
        ("forward_raises", "Logits.forward raised RuntimeError: my forward broke at {wrong.py}:23"),
        ("forward_returns_a_string", "Logits.forward returned str, not a tensor of logits ([B] or [B, 1]"),
        # #61 item 6: forward(batch) returning logits, or reading its argument as a tensor, were
        # `ValueError: too many values to unpack` / a TypeError traceback from the first step
        (
            "batch_returns_logits",
            "OneArgument.forward(batch) returned Tensor, not (loss, (loss, logits, labels)): train calls a forward "
            "of one argument with the batch (a torchrec Batch: dense_features, sparse_features, labels) and trains "
            "it on its own loss, as DLRMTrain; a model returning logits takes (dense_features, sparse_features)",
        ),
        (
            "batch_as_a_tensor",
            "OneArgument.forward(batch) raised TypeError: expected Tensor as element 0 in argument 0, but got Batch "
            "at {wrong.py}:45 (train calls a forward of one argument with the batch (a torchrec Batch: "
            "dense_features, sparse_features, labels)",
        ),
    ],
)
def test_a_model_that_cannot_train_is_one_line(fn, says, my_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "wrong.py").write_text(WRONG)
    target = f"{tmp_path / 'wrong.py'}:{fn}"
    args = ["train", "--quiet", "--model-module", target, "--data", my_data, "--batch-size", 256, "--steps", 2]
    code, _, err = run_cli(args, capsys)
    says = says.replace("{wrong.py}", str(tmp_path / "wrong.py"))
    assert_refused(code, err, f"--model-module {target!r}: {says}", prefix="tpurec train: error")
    assert "its second line" not in err


def test_a_forward_of_the_batch_returning_dlrm_trains_tuple_trains_and_resumes(my_data, tmp_path, capsys, monkeypatch):
    """The checked forward(batch) (tpurec.dlrm.user_model._checked_batch_forward) leaves a model that
    returns (loss, (loss, logits, labels)) to train, checkpoint (no key of its own) and resume."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "wrong.py").write_text(WRONG)
    target = f"{tmp_path / 'wrong.py'}:batch_as_dlrm_train"
    args = ["train", "--quiet", "--model-module", target, "--data", my_data, "--batch-size", 256, "--keep", 0]
    code, out, err = run_cli([*args, "--steps", 2, "--checkpoint-dir", tmp_path / "ck"], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    code, out, err = run_cli([*args, "--steps", 3, "--resume", tmp_path / "ck" / "step-00000002"], capsys)
    assert code == 0 and "at step 2" in err, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 3


def test_data_without_the_models_columns_is_one_line_naming_them(my_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "wrong.py").write_text(WRONG)
    target = f"{tmp_path / 'wrong.py'}:other_columns"
    code, _, err = run_cli(["train", "--quiet", "--model-module", target, "--data", my_data, "--steps", 2], capsys)
    assert_refused(code, err, f"{my_data}: no column for feature(s) clicks of --model-module {target}")
    assert "the data's sparse columns: user_id, item_id, recent_items, hour, device" in err


def _plan(tmp_path) -> str:
    out = tmp_path / "P.json"
    cmd = ["plan", "--model-module", EXAMPLE, "--topology", "v5p-16", "--batch-size", "64", "--format", "json"]
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", *cmd, "--out", str(out)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr
    return str(out)


@pytest.mark.slow  # 8 ranks twice
@pytest.mark.multiprocess
def test_my_model_on_an_emulated_v5p_16_gives_the_cpu_ranks_numbers(my_data, tmp_path, monkeypatch):
    """The example under `--emulate-tpu v5p-16` (8 ranks on 2 emulated hosts, the TPU code path) and on
    8 CPU gloo ranks, one plan (`tpurec plan --model-module`), one seed: the same losses and AUC."""
    monkeypatch.setenv("TPUREC_NO_DIRECT", "1")  # the CPU ranks on the SparseCore layout path, as the emulated TPU
    args = ("--model-module", EXAMPLE, "--data", my_data, "--plan", _plan(tmp_path), "--batch-size", 64)
    args += ("--steps", 12, "--eval-every", 6, "--seed", 3)
    e_csv, c_csv = tmp_path / "e.csv", tmp_path / "c.csv"
    emulated, _ = train("--emulate-tpu", "v5p-16", *args, "--metrics-out", e_csv, cache=tmp_path, timeout=1200)
    cpu, _ = train("--nproc", 8, *args, "--metrics-out", c_csv, cache=tmp_path, timeout=1200)
    assert emulated["world_size"] == cpu["world_size"] == 8 and emulated["hosts"] == 2
    assert emulated["emulated_tpu"] == "v5p-16" and emulated["recompiles_after_warmup"] == 0
    assert emulated["device_to_host_copies_per_step"] == 1.0  # the loss
    losses = [[float(r["loss"]) for r in csv.DictReader(f.open()) if r["kind"] == "train"] for f in (e_csv, c_csv)]
    assert len(losses[0]) == 12
    assert max(abs(x - y) for x, y in zip(*losses)) <= 1e-5, losses
    assert abs(emulated["logloss"] - cpu["logloss"]) <= 1e-5 and abs(emulated["auc"] - cpu["auc"]) <= 1e-5


def test_a_model_with_position_weights_trains_eagerly_and_compiled(tmp_path, capsys, monkeypatch):
    """examples/position_weighted.py (a FeatureProcessedEmbeddingBagCollection of trainable position
    weights beside an EBC): the default eager step (whose input pipeline used to build the weighted
    lookup's inputs ahead from ids without their weights, and stopped) and --step compiled (the weights
    trained in its graph, no batch out of it) give the same losses bit for bit; --step pipelined refuses
    the model in one line."""
    from tpurec.cli import main

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    target, data = _example_data("position_weighted.py", tmp_path)
    limits = str(tmp_path / "limits.json")
    stats = ["data", "stats", data, "--model-module", target, "--topology", "cpu-1", "--batch-size", "256"]
    assert main([*stats, "--out", limits, "--quiet"]) == 0
    common = ["--model-module", target, "--data", data, "--batch-size", 256, "--steps", 12, "--eval-every", 12]
    common += ["--limits", limits, "--keep", 0]
    runs, losses = {}, {}
    for step in ("eager", "compiled"):
        metrics = tmp_path / f"{step}.csv"
        runs[step], _ = _train_here(capsys, *common, "--step", step, "--metrics-out", metrics)
        losses[step] = [float(r["loss"]) for r in csv.DictReader(metrics.open()) if r["kind"] == "train"]
    assert len(losses["eager"]) == 12 and losses["compiled"] == losses["eager"] and runs["compiled"]["eager_steps"] == 0
    assert (runs["compiled"]["auc"], runs["compiled"]["logloss"]) == (runs["eager"]["auc"], runs["eager"]["logloss"])
    code, _, err = run_cli(["train", "--quiet", *map(str, common), "--step", "pipelined"], capsys)
    last = err.strip().splitlines()[-1]  # after the plan's lines: the one line of the refusal
    assert code == 2 and last.startswith("tpurec train: error: rank 0: PipelinedStep steps sharded")
    assert "model.history (ShardedSparseCoreFPEBC)" in last


@pytest.mark.slow  # two runs of 4 emulated ranks: 40 s here
def test_an_ec_model_steps_in_one_graph_on_an_emulated_v5p_8(tmp_path):
    """examples/history_ranker.py under `--emulate-tpu v5p-8` (the EC on its fixed-shape path, lengths and
    offsets on the device beside its values, the forward's mask built there), limits from `data stats
    --topology v5p-8`: --step compiled is one graph without breaks, no batch out of it, no recompile after
    warm-up, one device->host copy per step, and the eval figures of --step eager; losses within 1e-6."""
    from tpurec.cli import main

    target, data = _example_data("history_ranker.py", tmp_path)
    limits = tmp_path / "limits.json"
    stats = ["data", "stats", str(data), "--model-module", target, "--topology", "v5p-8", "--batch-size", "64"]
    assert main([*stats, "--out", str(limits), "--quiet"]) == 0
    args = ("--model-module", target, "--data", data, "--batch-size", 64, "--steps", 12, "--eval-every", 12)
    args += ("--emulate-tpu", "v5p-8", "--limits", limits, "--keep", 0)
    runs, losses = {}, {}
    for step in ("eager", "compiled"):
        metrics = tmp_path / f"{step}.csv"
        runs[step], _ = train(*args, "--step", step, "--metrics-out", metrics, cache=tmp_path, timeout=1200)
        losses[step] = [float(r["loss"]) for r in csv.DictReader(metrics.open()) if r["kind"] == "train"]
    compiled = runs["compiled"]
    assert (compiled["graphs_compiled"], compiled["graph_breaks"], compiled["eager_steps"]) == (1, 0, 0)
    assert compiled["recompiles_after_warmup"] == 0 and compiled["device_to_host_copies_per_step"] == 1.0
    assert (compiled["auc"], compiled["logloss"]) == (runs["eager"]["auc"], runs["eager"]["logloss"])
    assert len(losses["eager"]) == 12
    assert max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"])) < 1e-6  # measured 6e-8


def test_my_model_trains_on_parquet_tpurec_did_not_write(tmp_path, capsys, monkeypatch):
    """A pandas DataFrame with the user's own column names: the mapping inferred (8 float dense, the
    int, int-list and string columns sparse, each feature read from the column of its name), or given;
    a mapping without one of the model's features is one line naming it."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    n = 3000
    df = pd.DataFrame({"clicked": rng.integers(0, 2, n)})
    for i in range(8):
        df[f"f_{i}"] = rng.random(n)
    df["user_id"] = rng.integers(0, 10**9, n)  # raw ids: hashed into the model's tables at read time
    df["item_id"] = rng.integers(0, 10**9, n)
    df["recent_items"] = [list(rng.integers(0, 10**6, 4)) for _ in range(n)]
    df["hour"] = rng.integers(0, 24, n)
    df["device"] = rng.choice(["ios", "android", "web"], n)
    df.to_parquet(tmp_path / "events.parquet")
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    common = ["--model-module", EXAMPLE, "--data", tmp_path / "events.parquet", "--steps", 3, "--batch-size", 128]
    result, err = _train_here(capsys, *common, "--curves-out", "none")
    assert result["steps"] == 3 and 0.0 < result["logloss"] < 1.0
    assert "label 'clicked', 8 dense, 5 sparse (3 int, 1 int list, 1 string); inferred" in err
    code, _, err = run_cli(["train", "--quiet", *common, "--label", "clicked", "--sparse", "user_id,hour"], capsys)
    assert_refused(
        code, err, "no column for feature(s) item_id, recent_items, device of --model-module", prefix="tpurec train"
    )


def test_tables_this_host_cannot_hold_are_refused_before_the_data_is_read(my_data, tmp_path, capsys, monkeypatch):
    """The example's tables (40,500 rows of dim 16 and 8, row-wise Adagrad: 2 MiB) and a rank's ~1 GiB
    against a host said to have 1 GiB."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(2**30))
    code, _, err = run_cli(["train", "--quiet", "--model-module", EXAMPLE, "--data", my_data, "--steps", 2], capsys)
    says = f"training {EXAMPLE} on CPU needs about 1.0 GiB on this host (0.0 GiB of tables and optimizer state for "
    assert_refused(code, err, says + "40,500 rows, plus ~1 GiB per rank), which has 1.0 GiB available; give its tables")


def test_plan_and_train_give_my_model_one_table_optimizer(my_data, tmp_path, capsys, monkeypatch):
    """A model that sets no optimizer: `tpurec plan` plans it with what `tpurec train` fuses (dlrm-tiny's
    row-wise Adagrad: 158.38 KiB of state for its 40,500 rows), and says where it comes from (#63 item 4;
    plan said SGD, 0 B of state)."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    plan = ["plan", "--model-module", EXAMPLE, "--topology", "cpu-1", "--batch-size", 256]
    code, plan_text, err = run_cli(plan, capsys)
    assert code == 0, err
    header = plan_text.splitlines()[0]
    source = "the model sets none: tpurec train's default, --model dlrm-tiny's --embedding-optimizer"
    assert header.endswith(f"optimizer rowwise_adagrad ({source})")
    _, err = _train_here(capsys, "--model-module", EXAMPLE, "--data", my_data, "--steps", 1, "--batch-size", 256)
    assert "batch 256/device, optimizer rowwise_adagrad" in err

    def optim(text: str) -> str:  # the devices table's optimizer-state column
        heading = next(line for line in text.splitlines() if line.startswith("devs "))
        row = text.splitlines()[text.splitlines().index(heading) + 1]
        cells = re.split(r"\s{2,}|(?<=B)\s", row.strip())
        return cells[heading.split().index("optim")]

    assert optim(plan_text) == optim(err) == "158.38 KiB"
