"""`tpurec data synth/inspect/stats` and the reader with the data in a bucket of a real S3 server
(moto) and a GCS emulator: the same numbers as the same files read from a local directory."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.reliability.inproc import assert_refused, run_cli


def _synth(out, rows: int = 3000) -> list:
    return [
        "data",
        "synth",
        "--rows",
        rows,
        "--rows-per-file",
        2000,
        "--row-group-size",
        500,
        "--seed",
        5,
        "--out",
        out,
    ]


def test_synth_to_s3_then_inspect_reads_what_a_local_copy_reads(s3_bucket, tmp_path, capsys):
    uri = f"{s3_bucket}/criteo/tiny"
    code, out, err = run_cli([*_synth(uri), "--quiet"], capsys)
    assert code == 0, err
    assert f"to {uri}" in out
    code, _, err = run_cli([*_synth(tmp_path / "local"), "--quiet"], capsys)
    assert code == 0, err

    from tpurec.runtime import storage

    names = sorted(p.name for p in storage.path(uri).iterdir())
    assert names == ["_dataset.json", "part-00000.parquet", "part-00001.parquet"]

    code, remote, err = run_cli(["data", "inspect", uri, "--json"], capsys)
    assert code == 0, err
    code, local, err = run_cli(["data", "inspect", tmp_path / "local", "--json"], capsys)
    assert code == 0, err
    remote_doc, local_doc = json.loads(remote), json.loads(local)
    assert remote_doc["rows"] == local_doc["rows"] == 3000
    assert remote_doc["columns"] == local_doc["columns"]  # every statistic, from the same bytes
    assert remote_doc["label_rate"] == local_doc["label_rate"]


def test_reader_batches_from_s3_equal_local(s3_bucket, tmp_path, capsys):
    from tpurec.data.reader import ParquetReader

    assert run_cli([*_synth(f"{s3_bucket}/d"), "--quiet"], capsys)[0] == 0
    assert run_cli([*_synth(tmp_path / "d"), "--quiet"], capsys)[0] == 0
    remote = list(ParquetReader(f"{s3_bucket}/d", 256, rank=1, world_size=2, shuffle=True, seed=7))
    local = list(ParquetReader(str(tmp_path / "d"), 256, rank=1, world_size=2, shuffle=True, seed=7))
    assert len(remote) == len(local) == 1500 // 256 + 1
    for a, b in zip(remote, local):
        assert a.labels.tolist() == b.labels.tolist()
        assert a.dense_features.equal(b.dense_features)
        assert a.sparse_features.values().tolist() == b.sparse_features.values().tolist()


def test_missing_bucket_and_key_are_one_line_naming_the_uri(s3_bucket, capsys):
    code, _, err = run_cli(["data", "inspect", f"{s3_bucket}/nothing-here"], capsys)
    assert_refused(code, err, f"{s3_bucket}/nothing-here: no such file or directory")
    code, _, err = run_cli(["data", "inspect", "s3://tpurec-no-such-bucket/data"], capsys)
    assert_refused(code, err, "s3://tpurec-no-such-bucket/data: bucket 'tpurec-no-such-bucket' does not exist")
    code, _, err = run_cli(["train", "--data", "s3://tpurec-no-such-bucket/data", "--steps", 1], capsys)
    assert_refused(code, err, "--data s3://tpurec-no-such-bucket/data: bucket 'tpurec-no-such-bucket' does not exist")
    # a mistyped bucket is the whole story: no "--data takes the Parquet directory ... from Criteo text" (issue 63)
    assert err.rstrip().endswith("(or these credentials cannot see it)"), err


def test_no_credentials_is_one_line(s3_bucket, monkeypatch, capsys):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    code, _, err = run_cli(["data", "inspect", f"{s3_bucket}/d"], capsys)
    assert_refused(code, err, f"{s3_bucket}: no AWS credentials found")


def test_gs_data_through_the_emulator(gcs_bucket, tmp_path, capsys, monkeypatch):
    """gs:// goes to pyarrow's GcsFileSystem (here at the emulator): synth, inspect and a short
    training run read what the same files read locally."""
    from tpurec.runtime import storage

    uri = f"{gcs_bucket}/tiny"
    assert type(storage.arrow(uri)[0]).__name__ == "GcsFileSystem"
    code, out, err = run_cli([*_synth(uri, rows=1500), "--quiet"], capsys)
    assert code == 0, err
    code, remote, err = run_cli(["data", "inspect", uri, "--json"], capsys)
    assert code == 0, err
    assert run_cli([*_synth(tmp_path / "tiny", rows=1500), "--quiet"], capsys)[0] == 0
    code, local, err = run_cli(["data", "inspect", tmp_path / "tiny", "--json"], capsys)
    assert json.loads(remote)["columns"] == json.loads(local)["columns"]
    assert json.loads(remote)["rows"] == 1500
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    run = ["train", "--quiet", "--steps", 3, "--batch-size", 256, "--eval-every", 0, "--curves-out", "none"]
    results = []
    for data in (uri, tmp_path / "tiny"):
        code, out, err = run_cli([*run, "--data", data], capsys)
        assert code == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert (results[0]["auc"], results[0]["logloss"]) == (results[1]["auc"], results[1]["logloss"])


@pytest.mark.parametrize(
    ("uri", "scheme", "key"),
    [("s3://b/x/y.parquet", "s3", "b/x/y.parquet"), ("gs://b/x/", "gs", "b/x"), ("GCS://b", "gcs", "b")],
)
def test_uri_parsing(uri, scheme, key):
    from tpurec.runtime import storage

    assert storage.is_uri(uri)
    assert storage.split(uri) == (scheme, key)
    assert not storage.is_uri("/data/s3://x") and not storage.is_uri("file.parquet")


def test_a_buckets_filesystem_is_made_again_when_credentials_or_endpoint_change(monkeypatch):
    """`storage.filesystem` keeps one pyarrow filesystem per bucket and credential settings: a changed
    key, endpoint or GCS emulator gets a new one, the settings of before the same one again. pyarrow's
    filesystems are faked here (counted, never connected)."""
    import types

    import pyarrow

    from tpurec.runtime import storage

    made: list[tuple] = []

    def from_uri(uri):
        made.append(("uri", uri))
        return object(), ""

    def gcs(**kw):
        made.append(("gcs", kw["endpoint_override"]))
        return object()

    fake = types.SimpleNamespace(FileSystem=types.SimpleNamespace(from_uri=from_uri), GcsFileSystem=gcs)
    monkeypatch.setattr(pyarrow, "fs", fake, raising=False)
    monkeypatch.setattr(storage, "_filesystems", {})
    monkeypatch.setattr(storage, "require_aws_credentials", lambda uri: None)
    monkeypatch.setattr(storage, "_probe_gcs", lambda uri, bucket: None)  # its own short-lived filesystem
    for name in (*storage._S3_ENV, *storage._GCS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "alice")
    first = storage.filesystem("s3", "b")
    assert storage.filesystem("s3", "b") is first and len(made) == 1
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "bob")
    bob = storage.filesystem("s3", "b")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    elsewhere = storage.filesystem("s3", "b")
    assert len({id(first), id(bob), id(elsewhere)}) == 3 and len(made) == 3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "alice")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert storage.filesystem("s3", "b") is first and len(made) == 3
    # gs://: the emulator's endpoint and the credentials file are settings too
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    one = storage.filesystem("gs", "b")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:2")
    two = storage.filesystem("gs", "b")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/tmp/key.json")
    three = storage.filesystem("gs", "b")
    assert len({id(one), id(two), id(three)}) == 3
    assert made[3:] == [("gcs", "127.0.0.1:1"), ("gcs", "127.0.0.1:2"), ("gcs", "127.0.0.1:2")]
    assert made[:3] == [("uri", "s3://b")] * 3


def _criteo_tsv(path, rows: int = 300) -> None:
    """Criteo's text layout: label, 13 integer counts, 26 hex ids (some blank), tab-separated."""
    rng = np.random.default_rng(1)
    lines = []
    for _ in range(rows):
        dense = [str(v) if v >= 0 else "" for v in rng.integers(-3, 500, 13)]
        cats = [f"{v:08x}" if v % 9 else "" for v in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([str(rng.integers(0, 2)), *dense, *cats]))
    path.write_text("\n".join(lines) + "\n")


def test_convert_from_s3_to_s3_writes_what_a_local_convert_writes(s3_bucket, tmp_path, capsys):
    from tpurec.runtime import storage

    _criteo_tsv(tmp_path / "day_0.tsv")
    storage.path(f"{s3_bucket}/raw/day_0.tsv").write_bytes((tmp_path / "day_0.tsv").read_bytes())
    out = f"{s3_bucket}/parquet"
    convert = ["data", "convert", "--quiet", "--table-set", "dlrm-tiny", "--row-group-size", 100]
    code, said, err = run_cli([*convert, f"{s3_bucket}/raw/day_*.tsv", "--out", out], capsys)
    assert code == 0, err
    assert f"Parquet in {out}" in said
    assert run_cli([*convert, tmp_path / "day_0.tsv", "--out", tmp_path / "parquet"], capsys)[0] == 0
    code, remote, err = run_cli(["data", "inspect", out, "--json"], capsys)
    assert code == 0, err
    local = run_cli(["data", "inspect", tmp_path / "parquet", "--json"], capsys)[1]
    assert json.loads(remote)["rows"] == 300
    assert json.loads(remote)["columns"] == json.loads(local)["columns"]
    assert sorted(p.name for p in storage.path(out).iterdir()) == ["_dataset.json", "part-00000.parquet"]

    code, _, err = run_cli([*convert, f"{s3_bucket}/raw/day_0.tsv", "--out", out], capsys)
    assert_refused(code, err, f"{out} already holds 1 .parquet files; use --overwrite")
