"""Real object stores on localhost for the bucket tests: moto's S3 server (one per session) and,
for gs://, gcp-storage-emulator; each test gets a bucket of its own. Nothing here mocks pyarrow:
tpurec talks HTTP to these servers through pyarrow's S3FileSystem / GcsFileSystem and s3fs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

# Credentials and endpoint as a user sets them (docs/data.md, "Cloud storage"); no ~/.aws files, no
# instance metadata lookup (it would leave this machine).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
}
# gcsfs 2026.7 first asks a gs:// bucket's layout over gRPC (its experimental hierarchical-namespace
# support), which the emulator does not serve: 60 s per call. Read when gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Google's auth library would look for a GCE metadata server (off this machine): none here.
os.environ.setdefault("NO_GCE_CHECK", "true")
S3_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_WEB_IDENTITY_TOKEN_FILE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], url: str, what: str) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc
        except urllib.error.HTTPError:  # it answers: up
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    pytest.fail(f"{what} did not start ({' '.join(argv)})")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free localhost port, for the whole session."""
    pytest.importorskip("moto", reason="moto[server] (requirements/test.txt) runs the S3 server")
    port = _free_port()
    proc = _serve(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        f"http://127.0.0.1:{port}/moto-api/",
        "moto's S3 server",
    )
    yield f"http://127.0.0.1:{port}"
    _stop(proc)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """This test's environment pointed at the server (AWS_ENDPOINT_URL), with credentials."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    for k in S3_UNSET:
        monkeypatch.delenv(k, raising=False)
    return s3_endpoint


@pytest.fixture
def s3_bucket(s3_env) -> str:
    """A new, empty bucket: its URI ``s3://NAME``."""
    import boto3

    name = f"tpurec-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def gcs_endpoint():
    """gcp-storage-emulator (in memory) on a free localhost port, for the whole session."""
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (requirements/test.txt) serves gs://")
    port = _free_port()
    proc = _serve(
        [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
        ],
        f"http://127.0.0.1:{port}/",
        "gcp-storage-emulator",
    )
    yield f"http://127.0.0.1:{port}"
    _stop(proc)


@pytest.fixture
def gcs_bucket(gcs_endpoint, monkeypatch) -> str:
    """A new bucket in the emulator, which tpurec reaches through STORAGE_EMULATOR_HOST: its URI."""
    import json

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    name = f"tpurec-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(
        f"{gcs_endpoint}/storage/v1/b?project=test",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(req, timeout=10).read()
    return f"gs://{name}"
