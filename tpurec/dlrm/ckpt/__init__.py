"""DLRM checkpoints: DCP save/load, metadata, integrity manifest, shape/config checks, disk space, the lock,
behind one `CheckpointManager` (manager.py) that the trainer holds."""

from tpurec.dlrm.ckpt.manager import CheckpointManager

__all__ = ["CheckpointManager"]
