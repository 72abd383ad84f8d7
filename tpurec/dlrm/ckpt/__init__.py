"""DLRM checkpoints: DCP save/load, metadata, integrity manifest, shape/config checks, disk space, the
lock, behind one `CheckpointManager` (manager.py) that the trainer holds.

`tpurec.dlrm.ckpt.CheckpointManager` loads on first use, as the other packages' names do, so that
importing one of the small modules here (the lock, the config check) does not import torch.
"""

from typing import Any

__all__ = ["CheckpointManager"]

_LAZY = {"CheckpointManager": "tpurec.dlrm.ckpt.manager"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpurec.dlrm.ckpt' has no attribute {name!r}")
