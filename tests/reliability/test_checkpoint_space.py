"""`--checkpoint-dir` on a disk without room for one checkpoint is refused before training starts
(issue #29, item 4): one line naming the directory, the bytes a checkpoint needs and the bytes free.
Before, the run trained until its first save and only then failed on the full disk."""

from __future__ import annotations

import re

from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli


def test_a_checkpoint_dir_without_room_for_one_checkpoint_is_refused_before_any_step(
    tmp_path, tiny_cache, monkeypatch, capsys
):
    from tpurec.dlrm.ckpt import space

    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    seen = {}

    def free(path):  # this disk has 100 kB free
        seen["path"] = str(path)
        return 100_000

    monkeypatch.setattr(space, "free_disk_bytes", free)
    ck = tmp_path / "ck"
    code, _, err = run_cli([*TINY_TRAIN, "--steps", 2, "--checkpoint-dir", ck], capsys)
    says = f"tpurec train: error: rank 0: --checkpoint-dir {ck}: a checkpoint of this model needs about "
    assert_refused(code, err, says, prefix="tpurec train: error")
    need = int(re.search(r"needs about ([\d,]+) bytes", err).group(1).replace(",", ""))
    assert "but only 100,000 bytes are free there" in err and seen["path"] == str(ck)
    assert not any(p.name.startswith("step-") for p in ck.iterdir())  # no step trained, nothing saved
    # the figure is a checkpoint's size: within the bytes a real one of this model takes
    monkeypatch.undo()
    monkeypatch.setenv("TPUREC_CACHE", str(tiny_cache))
    code, _, err = run_cli([*TINY_TRAIN, "--steps", 1, "--checkpoint-dir", tmp_path / "real"], capsys)
    assert code == 0, err
    written = sum(f.stat().st_size for f in (tmp_path / "real" / "step-00000001").rglob("*") if f.is_file())
    assert need <= written <= need * 1.1 + 64 * 1024, (need, written)
