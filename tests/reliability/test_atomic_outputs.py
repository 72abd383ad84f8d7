"""Full disks and failed writes (issue #43): every output file is written whole or not at all, a
failed write is one line naming its path, and `train` prints its result line even when a side output
fails (then exits 2).

Before: `--metrics-out`, `--save-plan`, `--limits-out`, the curves, `plan --out` and `data stats
--out` were written in place: a full disk left an empty or cut file and a traceback naming no path,
and for `train` the JSON result line was lost although training had finished.

The failure is injected at the rename that makes a written file the output (`os.replace` raising
ENOSPC for the test's own directory only), and at the free-space check.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli
from tpurec.errors import UserError
from tpurec.outputs import write_atomic

FULL = "could not write it (No space left on device)"


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A directory whose files cannot be completed: renaming into it fails with ENOSPC."""
    d = tmp_path / "full"
    d.mkdir()
    real = os.replace

    def replace(src, dst, *a, **k):
        if str(dst).startswith(str(d)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    return d


def test_a_failed_write_names_the_path_and_leaves_the_old_file_whole(full_disk):
    target = full_disk / "out.json"
    target.write_text("before\n")
    with pytest.raises(UserError) as e:
        write_atomic(target, "after\n" * 1000, "--out")
    assert str(e.value) == f"--out {target}: {FULL}"
    assert sorted(p.name for p in full_disk.iterdir()) == ["out.json"]  # no temporary file left
    assert target.read_text() == "before\n"


def test_a_write_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr("tpurec.outputs.free_disk_bytes", lambda p: 100)
    target = tmp_path / "m.csv"
    with pytest.raises(UserError) as e:
        write_atomic(target, b"x" * 1000, "--metrics-out")
    assert str(e.value) == f"--metrics-out {target}: 1,000 bytes to write, but only 100 free there"
    assert list(tmp_path.iterdir()) == []


def test_a_new_file_gets_the_mode_open_gives_and_a_replaced_file_keeps_its_own(tmp_path):
    target = tmp_path / "p.json"
    write_atomic(target, "{}\n")
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    target.chmod(0o600)
    write_atomic(target, "{}\n")
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_text() == "{}\n"


def test_train_prints_its_result_line_when_every_side_output_fails(full_disk, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    outs = {
        "--metrics-out": full_disk / "m.csv",
        "--save-plan": full_disk / "plan.json",
        "--limits-out": full_disk / "limits.json",
    }
    argv = [*TINY_TRAIN, "--steps", 2, *(x for kv in outs.items() for x in kv)]
    argv[argv.index("--curves-out") + 1] = full_disk / "c.png"
    outs["--curves-out"] = full_disk / "c.png"
    code, out, err = run_cli(argv, capsys)
    result = json.loads(out.strip().splitlines()[-1])  # the result line, printed all the same
    assert result["steps"] == 2 and "auc" in result
    assert code == 2 and "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("tpurec train: error")]
    for flag, path in outs.items():
        assert f"{flag} {path}: {FULL}" in line
    assert list(full_disk.iterdir()) == []  # nothing partial, no temporary file


def test_train_without_failures_writes_every_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "new" / "dir"  # the metrics' and curves' directories are made
    argv = [*TINY_TRAIN, "--steps", 2, "--metrics-out", d / "m.jsonl", "--limits-out", tmp_path / "l.json"]
    argv[argv.index("--curves-out") + 1] = d / "c.png"
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (d / "m.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows if r["kind"] != "id_demand"][-1] == "eval" and rows[0]["step"] == 1
    assert (d / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "l.json").read_text())["tables"]
    assert sorted(p.name for p in d.iterdir()) == ["c.png", "m.jsonl"]


@pytest.mark.parametrize("fmt", ["json", "png"])
def test_plan_out_on_a_full_disk_is_one_line_naming_it(full_disk, capsys, fmt):
    out = full_disk / f"p.{fmt}"
    argv = ["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--format", fmt, "--out", out]
    code, _, err = run_cli(argv, capsys)
    assert_refused(code, err, f"--out {out}: {FULL}")
    assert list(full_disk.iterdir()) == []


def test_data_stats_out_on_a_full_disk_is_one_line_naming_it(full_disk, tmp_path, capsys):
    from tpurec.data.synth import synthesize

    synthesize(300, str(tmp_path / "data"), seed=0, show_progress=False)
    out = full_disk / "l.json"
    argv = ["data", "stats", tmp_path / "data", "--model", "dlrm-tiny", "--topology", "v6e-4", "--out", out]
    code, _, err = run_cli([*argv, "--quiet"], capsys)
    assert_refused(code, err, f"tpurec data: error: --out {out}: {FULL}")
    assert list(full_disk.iterdir()) == []


@pytest.fixture
def really_full_disk(tmp_path):
    """A 64 KiB tmpfs filled up (root with mount rights only: a real ENOSPC, not a stand-in)."""
    import subprocess

    d = tmp_path / "tmpfs"
    d.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with open(d / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_train_on_a_really_full_disk_prints_its_result_and_names_each_path(
    really_full_disk, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    d = really_full_disk
    argv = [*TINY_TRAIN, "--steps", 2, "--metrics-out", d / "m.csv", "--save-plan", d / "p.json"]
    code, out, err = run_cli(argv, capsys)
    assert "auc" in json.loads(out.strip().splitlines()[-1])
    assert code == 2 and "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("tpurec train: error")]
    assert f"--metrics-out {d / 'm.csv'}: " in line and f"--save-plan {d / 'p.json'}: " in line
    assert sorted(p.name for p in d.iterdir()) == ["filler"]


def test_a_symlinked_output_replaces_the_file_it_names_and_a_pipe_is_written_through(tmp_path):
    import threading

    real = tmp_path / "real.json"
    real.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_atomic(link, "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"
    fifo = tmp_path / "fifo"  # as `--out /dev/stdout`: a rename would replace the node itself
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_atomic(fifo, "through\n")
    reader.join(10)
    assert got == ["through\n"] and fifo.is_fifo()


@pytest.mark.parametrize("ext", ["csv", "jsonl"])
def test_a_resumed_metrics_file_keeps_its_earlier_lines_as_they_were(tmp_path, ext):
    """The file is rewritten whole from the records: those read back on --resume come out unchanged
    (a CSV's whole numbers stay whole)."""
    from tpurec.dlrm.report import MetricsLog

    path = tmp_path / f"m.{ext}"
    first = MetricsLog(str(path))
    first.add({"kind": "train", "step": 1, "samples": 512, "loss": 0.5})
    first.add({"kind": "eval", "step": 2, "auc": 0.7})
    before = path.read_text()
    resumed = MetricsLog(str(path), resume_step=2)
    resumed.add({"kind": "eval", "step": 3, "auc": 0.75})
    after = path.read_text()
    assert after.startswith(before) and len(after.splitlines()) == len(before.splitlines()) + 1


@pytest.mark.parametrize("ext", ["csv", "jsonl"])
def test_a_resumed_metrics_file_drops_the_rows_after_the_checkpoint_and_the_last_run_s_end_rows(tmp_path, ext):
    """Rows logged after the checkpoint resumed from are trained again: the resumed file keeps the
    rows up to its step and drops the later ones and the earlier run's end-of-run id_demand rows."""
    from tpurec.dlrm.report import MetricsLog

    path = tmp_path / f"m.{ext}"
    first = MetricsLog(str(path))
    for step in (10, 20, 30):
        first.add({"kind": "train", "step": step, "loss": 1.0 / step})
    first.add({"kind": "eval", "step": 20, "auc": 0.7})
    first.add({"kind": "id_demand", "step": 30, "table": "t0", "max_ids": 8})
    first.flush()
    resumed = MetricsLog(str(path), resume_step=20)
    resumed.add({"kind": "train", "step": 30, "loss": 0.02})
    resumed.flush()
    again = MetricsLog(str(path), resume_step=10**9)  # read back whole
    assert [(r["kind"], r["step"]) for r in again.records] == [
        ("train", 10),
        ("train", 20),
        ("eval", 20),
        ("train", 30),
    ]
    assert again.records[-1]["loss"] == 0.02
