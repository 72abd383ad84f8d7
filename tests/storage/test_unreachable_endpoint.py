"""An unreachable gs:// endpoint is one line naming the bucket and the endpoint within seconds, exit 2
(issue #61 item 4; was: `tpurec train` silent for over 300 s while pyarrow's GCS client retried for
its default 15 minutes). Only loopback addresses: a closed port refuses the connection; a listening
socket that never accepts is an endpoint that never answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.dlrm.helpers import REPO
from tpurec.runtime import storage


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # session 28: make test-all (the default suite's 20 minutes)
def test_train_with_a_checkpoint_dir_at_a_refusing_endpoint_is_one_line(tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=endpoint, TPUREC_CACHE=str(tmp_path))
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "train", "--quiet", "--steps", "4", "--checkpoint-dir", "gs://bkt/ck"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,  # was: no end in sight
    )
    took = time.monotonic() - t0
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"tpurec train: error: --checkpoint-dir gs://bkt: cannot reach the bucket at {endpoint} "
        "(Could not connect to server); check the network or the endpoint"
    ]
    assert took < 30, took


def test_an_endpoint_that_never_answers_is_refused_at_the_probe_deadline(monkeypatch):
    """It accepts the connection (the kernel does, from the backlog) and never replies: curl alone
    would wait 120 s for each attempt."""
    monkeypatch.setattr(storage, "PROBE_S", 2.0, raising=False)  # absent before: then a hang
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        said: list[str | None] = []
        # In a thread of the test's own: were it to hang, the test fails at the deadline instead
        asking = threading.Thread(target=lambda: said.append(storage.dir_problem("gs://quiet/ck")), daemon=True)
        t0 = time.monotonic()
        asking.start()
        asking.join(30)
        took = time.monotonic() - t0
    assert said == [
        f"gs://quiet: cannot reach the bucket at {endpoint} (no answer within 2 s); check the network or the endpoint"
    ]
    assert 2 <= took < 5, took


def test_a_checkpoint_save_after_the_endpoint_went_away_is_one_line_within_seconds(tmp_path, monkeypatch):
    """The bucket answered when the run began (its filesystem made and probed), then its endpoint
    stopped answering: the next save is refused by a fresh probe in one line. Before: the save listed
    the bucket through pyarrow (retrying 120 s) and wrote through gcsfs (a 60 s bucket-type lookup,
    then 6 tries a request), minutes with no line; a resume read the same way."""
    import torch

    from tpurec.dlrm.ckpt import checkpoint

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    real_probe = storage._probe_gcs
    monkeypatch.setattr(storage, "_probe_gcs", lambda uri, bucket: None)  # it answered at the start
    storage.filesystem("gs", "went-away")
    monkeypatch.setattr(storage, "_probe_gcs", real_probe)
    monkeypatch.setattr(storage, "PROBE_RETRY_S", 0.5)  # a refused connection: retried briefly (test time)
    model = torch.nn.Linear(2, 1)
    said: list[BaseException] = []

    def save() -> None:
        try:
            checkpoint.save("gs://went-away/ck", 4, model, torch.optim.SGD(model.parameters(), lr=0.1), {}, {})
        except BaseException as e:
            said.append(e)

    saving = threading.Thread(target=save, daemon=True)  # a hang fails the test at the deadline
    t0 = time.monotonic()
    saving.start()
    saving.join(60)
    took = time.monotonic() - t0
    assert said and isinstance(said[0], checkpoint.CheckpointWriteError), (took, said)
    assert str(said[0]) == (
        f"cannot write checkpoint gs://went-away/ck/step-00000004: gs://went-away: cannot reach the bucket at "
        f"{endpoint} (Could not connect to server); check the network or the endpoint"
    )
    assert took < 60, took
