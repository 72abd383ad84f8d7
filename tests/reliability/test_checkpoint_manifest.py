"""A checkpoint's CHECKSUMS.json must list every file it holds (issue #29, family 1).

A manifest that is missing, malformed, or lists fewer files than the checkpoint has would switch
verification off for what it leaves out (`{}` verified nothing, so 8 flipped bytes resumed as
"exact"). Each such checkpoint is refused in one line naming the file and what is wrong; `--resume`
falls back to the previous checkpoint that verifies and says so. In-process runs on a tiny
checkpoint trained once per session (conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli
from tpurec.dlrm.ckpt import checkpoint as ckpt

STEP2, STEP4 = "step-00000002", "step-00000004"


@pytest.fixture
def root(checkpoints) -> Path:
    return checkpoints


def _flip(shard: Path, n: int = 8) -> None:
    data = bytearray(shard.read_bytes())
    for i in range(n):
        data[len(data) // 2 + i] ^= 0xFF
    shard.write_bytes(bytes(data))


def _manifest(step: Path) -> Path:
    return step / "CHECKSUMS.json"


def _edit_manifest(step: Path, edit) -> None:
    doc = json.loads(_manifest(step).read_text())
    _manifest(step).write_text(json.dumps(edit(doc)))


def _shard(step: Path) -> Path:
    return max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _empty(step):
    _manifest(step).write_text("{}")


def _deleted(step):
    _manifest(step).unlink()


def _a_list(step):
    _edit_manifest(step, lambda doc: [doc])


def _bytes_abc(step):
    _edit_manifest(step, lambda doc: {k: dict(v, bytes="abc") for k, v in doc.items()})


def _shard_left_out(step):
    _edit_manifest(step, lambda doc: {k: v for k, v in doc.items() if not k.endswith(".distcp")})


def _outside(step):
    _edit_manifest(step, lambda doc: dict(doc, **{"../step-00000002/meta.json": next(iter(doc.values()))}))


# (how the newest checkpoint's manifest is broken, what the one line says after "CKPT/CHECKSUMS.json")
MANIFESTS = [
    (_empty, " lists 0 of the checkpoint's 4 files; not listed: .metadata, __0_0.distcp, meta.json and 1 more"),
    (_deleted, " is missing, so no file of the checkpoint can be checked"),
    (_a_list, ": a JSON list, not an object of file -> {bytes, sha256}"),
    (_bytes_abc, ': entry \'.metadata\': "bytes" is "abc", not a size in bytes (an integer >= 0)'),
    (_shard_left_out, " lists 3 of the checkpoint's 4 files; not listed: __0_0.distcp"),
    (_outside, ": entry '../step-00000002/meta.json': not a file inside the checkpoint"),
]
IDS = [m.__name__.strip("_") for m, _ in MANIFESTS]


@pytest.mark.parametrize("breaks,says", MANIFESTS, ids=IDS)
def test_resume_refuses_an_unverifiable_checkpoint_and_falls_back_naming_it(root, capsys, breaks, says):
    newest = root / STEP4
    _flip(_shard(newest))  # damage the manifest would have caught
    breaks(newest)
    code, out, err = run_cli([*TINY_TRAIN, "--steps", 6, "--checkpoint-dir", root, "--resume"], capsys)
    assert code == 0, err
    refused = f"resume: checkpoint {newest} cannot be verified: {_manifest(newest)}{says}"
    assert f"{refused}; trying the previous checkpoint" in err, err
    assert f"resume: {root / STEP2} at step 2, exact" in err and "Traceback" not in err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 6


@pytest.mark.parametrize("breaks,says", MANIFESTS[:3], ids=IDS[:3])
def test_resume_path_of_an_unverifiable_checkpoint_is_refused_in_one_line(root, capsys, breaks, says):
    newest = root / STEP4
    breaks(newest)
    code, _, err = run_cli([*TINY_TRAIN, "--steps", 6, "--resume", newest], capsys)
    says = f"resume: checkpoint {newest} cannot be verified: {_manifest(newest)}{says}"
    assert_refused(code, err, says, prefix="tpurec train: error")


def test_when_no_checkpoint_verifies_resume_stops_naming_each(root, capsys):
    for step in (STEP2, STEP4):
        _deleted(root / step)
    code, _, err = run_cli([*TINY_TRAIN, "--steps", 6, "--checkpoint-dir", root, "--resume"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"error: rank 0: resume: no checkpoint in {root} is intact and verified (see above)" in err
    for step in (STEP2, STEP4):
        assert f"resume: checkpoint {root / step} cannot be verified: {_manifest(root / step)} is missing" in err


def test_a_file_added_after_the_save_is_not_verified(root):
    step = root / STEP4
    (step / "extra.distcp").write_bytes(b"\0" * 64)  # DCP would read any shard its metadata names
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"lists 4 of the checkpoint's 5 files; not listed: extra"):
        ckpt.verify(step)


def test_a_sane_edit_of_meta_json_is_refused_by_its_checksum(root, capsys):
    """meta.json steers the resume (step, epoch, position, world size): a hand edit that keeps every
    field in its range passes read_meta's checks, so only its checksum refuses it. Same length, so
    the byte count alone cannot tell."""
    step = root / STEP4
    meta = step / "meta.json"
    doc = json.loads(meta.read_text())
    assert doc["step"] == 4
    edited = meta.read_text().replace('"step": 4', '"step": 3')
    assert edited != meta.read_text() and len(edited) == len(meta.read_text())
    meta.write_text(edited)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"meta.json: contents changed since it was written"):
        ckpt.verify(step)
    code, _, err = run_cli([*TINY_TRAIN, "--steps", 6, "--checkpoint-dir", root, "--resume"], capsys)
    assert code == 0, err
    assert f"checkpoint {step} is damaged: {meta}: contents changed since it was written" in err
    assert f"resume: {root / STEP2} at step 2, exact" in err
