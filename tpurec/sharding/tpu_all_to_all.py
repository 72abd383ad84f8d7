"""Uneven all-to-alls on a TPU: TorchRec's padding, the one mode the TPU path runs.

TorchRec's input distribution (KJT lengths and ids) and pooled-embedding output are uneven
all-to-alls: ranks send different amounts. TorchRec 1.9.2 pads them itself whenever
`torch.tpu.is_available()` (`torchrec/experimental/torch_tpu/uneven_all_to_all.py`, called from
`dist_data.py` and `comm_ops.py`), after reporting an abort of the unpadded path at world 32
(torchrec #4646, #4704). TorchTPU 0.2.0's own uneven path, `ProcessGroupTpu::AllToAllBaseUnevenSplits`,
refuses asymmetric buffer sizes across ranks ("asymmetric input buffer sizes across ranks are not
supported on TPU.", `strings` of its glue library), and a pooled output's buffers are asymmetric
whenever ranks hold different sums of embedding dims. So:

* "padded" (default): TorchRec's own padding runs, as TorchRec decides on a TPU; its authors run it
  on TPUs, at the price of an extra metadata all-gather and padded bytes per uneven all-to-all.
  Only for tensors on the TPU: the ids' all-to-all runs on the host over gloo (host_input_dist.py),
  which takes uneven splits as they are;
* "uneven" (the splits handed to the backend unpadded): what CPU ranks do anyway (gloo takes uneven
  splits), so accepted there; refused on the TPU path (a tpu device or an emulated TPU rank) with
  TorchTPU's reason, as soon as the choice is known (`check`).

Chosen by `tpurec.DistributedModelParallel(..., uneven_all_to_all=)` or `TPUREC_TPU_ALL_TO_ALL`;
installed on the TPU path only (CPU ranks never take TorchRec's TPU branches). Not yet run on TPU
hardware.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind

ENV = "TPUREC_TPU_ALL_TO_ALL"
MODES = ("padded", "uneven")
_HOOKS = ("maybe_kjt_a2a_uneven_tpu", "maybe_all2all_pooled_uneven_tpu")
_originals: dict = {}
_padded_calls = 0


def _counting(padded: Callable[..., Any]) -> Callable[..., Any]:
    def padded_all_to_all_single(*args: Any, **kwargs: Any) -> Any:
        global _padded_calls
        _padded_calls += 1
        return padded(*args, **kwargs)

    return padded_all_to_all_single


UNEVEN_ON_TPU = (
    "TorchTPU 0.2.0's ProcessGroupTpu::AllToAllBaseUnevenSplits refuses asymmetric buffer sizes across ranks "
    '("asymmetric input buffer sizes across ranks are not supported on TPU."), and pooled embedding outputs '
    "have them whenever ranks hold different sums of embedding dims"
)


def check(mode: str | None, kind: DeviceKind) -> str:
    """The uneven all-to-all mode chosen (`mode`, else $TPUREC_TPU_ALL_TO_ALL, else "padded") for ranks
    of `kind`. UserError (one line) for an unknown mode, and for "uneven" on the TPU path."""
    where = f"uneven_all_to_all={mode!r}" if mode else f"{ENV}={os.environ.get(ENV)}"
    mode = mode or os.environ.get(ENV) or "padded"
    if mode not in MODES:
        raise UserError(f"uneven all-to-all mode {mode!r} (or {ENV}) must be one of {', '.join(MODES)}")
    if mode == "uneven" and kind == DeviceKind.TPU:
        raise UserError(
            f"{where} is refused on a TPU: {UNEVEN_ON_TPU}; leave it unset for 'padded' (TorchRec's padding)"
        )
    return mode


def select(mode: str | None = None) -> str:
    """On the TPU path: check `mode` (`check`; "uneven" is refused) and install TorchRec's padding
    for this process, counting its calls; returns the mode ("padded")."""
    mode = check(mode, DeviceKind.TPU)
    from torchrec.experimental.torch_tpu import uneven_all_to_all as hooks

    if not _originals:
        _originals.update({name: getattr(hooks, name) for name in (*_HOOKS, "padded_all_to_all_single")})
        hooks.padded_all_to_all_single = _counting(_originals["padded_all_to_all_single"])
    for name in _HOOKS:
        setattr(hooks, name, _originals[name])
    hooks.maybe_kjt_a2a_uneven_tpu = _padded_on_device_only(_originals["maybe_kjt_a2a_uneven_tpu"])
    return mode


def _padded_on_device_only(padded_kjt_all_to_all: Callable[..., Any]) -> Callable[..., Any]:
    """TorchRec pads a KJT all-to-all whenever torch.tpu is available; ids kept on the host
    (tpurec.sharding.host_input_dist) go over gloo, which takes uneven splits: no padding there."""
    from tpurec.runtime.host_copies import on_device

    def maybe_kjt_a2a_uneven_tpu(group: Any, input_tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if not any(on_device(t) for t in input_tensors):
            return None
        return padded_kjt_all_to_all(group, input_tensors, *args, **kwargs)

    return maybe_kjt_a2a_uneven_tpu


def padded_calls() -> int:
    """TorchRec's padded all-to-alls run in this process so far (after `select`)."""
    return _padded_calls
