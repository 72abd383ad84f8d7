"""`tpurec train` end to end, as a user runs it (subprocesses, or this process where a run needs no process of
its own; real data files, real numbers)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from .helpers import REPO, checkpoint_tensors, train, train_here


def _png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


@pytest.mark.slow  # over 35 s: `make test-all` (the default suite's 20 minutes)
def test_no_argument_run_reaches_oracle_auc(cache, tmp_path):
    """The default run itself (dlrm-tiny, 1.5M synthetic rows generated into the cache, one epoch)."""
    metrics = tmp_path / "run" / "metrics.jsonl"
    # Its duration (about a minute on 2 idle cores) is a benchmark figure (docs/dlrm.md), not asserted
    # here: a timed unit test fails on a loaded host for no fault of the code.
    result, p = train("--metrics-out", metrics, cache=cache)
    assert "generating synthetic dlrm-tiny data" in p.stderr and str(cache) in p.stderr
    assert {"steps", "auc", "ne", "logloss", "samples_per_s", "oracle_auc"} <= set(result)
    assert result["oracle_auc"] - result["auc"] <= 0.02, result
    assert 0 < result["ne"] < 1
    assert p.stdout.strip().count("\n") == 0, "stdout must hold only the JSON line"
    assert "tpurec plan: dlrm-tiny on cpu-1" in p.stderr and "tables: 26: 26 table_wise" in p.stderr  # plan summary
    assert "Successfully loaded" not in p.stderr and "FutureWarning" not in p.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"][-1] == result["steps"]
    assert metrics.with_suffix(".png").stat().st_size > 10_000


# default suite time: 20-22 s here; bit-equal resumes stay: tests/storage/test_bucket_checkpoints.py
# (a local run against one resumed from a bucket) and test_user_model.py
@pytest.mark.slow
def test_exact_resume_same_world_size(cache, tmp_path):
    """Interrupted at step 70 (across an epoch boundary at ~55) and resumed: same weights and optimiser
    state, bit for bit, as the uninterrupted run."""
    common = ["--synth-rows", 30000, "--eval-every", 20, "--keep", 0]
    a, p = train("--steps", 90, "--checkpoint-dir", tmp_path / "a", *common, cache=cache)
    # no --metrics-out: the curves still come, beside the checkpoints, and the log says where
    assert f"curves: {tmp_path / 'a' / 'curves.png'}" in p.stderr
    assert _png_size(tmp_path / "a" / "curves.png") == (1000, 400)
    train("--steps", 70, "--checkpoint-dir", tmp_path / "b", *common, cache=cache)
    b, p = train("--steps", 90, "--checkpoint-dir", tmp_path / "b", "--resume", *common, cache=cache)
    assert "resume:" in p.stderr and "at step 70, exact" in p.stderr
    want = checkpoint_tensors(tmp_path / "a" / "step-00000090")
    got = checkpoint_tensors(tmp_path / "b" / "step-00000090")
    assert set(want) == set(got)
    assert any(k.startswith("optim.state.") and "embedding_bags" in k for k in want)  # fused optimiser state
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert a["auc"] == b["auc"]


@pytest.mark.slow  # over 35 s: `make test-all` (the default suite's 20 minutes)
def test_a_plan_from_tpurec_plan_trains_and_one_for_another_world_size_is_refused(cache, tmp_path):
    """`tpurec plan` keys its plan by table names (module ""); `train --plan` applies it to the
    DLRM's EmbeddingBagCollection, and refuses a plan made for 2 ranks in a 1-rank run."""

    def plan(topology):
        out = tmp_path / f"{topology}.json"
        cmd = ["plan", "--model", "dlrm-tiny", "--topology", topology, "--format", "json", "--out", out]
        p = subprocess.run(
            [sys.executable, "-m", "tpurec.cli", *map(str, cmd)], capture_output=True, text=True, cwd=REPO
        )
        assert p.returncode == 0, p.stderr
        return out

    result, _ = train("--plan", plan("cpu-1"), "--synth-rows", 30000, "--steps", 3, cache=cache)
    assert result["steps"] == 3
    _, p = train("--plan", plan("cpu-2"), "--synth-rows", 30000, "--steps", 3, cache=cache, check=False)
    assert p.returncode == 2
    assert "but the world size is 1 (a plan made for another world size" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow  # default suite time: 7-11 s here; test_architecture_flags_... below trains DCN in 3 steps
def test_dcnv2_interaction_trains(cache):
    """DLRM-DCNv2 (torchrec's DLRM_DCN, low-rank cross layers) on the dlrm-tiny tables."""
    result, _ = train("--interaction", "dcn", "--dense-lr", 0.005, "--synth-rows", 30000, "--steps", 60, cache=cache)
    assert result["steps"] == 60 and result["auc"] > 0.7, result


@pytest.mark.slow  # over 35 s: `make test-all` (the default suite's 20 minutes)
def test_saved_plan_is_reused_and_inspectable(cache, tmp_path):
    plan = tmp_path / "plan.json"
    first, _ = train("--synth-rows", 30000, "--steps", 3, "--save-plan", plan, cache=cache)
    again, _ = train("--synth-rows", 30000, "--steps", 3, "--plan", plan, cache=cache)
    assert first["auc"] == again["auc"]  # same plan, same seed: same run
    show = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "plan", "show", str(plan)], capture_output=True, text=True, cwd=REPO
    )
    assert show.returncode == 0 and "t_C1" in show.stdout


def test_tiny_dataset_caps_batch_and_keeps_eval(cache, tmp_path, capsys):
    from tpurec.cli import main

    data = tmp_path / "tiny"
    assert main(["data", "synth", "--rows", "50", "--out", str(data), "--quiet"]) == 0
    args = ("--data", data, "--steps", 5, "--metrics-out", tmp_path / "m.csv", "--log-every", 2)
    result, _, err = train_here(capsys, *args, cache=cache)
    assert "capping the batch" in err
    assert result["batch_size"] < 512 and result["eval_rows"] >= 1 and result["steps"] == 5
    assert (tmp_path / "m.csv").read_text().startswith("kind,step")
    # --log-every 2: a loss read at steps 2 and 4, and at the run's end (its default here: every step)
    lines = (tmp_path / "m.csv").read_text().splitlines()
    assert [int(x.split(",")[1]) for x in lines if x.startswith("train,")] == [2, 4, 5]
    assert (tmp_path / "m.png").exists()


def test_trains_on_converted_criteo_sample(cache, tmp_path, criteo_sample, capsys):
    data = tmp_path / "criteo"
    # raw ids + torchrec column names: the reader hashes into the model's tables, the model takes
    # the data's feature names
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tpurec.cli",
            "data",
            "convert",
            str(criteo_sample),
            "--out",
            str(data),
            "--raw-ids",
            "--names",
            "torchrec",
            "--quiet",
        ],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    result, _, _ = train_here(capsys, "--data", data, "--steps", 20, cache=cache)
    assert result["steps"] == 20 and result["eval_rows"] >= 1
    assert all(result[k] == result[k] for k in ("auc", "ne", "logloss")), result  # not NaN


# default suite time: 6-11 s here; tests/reliability/test_data_faults.py's train on a bad label (exit 2,
# the file named) and its reader's id-range cases stay
@pytest.mark.slow
def test_bad_data_names_file_and_row_group(cache, tmp_path):
    import pyarrow.parquet as pq

    data = tmp_path / "bad"
    subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "data", "synth", "--rows", "3000", "--out", str(data)],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    f = data / "part-00000.parquet"
    t = pq.read_table(f)
    c1 = t.column("C1").to_pylist()
    c1[5] = 10**6  # id out of its 1,000-row table
    import pyarrow as pa

    t = t.set_column(t.schema.get_field_index("C1"), "C1", pa.array(c1, pa.int64()))
    pq.write_table(t, f, write_statistics=False)
    _, p = train("--data", data, "--steps", 3, cache=cache, check=False)
    assert p.returncode == 2
    assert f"rank 0: {f}: row group 0: column 'C1': id 1000000 out of range" in p.stderr


# default suite time: 10-14 s here; tests/reliability/test_checkpoint_faults.py (saves cut short) and
# test_units.py's test_incomplete_checkpoints_are_never_picked stay
@pytest.mark.slow
def test_killed_run_leaves_no_checkpoint_that_looks_complete(cache, tmp_path):
    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=str(REPO))
    root = tmp_path / "ck"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpurec.cli",
            "train",
            "--quiet",
            "--synth-rows",
            "30000",
            "--steps",
            "100000",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "3",
            "--keep",
            "0",
            "--checkpoint-dir",
            str(root),
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(list(root.glob("step-*"))) < 4:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    dirs = sorted(root.glob("step-*"))
    assert len(dirs) >= 4
    for d in dirs:  # every directory without the .tmp suffix is complete
        assert d.name.endswith(".tmp") or (d / "COMPLETE").exists(), d
    # and a resume picks the newest complete one and runs
    from tpurec.dlrm.ckpt.checkpoint import latest

    newest = latest(root)
    step = int(newest.name.split("-")[1])
    result, p = train(
        "--synth-rows", 30000, "--steps", step + 2, "--eval-every", 0, "--checkpoint-dir", root, "--resume", cache=cache
    )
    assert result["steps"] == step + 2 and f"at step {step}" in p.stderr


def test_trainer_api_step_evaluate_checkpoint(cache, tmp_path):
    """The Trainer a rank runs, driven by hand (in a subprocess: it sets up torch.distributed)."""
    code = f"""
import json
from tpurec.dlrm.options import TrainOptions
from tpurec.dlrm.trainer import Trainer

t = Trainer(TrainOptions(synth_rows=30000, steps=4, quiet=True, checkpoint_dir={str(tmp_path / "ck")!r}))
t.setup()
assert t.table_set.name == t.cfg.table_set == "dlrm-tiny" and t.total_steps == 4
losses = [t.step() for _ in range(5)]
ev = t.evaluate()
path = t.checkpoint()
print(json.dumps({{"losses": losses, "steps": t.step_count, "auc": ev["auc"], "path": str(path)}}))
"""
    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["losses"][4] is None and all(0 < x < 2 for x in r["losses"][:4])  # 4 steps, then drained
    assert r["steps"] == 4 and 0 <= r["auc"] <= 1
    assert r["path"].endswith("step-00000004") and (tmp_path / "ck" / "step-00000004" / "COMPLETE").exists()


@pytest.mark.slow  # over 35 s: `make test-all` (the default suite's 20 minutes)
def test_a_damaged_checkpoint_is_detected_and_resume_falls_back_to_the_previous_one(cache, tmp_path):
    root = tmp_path / "ck"
    common = ["--synth-rows", 30000, "--eval-every", 0, "--keep", 0, "--checkpoint-dir", root]
    train("--steps", 6, "--checkpoint-every", 3, *common, cache=cache)
    newest = root / "step-00000006"
    assert (newest / "CHECKSUMS.json").exists()
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the middle of the tables' data
    shard.write_bytes(bytes(data))
    # --resume PATH of the damaged checkpoint: refused, naming the file
    _, p = train("--steps", 8, *common, "--resume", newest, cache=cache, check=False)
    assert p.returncode == 2 and f"{shard}: contents changed since it was written" in p.stderr
    # --resume (latest): the damaged one is named and skipped; training continues from step 3
    result, p = train("--steps", 8, *common, "--resume", cache=cache)
    assert "is damaged" in p.stderr and "trying the previous checkpoint" in p.stderr
    assert "at step 3" in p.stderr and result["steps"] == 8


def test_memory_guard_refuses_before_generating_any_data(tmp_path, monkeypatch):
    """criteo-kaggle's tables (~16 GiB with row-wise Adagrad) on a host said to have 8 GiB free:
    one line, exit 2, and no synthetic data written first (so it comes at once, not after minutes)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TPUREC_HOST_MEMORY_BYTES", str(8 * 2**30))  # the train helper passes os.environ on
    _, p = train("--model", "criteo-kaggle", cache=cache, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "training criteo-kaggle on CPU needs about" in p.stderr and "8.0 GiB available" in p.stderr
    assert not cache.exists() or not any(cache.rglob("*.parquet"))


def test_table_sizes_from_the_data_are_announced(tmp_path, criteo_sample):
    """Data converted with other table sizes than the model's defaults: training says so."""
    from tpurec.data.convert import ConvertOptions, convert
    from tpurec.data.schema import criteo_schema

    out = tmp_path / "data"
    # small sizes of its own (Criteo Kaggle's 33.8M rows took 36 s to allocate and initialise)
    sizes = [1000 + 7 * i for i in range(26)]
    convert([str(criteo_sample)], str(out), ConvertOptions(criteo_schema(sizes)), show_progress=False)
    _, p = train("--data", out, "--steps", 1, cache=tmp_path / "cache", check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    said = f"tables: sizes from {out}'s _dataset.json: {sum(sizes):,} rows in all (the dlrm-tiny defaults have"
    assert said in p.stderr


@pytest.mark.slow  # over 35 s: `make test-all` (the default suite's 20 minutes)
def test_resume_past_the_requested_steps_is_refused_and_at_them_only_evaluates(cache, tmp_path):
    common = ["--synth-rows", 30000, "--eval-every", 0, "--checkpoint-dir", tmp_path / "ck"]
    train("--steps", 6, *common, cache=cache)
    _, p = train("--steps", 4, *common, "--resume", cache=cache, check=False)
    assert p.returncode == 2 and "the checkpoint is at step 6, past the 4 steps asked for" in p.stderr
    result, p = train("--steps", 6, *common, "--resume", cache=cache)
    assert result["steps"] == 6 and "already at the last step (6); evaluating only" in p.stderr


def test_a_log_file_gets_progress_lines_not_bar_updates(cache, tmp_path):
    """stderr is no terminal here (as in a log file): a line per tenth of the run, no \\r."""
    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "train", "--synth-rows", "30000", "--steps", "40", "--eval-every", "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "\r" not in p.stderr
    # neither --metrics-out nor --checkpoint-dir: the curves go to the cache's runs/, named in the log
    named = [line.split("curves: ", 1)[1] for line in p.stderr.splitlines() if "curves: " in line]
    assert len(named) == 1 and named[0].startswith(str(cache / "runs" / "curves-dlrm-tiny-")), p.stderr[-1500:]
    assert _png_size(named[0]) == (1000, 400)
    progress = [line for line in p.stderr.splitlines() if line.startswith("step ") and "/40: loss" in line]
    assert 5 <= len(progress) <= 11, progress


def test_architecture_flags_with_torchrecs_names_shape_the_model(cache, tmp_path, capsys):
    # in this process (train_here): flags parsed into a model need no process of their own, and two
    # subprocesses cost two imports of torch and TorchRec (about half the test's time)
    plan = tmp_path / "plan.json"
    result, _, _ = train_here(
        capsys, "--synth-rows", 30000, "--steps", 3,
        "--embedding_dim", 8, "--dense_arch_layer_sizes", "32,8", "--over-arch", "16,1",
        "--interaction_type", "dcn", "--dcn-low-rank-dim", 4, "--embedding-optimizer", "adam", "--eps", "1e-6",
        "--save-plan", plan, cache=cache,
    )  # fmt: skip
    assert result["steps"] == 3
    meta = json.loads(plan.read_text())["meta"]
    assert {t["embedding_dim"] for t in meta["tables"]} == {8}  # every table at --embedding-dim
    assert meta["optimizer"] == "adam"
    _, code, err = train_here(
        capsys, "--synth-rows", 30000, "--steps", 3, "--embedding-dim", 8, cache=cache, check=False
    )
    assert code == 2 and "the bottom MLP must end in the embedding dim 8, got [64, 16]" in err


def test_messages_on_a_terminal_start_their_own_line(cache, tmp_path):
    """With the progress bar on a terminal, `checkpoint:` and eval lines are written through tqdm,
    which lifts the bar off the line first: each message starts a line, none is glued to the bar."""
    import fcntl
    import pty
    import struct
    import termios

    env = dict(os.environ, TPUREC_CACHE=str(cache), PYTHONPATH=str(REPO))
    leader, follower = pty.openpty()
    # a terminal of 120 columns (a new pty has 0, and tqdm draws nothing on 0 columns)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    args = ["--synth-rows", "30000", "--steps", "30", "--eval-every", "10", "--checkpoint-dir", str(tmp_path / "ck")]
    p = subprocess.Popen(
        [sys.executable, "-m", "tpurec.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=follower,
        env=env,
        cwd=REPO,
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(timeout=600) == 0, out[-2000:]
    os.close(leader)
    text = out.decode(errors="replace")
    assert re.search(r"\d+/30 \[", text), text[-1000:]  # the bar was drawn ("12/30 [00:01<...")
    starts = [m.start() for m in re.finditer(r"checkpoint: ", text)]
    assert len(starts) == 3, text[-2000:]  # steps 10, 20, 30
    glued = [text[max(0, i - 40) : i + 30] for i in starts if text[i - 1] not in "\r\n"]
    assert glued == []


@pytest.mark.slow  # session 28: make test-all (the default suite's 20 minutes)
def test_multi_hot_sizes_flag_shapes_the_synthetic_data(cache, tmp_path):
    """TorchRec's --multi_hot_sizes: the synthetic data gets that many ids per sample per feature (its
    own cache directory), the model trains on the list columns, and the planner is told the pooling."""
    import pyarrow.parquet as pq

    hots = [3, 1, 2] + [1] * 23
    sizes = ",".join(map(str, hots))
    result, p = train("--multi_hot_sizes", sizes, "--synth-rows", 20000, "--steps", 5, cache=cache)
    assert result["steps"] == 5
    data = cache / f"synth-dlrm-tiny-20000-0-mh{'_'.join(map(str, hots))}"
    assert f"multi-hot {sizes}" in p.stderr and str(data) in p.stderr
    meta = json.loads((data / "_dataset.json").read_text())
    assert meta["multi_hot_sizes"] == hots and [f["multi_hot"] for f in meta["sparse"][:3]] == [True, False, True]
    c1 = pq.read_table(data, columns=["C1"]).column("C1").to_pylist()
    assert {len(ids) for ids in c1} == {3}
    _, p = train("--multi-hot-sizes", "2,2", "--steps", 1, cache=cache, check=False)
    assert p.returncode == 2 and "--multi-hot-sizes needs 26 sizes >= 1 (one per table), got [2, 2]" in p.stderr
    _, p = train("--multi-hot-sizes", sizes, "--data", data, cache=cache, check=False)
    assert p.returncode == 2 and "--multi-hot-sizes shapes the synthetic data" in p.stderr
