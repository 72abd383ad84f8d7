"""Read a DCP checkpoint's `.metadata` before torch.distributed.checkpoint unpickles it.

DCP (torch 2.14) stores its metadata as a pickle and loads it with plain `pickle.load`, so a crafted
`.metadata` in a checkpoint directory would run code at `tpurec train --resume`. tpurec reads
nothing from disk that can execute code: `check_metadata` unpickles the file first with an
allow-list (DCP's own metadata classes, torch dtypes/Size/layout, pathlib paths) and raises on any
other global, before `dcp.load` touches it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from tpurec.errors import UserError
from tpurec.runtime import storage

_DCP = "torch.distributed.checkpoint."
_OTHER = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class UnsafeCheckpointError(UserError):
    """A checkpoint file names something a checkpoint never needs (it could run code)."""


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        refuse = UnsafeCheckpointError(
            f"{self._path}: refers to {module}.{name}, which no checkpoint metadata needs; not loaded "
            "(unpickling it could run code). Use a checkpoint written by torch.distributed.checkpoint."
        )
        if "." in name:  # protocol 4 resolves dotted names attribute by attribute: a.b.os.system
            raise refuse
        if (module, name) in _OTHER:
            return super().find_class(module, name)
        obj = super().find_class(module, name) if module == "torch" or module.startswith(_DCP) else None
        if module == "torch" and isinstance(obj, torch.dtype):
            return obj
        # only classes (dataclasses, enums) that DCP itself defines
        if isinstance(obj, type) and getattr(obj, "__module__", "").startswith(_DCP):
            return obj
        raise refuse


def check_metadata(checkpoint_dir: str | os.PathLike) -> Any:
    """The DCP metadata of `.metadata`, unpickled with the allow-list; UnsafeCheckpointError (or
    FileNotFoundError) unless it holds only DCP metadata."""
    path = storage.path(checkpoint_dir) / ".metadata"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {checkpoint_dir} is not a torch.distributed.checkpoint")
    try:
        metadata = _AllowListUnpickler(path.read_bytes(), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise UserError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
    if not hasattr(metadata, "state_dict_metadata"):
        raise UserError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


__all__ = ["check_metadata", "UnsafeCheckpointError"]
