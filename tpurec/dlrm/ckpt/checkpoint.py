"""Training checkpoints through torch.distributed.checkpoint, written so a killed run never leaves
one that looks complete.

Layout of CKPT_DIR/step-00000100/:
  DCP files      {"model": dmp.state_dict(), "optim": combined optimizer state_dict()}: sharded
                 tables and fused optimiser state (ShardedTensors, resharded on load, so another
                 world size can load them), dense weights and dense optimiser state;
  rank-R.json    per rank: data reader position and RNG states (exact resume at the same world size);
                 JSON, never a pickle: reading a checkpoint must not be able to run code
  meta.json      step, world size, epoch and epoch fraction, config (rank 0); checked field by field
                 on load (meta.py), as rank-R.json is;
  CHECKSUMS.json size and SHA-256 of every file above, after fsync (rank 0; integrity.py): a
                 checkpoint is used only if it lists every file and each matches;
  COMPLETE       written last, after every rank has finished.
Everything is first written under step-00000100.tmp/ and renamed once COMPLETE is in it; the
loader only considers directories holding COMPLETE. Multi-host runs need CKPT_DIR on a filesystem
every host sees, or in a bucket.

CKPT_DIR may be an s3:// or gs:// URI (tpurec/runtime/storage.py): DCP writes through its fsspec
writer and reader (s3fs, gcsfs), the other files through pyarrow. A bucket cannot rename a
directory, so there step-00000100/ is written in place and COMPLETE, written last, is what makes it
a checkpoint (an object appears whole or not at all); the loader ignores one without it, and the
next save of that step replaces it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from tpurec import strict_json
from tpurec.errors import UserError
from tpurec.runtime import storage

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer

MARKER = "COMPLETE"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return storage.path(root) / f"step-{step:08d}"


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under root, oldest first (a dir counts only with its COMPLETE marker)."""
    top = storage.path(root)
    if not top.is_dir():
        return []
    found = [
        p
        for p in top.iterdir()
        if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp") and (p / MARKER).exists()
    ]
    return sorted(found, key=lambda p: p.name)


def latest(root: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


class CorruptCheckpointError(UserError):
    """A complete checkpoint that cannot be used: its files no longer match the checksums written
    with them, its CHECKSUMS.json does not cover them all, or its metadata is out of range."""


def verify(path: str | os.PathLike) -> None:
    """Raise CorruptCheckpointError, in one line naming the file and what is wrong, unless
    CHECKSUMS.json lists every file of the checkpoint, each matches it, and meta.json's fields are
    sane. A missing or partial CHECKSUMS.json is refused: it would leave files unchecked."""
    from tpurec.dlrm.ckpt.integrity import ManifestError, problems, read_manifest
    from tpurec.dlrm.ckpt.meta import CheckpointMetaError, read_meta

    try:
        table = read_manifest(path)
    except ManifestError as e:
        raise CorruptCheckpointError(f"checkpoint {path} cannot be verified: {e}") from None
    found = problems(path, table)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CorruptCheckpointError(f"checkpoint {path} is damaged: {found[0]}{more}")
    try:
        read_meta(path)
    except CheckpointMetaError as e:  # the file names the checkpoint
        raise CorruptCheckpointError(str(e)) from None


def latest_intact(root: str | os.PathLike, say: Callable[[str], object] = print) -> Path | None:
    """The newest complete checkpoint under root that verifies (`verify`); each newer one that does
    not is named through `say` and skipped."""
    for path in reversed(complete_checkpoints(root)):
        try:
            verify(path)
            return path
        except CorruptCheckpointError as e:
            say(f"resume: {e}; trying the previous checkpoint")
    return None


def is_root(path: str | os.PathLike) -> bool:
    """True for a directory of checkpoints (a --checkpoint-dir), not one checkpoint itself."""
    p = storage.path(path)
    return p.is_dir() and not (p / MARKER).exists() and not p.name.startswith("step-")


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint dir itself, or the newest complete one under a root; one-line errors otherwise."""
    p = storage.path(path)
    if (p / MARKER).exists():
        return p
    if is_root(p):
        last = latest(p)
        if last is not None:
            return last
        raise FileNotFoundError(f"no complete checkpoint under {p}")
    if p.name.endswith(".tmp") or (p.is_dir() and not (p / MARKER).exists()):
        raise FileNotFoundError(
            f"{p} is not a complete checkpoint (no {MARKER} marker: the run was interrupted while writing it)"
        )
    raise FileNotFoundError(f"checkpoint {p} not found")


def rng_state() -> dict:
    """The torch, numpy and python RNG states as JSON values (lists of ints)."""
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: the tuple form
    name, keys, pos, has_gauss, cached = state
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def train_state_file(path: str | os.PathLike, rank: int) -> Path:
    return storage.path(path) / f"rank-{rank}.json"


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (full disk, read-only or unwritable directory); the
    previous complete checkpoint is left as it was."""


_E = TypeVar("_E", bound=BaseException)


def _behind(e: BaseException | None, kind: type[_E], depth: int = 0) -> _E | None:
    """The `kind` error behind `e`: itself, its cause, or (DCP) one of the ranks' failures."""
    if e is None or depth > 8:
        return None
    if isinstance(e, kind):
        return e
    for exc, *_ in getattr(e, "failures", {}).values():  # DCP's CheckpointException: {rank: (exc, trace)}
        found = _behind(exc, kind, depth + 1)
        if found is not None:
            return found
    return _behind(e.__cause__ or e.__context__, kind, depth + 1)


def _os_error(e: BaseException | None) -> OSError | None:
    return _behind(e, OSError)


def write_error(e: BaseException, where: str | os.PathLike, previous: Path | None) -> CheckpointWriteError | None:
    """One-line CheckpointWriteError for an OSError behind `e` while writing `where`, else None."""
    err = _os_error(e)
    if err is None and _nearly_full(where):
        # torch.save's zip writer reports a full disk as "RuntimeError: [enforce fail at
        # inline_container.cc] unexpected pos ..." (seen on a full tmpfs), not as ENOSPC.
        err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if err is None:
        return None
    kept = _kept(previous)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointWriteError(
            f"no space left on device writing {where}; {kept}. Free space or give another --checkpoint-dir"
        )
    return CheckpointWriteError(f"cannot write checkpoint {where}: {err.strerror or err}; {kept}")


def _kept(previous: Path | None) -> str:
    return f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"


def _dcp_failure(e: BaseException, where: str | os.PathLike, previous: Path | None) -> CheckpointWriteError | None:
    """One line for any other failure DCP reports ({rank: (exception, trace)}), whose text would
    otherwise be DCP's whole message with every rank's traceback in it; None if `e` is not DCP's."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    rank = min(failures)
    exc = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    text = str(exc).strip().splitlines()
    return CheckpointWriteError(
        f"cannot write checkpoint {where}: rank {rank} failed in torch.distributed.checkpoint with "
        f"{type(exc).__name__}: {text[0] if text else '(no message)'}; {_kept(previous)}"
    )


FULL_BELOW_BYTES = 16 << 20  # free space under which a failed write is taken for a full disk


def _nearly_full(path: str | os.PathLike) -> bool:
    if storage.is_uri(path):  # a bucket has no free space to run out of
        return False
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES


def save(
    root: str | os.PathLike,
    step: int,
    dmp: nn.Module,
    optimizer: Optimizer,
    train_state: dict,
    meta: dict,
    keep: int = 0,
) -> Path:
    """Collective: every rank calls it. Returns the final directory. A write that fails (full disk,
    read-only directory) raises CheckpointWriteError naming the directory, on the ranks that see it;
    the unfinished step-N.tmp is removed and every complete checkpoint is left as it was."""
    final = step_dir(root, step)
    try:
        storage.check_reachable(root)  # before any request that would retry for minutes
    except UserError as e:
        raise CheckpointWriteError(f"cannot write checkpoint {final}: {e}") from None
    # A bucket cannot rename a directory: the checkpoint is written where it stays (module docstring).
    tmp = final if storage.is_uri(root) else final.with_name(final.name + ".tmp")
    previous = latest(root)
    try:
        _write(root, step, final, tmp, dmp, optimizer, train_state, meta)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if _rank() == 0 and not (tmp / MARKER).exists():
            storage.rmtree(tmp, ignore_errors=True)  # give the space back: it never was a checkpoint
        if _behind(e, KeyboardInterrupt) is not None:  # Ctrl-C (DCP wraps it): complete ones stay as they were
            raise KeyboardInterrupt from None
        failed, chain = write_error(e, tmp, previous), None
        if failed is None:  # any other DCP failure: one line, the ranks' traces stay on the chain
            failed, chain = _dcp_failure(e, tmp, previous), e
        if failed is None:
            raise
        raise failed from chain
    if _rank() == 0:
        purge(root, keep)
    _barrier()
    return final


def purge(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints under root (none when keep <= 0: keep
    them all); returns those deleted. Only complete ones count, so a run keeps `keep` usable ones."""
    if keep <= 0:
        return []
    stale = complete_checkpoints(root)[:-keep]
    for old in stale:
        delete(old)
    return stale


def delete(old: Path) -> None:
    """Delete complete checkpoint `old` (rank 0's job)."""
    if storage.is_uri(old):
        (old / MARKER).unlink(missing_ok=True)  # first: a delete cut short leaves no "complete" remnant
    storage.rmtree(old, ignore_errors=True)


def _write(
    root: str | os.PathLike,
    step: int,
    final: Path,
    tmp: Path,
    dmp: nn.Module,
    optimizer: Optimizer,
    train_state: dict,
    meta: dict,
) -> None:
    import torch.distributed.checkpoint as dcp

    remote = storage.is_uri(root)
    if _rank() == 0:
        storage.path(root).mkdir(parents=True, exist_ok=True)
        if remote:  # written in place: an older copy of this step is no longer complete from here on
            (tmp / MARKER).unlink(missing_ok=True)
        storage.rmtree(tmp, ignore_errors=True)  # a leftover from a killed run
        tmp.mkdir()
    _barrier()
    state = {"model": dmp.state_dict(), "optim": optimizer.state_dict()}
    if remote:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not re-exported (torch 2.14)

        dcp.save(state, storage_writer=FsspecWriter(str(tmp), **storage.fsspec_options(tmp)))
    else:
        dcp.save(state, checkpoint_id=str(tmp))
    train_state_file(tmp, _rank()).write_text(strict_json.dumps(train_state))
    _barrier()  # every rank's files are on disk
    if _rank() == 0:
        from tpurec.dlrm.ckpt.integrity import write_checksums

        (tmp / "meta.json").write_text(strict_json.dumps(meta, indent=2, default=str))
        write_checksums(tmp)  # fsyncs the data first: COMPLETE never reaches the disk before it
        from tpurec.runtime.interrupts import deferred

        with deferred():  # marker and renames as one step: a Ctrl-C between them waits until they are done
            _publish(step, tmp, final)


def _publish(step: int, tmp: Path, final: Path) -> None:
    """Mark `tmp` complete and rename it to `final` (in a bucket they are one: the marker is all)."""
    (tmp / MARKER).write_text(f"step {step}, world size {_world()}\n")
    if tmp == final:
        return
    if final.exists():
        # Same step saved again (a final save right after a periodic one): the old copy goes only
        # now that the new one is complete, so a failed save never loses it.
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


class CheckpointMismatchError(UserError):
    """A checkpoint whose tensors do not fit the model resumed (other table sizes, another model)."""


def load(
    path: str | os.PathLike, dmp: nn.Module, optimizer: Optimizer, verified: bool = False
) -> tuple[dict, dict | None]:
    """Load model and optimiser state in place; returns (meta, this rank's train state or None when
    the checkpoint was written at another world size). `verified`: the caller has just run
    `verify(path)` (hashing a large checkpoint twice costs minutes)."""
    import torch.distributed.checkpoint as dcp

    from tpurec.dlrm.ckpt.dcp_guard import UnsafeCheckpointError, check_entries, check_metadata, safe_load_planner
    from tpurec.dlrm.ckpt.meta import CheckpointMetaError, check_train_state, read_meta
    from tpurec.dlrm.ckpt.shapes import model_mismatch

    storage.check_reachable(path)  # one line within seconds, not minutes of retries
    path = resolve(path)
    if not verified:
        verify(path)  # before DCP reads a byte: a damaged file would load as near-random weights
    meta = read_meta(path)
    metadata = check_metadata(path)  # DCP unpickles .metadata: refuse anything but metadata classes first
    train_state = None
    if meta["world_size"] == _world():
        own = train_state_file(path, _rank())
        if not own.exists():
            # Checkpoints of tpurec before 2026-12 pickled this file (rank-R.pt); unpickling can run
            # code, so it is never read.
            raise FileNotFoundError(
                f"{own} is missing (a checkpoint from an older tpurec keeps it as a pickle, which tpurec "
                "does not load); resume from a newer checkpoint"
            )
        try:
            train_state = check_train_state(own, json.loads(own.read_text()), meta["step"])
        except json.JSONDecodeError as e:
            raise UserError(f"{own}: not valid JSON ({e}); the checkpoint is damaged") from None
        except CheckpointMetaError as e:
            raise CorruptCheckpointError(str(e)) from None
    # Every check before DCP writes into the model: a refused checkpoint leaves it untouched.
    sd = {"model": dmp.state_dict(), "optim": optimizer.state_dict()}
    check_entries(metadata, sd, path)  # a tensor stored as bytes would be unpickled by DCP
    mismatch = model_mismatch(metadata, sd["model"])
    if mismatch:
        raise CheckpointMismatchError(f"checkpoint {path} {mismatch}")
    try:
        if storage.is_uri(path):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader = FsspecReader(str(path), **storage.fsspec_options(path))
            dcp.load(sd, storage_reader=reader, planner=safe_load_planner())
        else:
            dcp.load(sd, checkpoint_id=str(path), planner=safe_load_planner())
    except BaseException as e:  # DCP wraps each rank's error in a CheckpointException
        unsafe = _behind(e, UnsafeCheckpointError)
        if unsafe is not None:
            raise UnsafeCheckpointError(f"{path}: {unsafe}") from None
        raise
    dmp.load_state_dict(sd["model"])
    optimizer.load_state_dict(sd["optim"])
    return meta | {"path": str(path)}, train_state
