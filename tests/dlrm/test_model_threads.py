"""A `--model-module` model that starts a non-daemon thread and leaves it running: `tpurec train` still
ends after its result line, with one warning naming the thread (was: the process waited for the thread
for ever, as Python does before its exit; tpurec/runtime/rank_exit.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .helpers import REPO

MODEL = f"""
import importlib.util, os, threading

spec = importlib.util.spec_from_file_location("my_model", {str(REPO / "examples" / "my_model.py")!r})
my_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(my_model)


def build():
    if os.environ.get("START_MODEL_THREAD"):  # in train's process only, not in this test's
        threading.Thread(target=threading.Event().wait, name="model-poller").start()  # never ends
    return my_model.build()
"""


def test_train_ends_after_its_result_despite_a_model_thread(tmp_path):
    from tpurec.cli import main

    (tmp_path / "threaded.py").write_text(MODEL)
    target, data = f"{tmp_path / 'threaded.py'}:build", tmp_path / "data"
    assert main(["data", "synth", "--model-module", target, "--rows", "2000", "--out", str(data), "--quiet"]) == 0
    argv = ["train", "--model-module", target, "--data", str(data), "--steps", "2", "--batch-size", "256"]
    argv += ["--eval-every", "0", "--keep", "0", "--curves-out", "none", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TPUREC_CACHE=str(tmp_path / "cache"), START_MODEL_THREAD="1")
    try:
        p = subprocess.run(
            [sys.executable, "-m", "tpurec.cli", *argv], capture_output=True, text=True, env=env, timeout=240
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"train did not end after its result line: {e.stdout!r}") from None
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["steps"] == 2
    warnings = [line for line in p.stderr.splitlines() if "warning" in line and "thread" in line]
    assert warnings == [
        "tpurec train: warning: non-daemon thread 'model-poller' still running after the run (started by the "
        "model?); ending without waiting for it"
    ], p.stderr
