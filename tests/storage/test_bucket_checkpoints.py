"""`tpurec train --data s3://... --checkpoint-dir s3://...` against a real S3 server (moto): trained,
stopped, resumed from the bucket, with the numbers and tensors of the same run on local files."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dlrm.helpers import checkpoint_tensors
from tests.reliability.inproc import assert_refused, run_cli

RUN = ["train", "--quiet", "--eval-every", 0, "--curves-out", "none", "--keep", 0, "--checkpoint-every", 4]
SYNTH = ["data", "synth", "--quiet", "--rows", 3000, "--rows-per-file", 2000, "--row-group-size", 500, "--seed", 11]


def _train(capsys, *args) -> dict:
    code, out, err = run_cli([*RUN, *args], capsys)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _download(uri: str, to) -> None:
    from pyarrow import fs as pafs

    from tpurec.runtime import storage

    fs, key = storage.arrow(uri)
    to.mkdir()
    pafs.copy_files(key, str(to), source_filesystem=fs)


def test_train_stop_and_resume_in_a_bucket_gives_the_local_numbers(s3_bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    data, ckpt = f"{s3_bucket}/data", f"{s3_bucket}/ckpt"
    assert run_cli([*SYNTH, "--out", data], capsys)[0] == 0
    assert run_cli([*SYNTH, "--out", tmp_path / "data"], capsys)[0] == 0

    local = _train(capsys, "--data", tmp_path / "data", "--steps", 8, "--checkpoint-dir", tmp_path / "ckpt")
    _train(capsys, "--data", data, "--steps", 4, "--checkpoint-dir", ckpt)  # stopped after step 4
    from tpurec.runtime import storage

    assert sorted(p.name for p in storage.path(ckpt).iterdir()) == ["step-00000004"]
    code, out, err = run_cli([*RUN, "--data", data, "--steps", 8, "--checkpoint-dir", ckpt, "--resume"], capsys)
    assert code == 0, err
    assert "at step 4, exact" in err
    resumed = json.loads(out.strip().splitlines()[-1])
    for k in ("steps", "auc", "ne", "logloss"):
        assert resumed[k] == local[k], (k, resumed[k], local[k])

    # the checkpoint in the bucket holds the local run's tensors, bit for bit
    _download(f"{ckpt}/step-00000008", tmp_path / "from-bucket")
    want = checkpoint_tensors(tmp_path / "ckpt" / "step-00000008")
    got = checkpoint_tensors(tmp_path / "from-bucket")
    assert set(want) == set(got) and len(want) > 10
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    names = sorted(p.name for p in storage.path(f"{ckpt}/step-00000008").iterdir())
    assert {"COMPLETE", "CHECKSUMS.json", "meta.json", "rank-0.json", ".metadata"} <= set(names)


def test_a_damaged_object_in_the_bucket_is_found_before_resuming(s3_bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    ckpt = f"{s3_bucket}/ckpt"
    _train(capsys, "--synth-rows", 3000, "--steps", 4, "--checkpoint-dir", ckpt)
    from tpurec.runtime import storage

    meta = storage.path(f"{ckpt}/step-00000004/rank-0.json")
    meta.write_text(meta.read_text().replace('"step": 4', '"step": 3'))
    code, _, err = run_cli([*RUN, "--synth-rows", 3000, "--steps", 8, "--checkpoint-dir", ckpt, "--resume"], capsys)
    assert f"{ckpt}/step-00000004/rank-0.json: contents changed since it was written" in err
    assert_refused(code, err, f"no checkpoint in {ckpt} is intact", prefix="tpurec train")


def test_checkpoint_dir_in_a_missing_bucket_is_refused_before_training(s3_env, capsys):
    code, _, err = run_cli(
        [*RUN, "--synth-rows", 3000, "--steps", 4, "--checkpoint-dir", "s3://tpurec-nope/ck"], capsys
    )
    assert_refused(code, err, "--checkpoint-dir s3://tpurec-nope/ck: bucket 'tpurec-nope' does not exist")


@pytest.mark.slow  # the emulator lacks GCS's moveTo, which gcsfs retries for ~30 s at every DCP save
def test_gs_checkpoints_through_the_emulator_resume_with_the_local_numbers(gcs_bucket, tmp_path, monkeypatch):
    """gs://: DCP through gcsfs, the other files through pyarrow's GcsFileSystem, at the emulator."""
    from tests.dlrm.helpers import train

    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # no metadata server lookup off this machine
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    common = ["--synth-rows", 3000, "--eval-every", 0, "--curves-out", "none", "--keep", 0, "--checkpoint-every", 4]
    ckpt, cache = f"{gcs_bucket}/ckpt", tmp_path / "cache"
    local, _ = train(*common, "--steps", 8, "--checkpoint-dir", tmp_path / "ckpt", cache=cache)
    train(*common, "--steps", 4, "--checkpoint-dir", ckpt, cache=cache)
    resumed, p = train(*common, "--steps", 8, "--checkpoint-dir", ckpt, "--resume", cache=cache)
    assert "at step 4, exact" in p.stderr, p.stderr
    assert (resumed["auc"], resumed["logloss"]) == (local["auc"], local["logloss"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_resume_from_a_bucket_exactly(s3_bucket, tmp_path):
    from tests.dlrm.helpers import train

    data, ckpt = f"{s3_bucket}/data", f"{s3_bucket}/ckpt"
    common = ["--nproc", 2, "--data", data, "--eval-every", 0, "--keep", 0, "--checkpoint-every", 6]
    cache = tmp_path / "cache"
    from tpurec.data.staging import upload
    from tpurec.data.synth import synthesize

    synthesize(6000, str(tmp_path / "d"), seed=2, rows_per_file=3000, row_group_size=500, show_progress=False)
    upload(str(tmp_path / "d"), data)
    a, _ = train(*common, "--steps", 12, "--checkpoint-dir", tmp_path / "a", cache=cache)
    train(*common, "--steps", 6, "--checkpoint-dir", ckpt, cache=cache)
    b, p = train(*common, "--steps", 12, "--checkpoint-dir", ckpt, "--resume", cache=cache)
    assert "at step 6, exact" in p.stderr
    assert (a["auc"], a["logloss"]) == (b["auc"], b["logloss"])
