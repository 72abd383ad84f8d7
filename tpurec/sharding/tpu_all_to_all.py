"""Uneven all-to-alls on a TPU: TorchRec's padding (the default) or TorchTPU's own uneven path.

TorchRec's input distribution (KJT lengths and ids) and pooled-embedding output are uneven
all-to-alls: ranks send different amounts. Two readings of what a TPU does with them disagree:
TorchTPU 0.2.0's binary has `ProcessGroupTpu::AllToAllBaseUnevenSplits`, while TorchRec 1.9.2 says
tpu_dist implements only even splits and pads them itself whenever `torch.tpu.is_available()`
(`torchrec/experimental/torch_tpu/uneven_all_to_all.py`, called from `dist_data.py` and
`comm_ops.py`), after reporting an abort of the uneven path at world 32 (torchrec #4646, #4704).
tpurec does not bet on either silently:

* "padded" (default): TorchRec's own padding runs, as TorchRec decides on a TPU; its authors run it
  on TPUs, at the price of an extra metadata all-gather and padded bytes per uneven all-to-all.
  Only for tensors on the TPU: the ids' all-to-all runs on the host over gloo (host_input_dist.py),
  which takes uneven splits as they are;
* "uneven": TorchRec's padding hooks answer "not uneven", which is TorchRec's own branch for the
  native call, so the uneven `all_to_all_single` goes to TorchTPU unpadded.

Chosen by `tpurec.DistributedModelParallel(..., uneven_all_to_all=)` or `TPUREC_TPU_ALL_TO_ALL`, on the
TPU path only (CPU ranks never take TorchRec's TPU branches). Not yet run on TPU hardware.
"""

from __future__ import annotations

import os

from tpurec.errors import UserError

ENV = "TPUREC_TPU_ALL_TO_ALL"
MODES = ("padded", "uneven")
_HOOKS = ("maybe_kjt_a2a_uneven_tpu", "maybe_all2all_pooled_uneven_tpu")
_originals: dict = {}
_padded_calls = 0


def _native(*args, **kwargs):
    return None  # TorchRec's "use the native path" answer


def _counting(padded):
    def padded_all_to_all_single(*args, **kwargs):
        global _padded_calls
        _padded_calls += 1
        return padded(*args, **kwargs)

    return padded_all_to_all_single


def select(mode: str | None = None) -> str:
    """Make `mode` (default: $TPUREC_TPU_ALL_TO_ALL, else "padded") the uneven all-to-all of this
    process; returns it. Raises UserError for an unknown mode."""
    mode = mode or os.environ.get(ENV) or "padded"
    if mode not in MODES:
        raise UserError(f"uneven all-to-all mode {mode!r} (or {ENV}) must be one of {', '.join(MODES)}")
    from torchrec.experimental.torch_tpu import uneven_all_to_all as hooks

    if not _originals:
        _originals.update({name: getattr(hooks, name) for name in (*_HOOKS, "padded_all_to_all_single")})
        hooks.padded_all_to_all_single = _counting(_originals["padded_all_to_all_single"])
    for name in _HOOKS:
        setattr(hooks, name, _native if mode == "uneven" else _originals[name])
    if mode == "padded":
        hooks.maybe_kjt_a2a_uneven_tpu = _padded_on_device_only(_originals["maybe_kjt_a2a_uneven_tpu"])
    return mode


def _padded_on_device_only(padded_kjt_all_to_all):
    """TorchRec pads a KJT all-to-all whenever torch.tpu is available; ids kept on the host
    (tpurec.sharding.host_input_dist) go over gloo, which takes uneven splits: no padding there."""
    from tpurec.runtime.host_copies import on_device

    def maybe_kjt_a2a_uneven_tpu(group, input_tensors, *args, **kwargs):
        if not any(on_device(t) for t in input_tensors):
            return None
        return padded_kjt_all_to_all(group, input_tensors, *args, **kwargs)

    return maybe_kjt_a2a_uneven_tpu


def padded_calls() -> int:
    """TorchRec's padded all-to-alls run in this process so far (after `select`)."""
    return _padded_calls
