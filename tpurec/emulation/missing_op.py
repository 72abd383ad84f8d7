"""The emulated device's error for an op TorchTPU 0.2.0 has no kernel for (issue 63 item 2).

On a TPU such an op raises TorchTPU's "operator '...' is not implemented for TPU" from deep inside
torch, on every rank: 8 ranks of a slice printed 8 tracebacks of ~85 lines for one
`JaggedTensor.to_padded_dense` in a model's forward. When the call comes from the user's code, the
emulated device says it in one line instead: where (the user's file:line), what (the TorchRec or
torch function called there, and the op it reached) and what to do instead. That line is a
`UserError`, which a rank prints once for all the ranks that raise it (tpurec/runtime/rank_errors.py).
Called from tpurec's own code it stays TorchTPU's NotImplementedError with its traceback: a bug.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

from tpurec.errors import UserError

_TPUREC = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
# What to do instead, by op name prefix: the ops a model's own forward most often reaches.
_INSTEAD = {
    "fbgemm::jagged_to_padded_dense": "gather each sample's rows by offsets() with a fixed number of rows, the "
    "indices built on the device (torch.arange(n, device=offsets.device)), as examples/history_ranker.py does "
    "(docs/sequence.md)",
    "fbgemm::jagged": "compute it from values(), lengths() and offsets() with plain torch ops (docs/sequence.md)",
    "fbgemm::permute_multi_embedding": "regroup the pooled embeddings with torch.split / torch.cat of "
    "KeyedTensor.values() by KeyedTensor.length_per_key()",
}
_GENERIC = (
    "write it with torch ops TorchTPU has (those it lacks: tpurec/emulation/torchtpu_kernels.json, "
    "`fallback_ops`), or run it on the host before the batch goes to the device"
)


class MissingTpuKernel(UserError, NotImplementedError):
    """The user's code reached an op TorchTPU 0.2.0 has no kernel for. A NotImplementedError too, as
    TorchTPU's own error is."""


def _user_frame() -> tuple[FrameType, FrameType | None] | None:
    """(the innermost frame of the user's code on the stack, the frame it called), or None where
    tpurec's own code (outside the emulation) made the call first."""
    from tpurec.planner.model_module import library_frame

    frame: FrameType | None = sys._getframe(1)
    called: FrameType | None = None
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(_TPUREC):
            if not path.startswith(os.path.join(_TPUREC, "emulation") + os.sep):
                return None  # tpurec called it: a bug, TorchTPU's error with its traceback
        elif not library_frame(frame.f_code.co_filename):
            return frame, called
        called, frame = frame, frame.f_back
    return None


def _where(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    rel = os.path.relpath(path)
    return f"{rel if not rel.startswith('..') else path}:{frame.f_lineno}"


def _called_name(called: FrameType | None) -> str | None:
    """The library function the user's line called ("JaggedTensor.to_padded_dense"); None where it
    called the op itself (torch.ops.*, torch's op wrappers)."""
    if called is None:
        return None
    module = called.f_globals.get("__name__", "")
    return None if module == "torch" or module.startswith("torch.") else called.f_code.co_qualname


def error(op: str, torchtpu_says: str) -> NotImplementedError:
    """The exception for `op` missing on the device: MissingTpuKernel (one line) when the user's code
    called it, else TorchTPU's own words (`torchtpu_says`)."""
    found = _user_frame()
    if found is None:
        return NotImplementedError(torchtpu_says)
    frame, called = found
    name = _called_name(called)
    what = f"{name} calls {op}, which" if name else op
    instead = next((text for prefix, text in _INSTEAD.items() if op.startswith(prefix)), _GENERIC)
    return MissingTpuKernel(
        f"{_where(frame)}: {what} has no TorchTPU 0.2.0 kernel (its CPU fallback is off: on a TPU this line "
        f"fails on every rank); {instead}"
    )
