"""DLRM checkpoints: DCP save/load, metadata, integrity manifest, shape/config checks, disk space, the lock."""
