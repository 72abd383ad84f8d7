"""Does a checkpoint's model state fit the model being resumed? Checked before DCP loads it.

DCP reports a table of another size as `Size mismatch` and a tensor the checkpoint lacks as
`Missing key`, each inside a multi-rank CheckpointException with tracebacks. Tables take their row
counts from the data (`_dataset.json`), so resuming on other data than the checkpoint was trained
on is the usual cause; meta.json's config can also disagree with the tensors it was saved beside.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

_TABLE = re.compile(r"\.(?:embedding_bags|embeddings)\.([^.]+)\.weight$")


def _shape(value: Any) -> tuple[int, ...] | None:
    """The global shape of a tensor, ShardedTensor or DTensor; None for anything else."""
    import warnings

    import torch

    if hasattr(value, "local_shards"):  # ShardedTensor (a Tensor too): size() is the global size
        with warnings.catch_warnings():  # "use DTensor instead": TorchRec's choice, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            return tuple(value.size())
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def model_mismatch(metadata: Metadata, model_state: dict, prefix: str = "model.") -> str | None:
    """How `model_state` (a DMP's state_dict, saved under `prefix` in the checkpoint) differs from
    the checkpoint's DCP `metadata`, in one line naming the table (and both row counts) or the
    tensor (and both shapes); None when every tensor is there with its shape."""
    saved = metadata.state_dict_metadata
    for key, value in model_state.items():
        shape = _shape(value)
        if shape is None:
            continue
        stored = saved.get(prefix + key)
        if stored is None:
            return f"holds no {key}: it was written for another model than this run's (or than its meta.json says)"
        theirs = tuple(getattr(stored, "size", ()) or ())
        if theirs == shape:
            continue
        table = _TABLE.search(key)
        if table and len(theirs) == len(shape) == 2 and theirs[1] == shape[1]:
            return (
                f"has table {table.group(1)} with {theirs[0]:,} rows, this run's has {shape[0]:,} (tables take their "
                "sizes from the data's _dataset.json: resume on the data the checkpoint was trained on, or start a "
                "new run)"
            )
        return f"has {key} of shape {list(theirs)}, this run's is {list(shape)}"
    return None
