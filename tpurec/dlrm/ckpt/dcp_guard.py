"""Read a DCP checkpoint's `.metadata` before torch.distributed.checkpoint unpickles it.

DCP (torch 2.14) stores its metadata as a pickle and loads it with plain `pickle.load`, so a crafted
`.metadata` in a checkpoint directory would run code at `tpurec train --resume`. tpurec reads
nothing from disk that can execute code: `check_metadata` unpickles the file first with an
allow-list (DCP's own metadata classes, torch dtypes/Size/layout, pathlib paths) and raises on any
other global, before `dcp.load` touches it.

The allow-list alone is not enough: DCP's own `BytesStorageMetadata` marks an entry whose bytes DCP
loads with `torch.load(weights_only=False)` (`default_planner.py`, `load_bytes`), so an entry
re-declared as bytes, with a pickle appended to its shard, would run code inside `dcp.load` (#61).
So every entry is checked against the state dict being loaded (`check_entries`: a tensor there needs
tensor storage; `model.*` and `optim.*` alike), and what is legitimately bytes (a plain torch
optimizer's `param_groups` numbers) is read by `SafeLoadPlanner` with `torch.load(weights_only=True)`,
whose unpickler builds only tensors and plain containers and numbers.
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


def check_entries(metadata: Any, state: dict[str, Any], checkpoint_dir: str | os.PathLike) -> None:
    """Each entry of the checkpoint that `state` (what dcp.load will fill: {"model": ..., "optim":
    ...}, flattened as DCP flattens it) loads has the storage its value needs: tensor storage for a
    tensor (ShardedTensor and DTensor included), bytes only for a plain value; anything else is
    refused naming the entry, before DCP reads a byte."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise UserError(f"{checkpoint_dir}/.metadata: its entries are a {type(entries).__name__}, not a dict")
    flat, _ = flatten_state_dict(state)
    for key, value in flat.items():
        entry = entries.get(key)
        if entry is None:
            continue  # missing: DCP names it (or the shape check did)
        want = TensorStorageMetadata if isinstance(value, torch.Tensor) else BytesStorageMetadata
        if not isinstance(entry, want):
            raise UnsafeCheckpointError(
                f"{checkpoint_dir}/.metadata: entry {key!r} is stored as {type(entry).__name__}, but this run's "
                f"{key} is a {type(value).__name__} (a tensor is never stored as bytes, which DCP would unpickle): "
                "not loaded"
            )


def safe_load_planner() -> Any:
    """A DCP load planner that reads bytes entries with `torch.load(weights_only=True)` (DCP's own
    uses weights_only=False: any pickle); a pickle naming anything else is refused by torch."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except Exception as e:  # pickle.UnpicklingError naming the global it refused
                raise UnsafeCheckpointError(
                    f"checkpoint entry {read_item.dest_index.fqn!r} holds a pickle of something other than plain "
                    f"values ({type(e).__name__}); not loaded (unpickling it could run code)"
                ) from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


__all__ = ["check_metadata", "check_entries", "safe_load_planner", "UnsafeCheckpointError"]
