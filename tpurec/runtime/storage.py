"""Where a data or checkpoint path lives: on this machine, or in a bucket (``s3://``, ``gs://``).

`path(p)` is a `pathlib.Path` for a local path, so every local code path stays what it was, and a
`BucketPath` for a URI: the part of pathlib's API tpurec's data and checkpoint code uses (``/``,
``name``, ``parent``, ``exists``, ``is_dir``, ``iterdir``, ``glob``, ``rglob``, ``read_text``,
``write_text``, ``open``, ``stat``, ``mkdir``, ``unlink``), over pyarrow's filesystems
(`pyarrow.fs.FileSystem.from_uri`: S3FileSystem, GcsFileSystem). `arrow(p)` gives what pyarrow's own
readers and writers take (``filesystem=``, path): None and the path unchanged for a local one, so
local Parquet keeps its memory map.

Credentials are the libraries' own: pyarrow's S3 (the AWS SDK's chain: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws files, web identity, the instance's
role; endpoint AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; region AWS_DEFAULT_REGION or the bucket's)
and GCS (Google's application default credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud's ADC
file, the VM's service account). STORAGE_EMULATOR_HOST (the variable Google's client libraries
read) points gs:// at an emulator, anonymously. The first use of a gs:// bucket asks for it once,
within `PROBE_S`: an endpoint that cannot be reached is one line naming it. A bucket has no
directories, no rename of a directory, no flock and no free space: the callers decide what replaces
each (docs/data.md, "Cloud storage").
"""

from __future__ import annotations

import errno
import fnmatch
import io
import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tpurec.errors import UserError

SCHEMES = ("s3", "gs", "gcs")  # gcs:// is pyarrow's and fsspec's other name for gs://
_S3_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_EC2_METADATA_DISABLED",
)
_GCS_ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")
_filesystems: dict[tuple, Any] = {}
# An unreachable gs:// endpoint is one line within PROBE_S (_probe_gcs), not a hang; a reachable
# one's transient errors are retried for GCS_RETRY_S (pyarrow's default: 15 minutes).
PROBE_S = 15.0  # at most this long for the probe's answer
PROBE_RETRY_S = 5.0  # the probe's retries of a refused connection (google-cloud-cpp backs off past it)
GCS_RETRY_S = 120.0


def is_uri(path: object) -> bool:
    """True for an ``s3://`` or ``gs://`` (``gcs://``) URI."""
    if isinstance(path, BucketPath):
        return True
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    return isinstance(text, str) and text.partition("://")[0].lower() in SCHEMES and "://" in text


def split(uri: str) -> tuple[str, str]:
    """(scheme, "bucket/key") of a URI, the key without a trailing slash."""
    scheme, _, rest = uri.partition("://")
    rest = rest.strip("/")
    if not rest:
        raise UserError(f"{uri}: no bucket in the URI (write {scheme}://BUCKET/PATH)")
    return scheme.lower(), rest


def path(p: str | os.PathLike) -> Any:
    """A `pathlib.Path` for a local path, a `BucketPath` for a URI (typed Any: both are used alike)."""
    if isinstance(p, BucketPath):
        return p
    if is_uri(p):
        scheme, key = split(os.fspath(p))
        return BucketPath(scheme, key)
    return Path(p)


def filesystem(scheme: str, bucket: str) -> Any:
    """The pyarrow filesystem of one bucket, made once per process (and per credential settings:
    tests change them)."""
    env = tuple(os.environ.get(k) for k in (_S3_ENV if scheme == "s3" else _GCS_ENV))
    key = (scheme, bucket, env)
    if key not in _filesystems:
        from pyarrow import fs as pafs

        uri = f"{scheme}://{bucket}"
        if scheme == "s3":
            require_aws_credentials(uri)
        try:
            made = pafs.FileSystem.from_uri(uri)[0] if scheme == "s3" else _gcs(GCS_RETRY_S)
        except (OSError, ValueError) as e:
            raise UserError(f"{uri}: cannot open the bucket ({_first_line(e)})") from None
        if scheme != "s3":
            _probe_gcs(uri, bucket)
        _filesystems[key] = made
    return _filesystems[key]


def _gcs(retry_s: float) -> Any:
    """pyarrow's GcsFileSystem retrying a transient error for at most `retry_s` (its own default is
    15 minutes, during which an unreachable endpoint is a silent hang); at STORAGE_EMULATOR_HOST
    anonymously when set."""
    from datetime import timedelta

    from pyarrow import fs as pafs

    limit = timedelta(seconds=retry_s)
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        how, _, host = emulator.rpartition("://")
        return pafs.GcsFileSystem(
            anonymous=True, scheme=how or "http", endpoint_override=host.rstrip("/"), retry_time_limit=limit
        )
    return pafs.GcsFileSystem(retry_time_limit=limit)


def gcs_endpoint() -> str:
    """Where gs:// requests go, for messages."""
    return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"


def _probe_gcs(uri: str, bucket: str) -> None:
    """One request for `bucket` before any other, answered within PROBE_S: UserError naming the
    bucket and the endpoint if it cannot be reached. Its retry limit bounds an endpoint that refuses
    connections; the join's deadline one that accepts them and never answers (curl itself would wait
    120 s per attempt). Any other answer (no such bucket, access denied) is left to the request
    that meets it, whose error says so."""
    import threading

    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            _gcs(PROBE_RETRY_S).get_file_info(bucket)
            outcome.append(None)
        except BaseException as e:  # reported by the caller's thread
            outcome.append(e)

    # A daemon: one that never returns must not keep the process from exiting with the error.
    asking = threading.Thread(target=ask, name="gcs-probe", daemon=True)
    asking.start()
    asking.join(PROBE_S)
    why = f"no answer within {PROBE_S:g} s" if not outcome else _unreachable(outcome[0])
    if why:
        raise UserError(
            f"{uri}: cannot reach the bucket at {gcs_endpoint()} ({why}); check the network or the endpoint"
        )


def check_reachable(p: str | os.PathLike) -> None:
    """For a gs:// `p`, the probe again (`_probe_gcs`, at most PROBE_S): before a checkpoint's save or
    load, whose requests would otherwise meet an endpoint that went away since the run began with
    pyarrow's retries (GCS_RETRY_S) and gcsfs's (a 60 s bucket-type lookup, then 6 tries a request
    backing off to 16 s: minutes a save), with no line. A local path or s3:// (one line in seconds
    already): nothing."""
    if not is_uri(p):
        return
    scheme, key = split(os.fspath(p) if not isinstance(p, BucketPath) else str(p))
    if scheme != "s3":
        bucket = key.split("/")[0]
        _probe_gcs(f"{scheme}://{bucket}", bucket)


def _unreachable(e: BaseException | None) -> str | None:
    """What made a request fail for want of a reachable endpoint (google-cloud-cpp's UNAVAILABLE or
    DEADLINE_EXCEEDED: connection refused, timed out), else None."""
    if not isinstance(e, OSError):
        return None
    text = str(e)
    if "UNAVAILABLE" not in text and "DEADLINE_EXCEEDED" not in text:
        return None
    curl = re.search(r"CURL error \[\d+\]=(.*?)(?: error_info=|$)", text)  # curl's own words
    return curl.group(1).strip() if curl else _first_line(e)[:200]


def require_aws_credentials(uri: str) -> None:
    """UserError naming `uri` unless botocore's credential chain (the one s3fs, and so the
    checkpoints' writer, uses; pyarrow's AWS SDK reads the same sources) finds credentials. pyarrow
    alone would send the requests unsigned and report "access denied" for every object."""
    try:
        import botocore.session
    except ImportError:  # s3fs is not installed: pyarrow's own errors will have to do
        return
    if botocore.session.Session().get_credentials() is None:
        raise UserError(
            f"{uri}: no AWS credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
            "~/.aws/credentials, a web identity token or the instance's role); set them and retry"
        )


def fsspec_options(uri: str | os.PathLike) -> dict[str, Any]:
    """fsspec's keyword arguments for `uri` (DCP's FsspecWriter / FsspecReader), reaching what
    `filesystem` reaches: anonymous at a GCS emulator (gcsfs reads STORAGE_EMULATOR_HOST itself,
    but would look for credentials first)."""
    scheme = split(str(uri))[0]
    return {"token": "anon"} if scheme != "s3" and os.environ.get("STORAGE_EMULATOR_HOST") else {}


def arrow(p: str | os.PathLike) -> tuple[Any, str]:
    """(filesystem, path) for pyarrow's ``filesystem=`` and path arguments: (None, p) when local."""
    if isinstance(p, BucketPath):
        return p.fs, p.key
    if is_uri(p):
        scheme, key = split(os.fspath(p))
        return filesystem(scheme, key.split("/")[0]), key
    return None, os.fspath(p)


def dir_problem(uri: str) -> str | None:
    """`URI: why` when a directory in a bucket cannot be written (no bucket, no credentials: one
    request), else None; nothing is written."""
    try:
        where = path(uri)
        return None if where.bucket_exists() else f"{uri}: {where.missing_reason()}"
    except UserError as e:
        return str(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass(frozen=True)
class _Stat:
    st_size: int


class BucketPath:
    """An object (or prefix) in a bucket, with the pathlib methods tpurec's data and checkpoint
    code calls. A "directory" is a prefix; `mkdir` writes pyarrow's empty marker so a new one
    exists before anything is in it. Errors name the URI: FileNotFoundError for a missing object,
    UserError for anything else the store refuses (a missing bucket, access denied)."""

    def __init__(self, scheme: str, key: str) -> None:
        self.scheme = scheme
        self.key = key.strip("/")

    # ---- names ----
    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"BucketPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketPath) and (self.scheme, self.key) == (other.scheme, other.key)

    def __hash__(self) -> int:
        return hash((self.scheme, self.key))

    def __lt__(self, other: BucketPath) -> bool:
        return self.key < other.key

    def __truediv__(self, name: str | os.PathLike) -> BucketPath:
        return BucketPath(self.scheme, posixpath.join(self.key, os.fspath(name)))

    @property
    def bucket(self) -> str:
        return self.key.split("/")[0]

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.key).suffix

    @property
    def parent(self) -> BucketPath:
        up = posixpath.dirname(self.key)
        return BucketPath(self.scheme, up) if up else self

    def with_name(self, name: str) -> BucketPath:
        return self.parent / name

    def relative_to(self, other: BucketPath) -> PurePosixPath:
        return PurePosixPath(self.key).relative_to(other.key)

    @property
    def fs(self) -> Any:
        return filesystem(self.scheme, self.bucket)

    # ---- questions ----
    def _info(self) -> Any:
        return self._call(lambda: self.fs.get_file_info(self.key))

    def exists(self) -> bool:
        from pyarrow.fs import FileType

        return self._info().type != FileType.NotFound

    def is_dir(self) -> bool:
        from pyarrow.fs import FileType

        return self._info().type == FileType.Directory

    def is_file(self) -> bool:
        from pyarrow.fs import FileType

        return self._info().type == FileType.File

    def stat(self) -> _Stat:
        info = self._info()
        if info.size is None:
            self._missing()
        return _Stat(int(info.size))

    def bucket_exists(self) -> bool:
        from pyarrow.fs import FileType

        return self._call(lambda: self.fs.get_file_info(self.bucket)).type != FileType.NotFound

    def missing_reason(self) -> str:
        """Why this path is not there, for a one-line error: the bucket or the object."""
        if not self.bucket_exists():
            return f"bucket {self.bucket!r} does not exist (or these credentials cannot see it)"
        return "no such file or directory"

    # ---- listing ----
    def _children(self, recursive: bool) -> list[Any]:
        from pyarrow.fs import FileSelector

        try:
            return self.fs.get_file_info(FileSelector(self.key, recursive=recursive, allow_not_found=True))
        except OSError as e:
            raise UserError(f"{self}: cannot list ({_first_line(e)})") from None

    def _names(self) -> list[str]:
        """The names one level below, from a recursive listing: a delimited listing's common prefixes
        (the "directories") are what S3-compatible stores and emulators implement least alike
        (gcp-storage-emulator returns none), and a bucket's "directory" is only a prefix anyway."""
        names = {info.path[len(self.key) + 1 :].split("/")[0] for info in self._children(True)}
        return sorted(n for n in names if n)

    def iterdir(self) -> Iterator[BucketPath]:
        for name in self._names():
            yield self / name

    def glob(self, pattern: str) -> Iterator[BucketPath]:
        """Children whose name matches `pattern` (one level; no ``**``)."""
        for name in self._names():
            if fnmatch.fnmatchcase(name, pattern):
                yield self / name

    def rglob(self, pattern: str) -> Iterator[BucketPath]:
        for info in self._children(True):
            if fnmatch.fnmatchcase(posixpath.basename(info.path), pattern):
                yield BucketPath(self.scheme, info.path)

    # ---- reading and writing ----
    def open(self, mode: str = "rb") -> Any:
        if mode in ("rb", "r"):
            stream = self._call(lambda: self.fs.open_input_file(self.key))
        elif mode in ("wb", "w"):
            stream = self._call(lambda: self.fs.open_output_stream(self.key))
        else:
            raise ValueError(f"BucketPath.open: mode {mode!r} (only r, rb, w, wb)")
        return io.TextIOWrapper(stream, encoding="utf-8") if "b" not in mode else stream

    def read_bytes(self) -> bytes:
        with self.open("rb") as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        """One PUT: an object store shows the whole object or the previous one, never a part."""
        with self.open("wb") as f:
            f.write(data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self._call(lambda: self.fs.create_dir(self.key, recursive=True))

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self._call(lambda: self.fs.delete_file(self.key))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Delete this prefix and everything under it (nothing if it is not there)."""
        if self.exists():
            self._call(lambda: self.fs.delete_dir(self.key))

    def _missing(self) -> None:
        raise FileNotFoundError(errno.ENOENT, self.missing_reason(), str(self))

    def _call(self, fn: Any) -> Any:
        try:
            return fn()
        except FileNotFoundError:
            self._missing()
        except OSError as e:
            raise UserError(f"{self}: {_first_line(e)}") from None


def rmtree(p: str | os.PathLike, ignore_errors: bool = False) -> None:
    """shutil.rmtree for a local directory, the prefix's objects for a URI."""
    target = path(p)
    if isinstance(target, BucketPath):
        try:
            target.rmtree()
        except (OSError, UserError):
            if not ignore_errors:
                raise
        return
    import shutil

    shutil.rmtree(target, ignore_errors=ignore_errors)
