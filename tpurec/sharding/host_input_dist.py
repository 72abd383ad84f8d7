"""The input distribution of tpurec's sharded modules runs on the host, wherever the tables live.

SparseCore preprocessing reads the ids on the host (their CSR buffers have data-dependent shapes),
so ids have no business on the TPU before it. TorchRec builds a sharded module's input distribution
for the module's device: the feature permutation index (`_features_order_tensor`) and row-wise
bucketisation's block sizes are allocated there, and its KJT all-to-all runs where the KJT is. On a
TPU that is one device->host copy per lookup and step, and a host KJT meeting device index tensors.
`HostInputDistMixin` builds the input distribution for the host instead: its index tensors on the
CPU, its all-to-alls on the process group's gloo half (`cpu:gloo,tpu:tpu_dist`), and a KJT handed in
on the device is brought to the host once, at the door, as a counted copy (tpurec.runtime.host_copies).
The output distribution (pooled or sequence embeddings) stays on the module's device.

Before the ids' first collective the ranks agree on their dtypes (`agree_id_dtypes`): gloo sizes a
transfer from the receiver's dtype, so one rank sending int32 or float32 ids while the others send
int64 aborted the whole job (SIGABRT, "Received data size doesn't match") before any check of the
KJT could run. Now every rank refuses the batch in one line naming which rank fed which dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tpurec.errors import UserError
from tpurec.runtime import host_copies
from tpurec.sharding.sharded_host import ShardedHost

_HOST = torch.device("cpu")


class HostInputDistMixin(ShardedHost):
    """Mixed into a TorchRec sharded EBC/EC (before it in the bases)."""

    def input_dist(self, ctx: Any, features: Any, *args: Any, **kwargs: Any) -> Any:
        features = host_copies.to_host(features, "ids")
        agree_id_dtypes(features, getattr(self._env, "process_group", None))
        out = super().input_dist(ctx, features, *args, **kwargs)
        divisor = getattr(ctx, "divisor", None)
        if isinstance(divisor, torch.Tensor) and divisor.device != self._device:
            # A mean-pooled table sharded row- or column-wise: TorchRec divides the pooled output (on the
            # module's device) by the ids per bag, counted here from the host KJT's lengths.
            ctx.divisor = divisor.to(self._device)
        return out

    def _init_mean_pooling_callback(self, *args: Any, **kwargs: Any) -> None:
        """TorchRec's index tensors of the mean-pooling divisor, on the host with the KJT they index (its
        dims per output, which TorchRec made with the output distribution on the device, too)."""
        device, self._device = self._device, _HOST
        try:
            super()._init_mean_pooling_callback(*args, **kwargs)
        finally:
            self._device = device
        self._dim_per_key = torch.tensor(self._embedding_dims, device=_HOST)

    def _create_input_dist(self, *args: Any, **kwargs: Any) -> None:
        shardings = list(getattr(self, "_embedding_shardings", None) or self._sharding_type_to_sharding.values())
        saved = [(self, self._device)] + [(s, s._device) for s in shardings]
        try:
            for owner, _ in saved:
                owner._device = _HOST
            super()._create_input_dist(*args, **kwargs)
        finally:
            for owner, device in saved:
                owner._device = device


# dtype <-> a small code for the dtype all-gather; a dtype not listed travels as len(_DTYPES) and is
# named by what this rank fed (a rank never needs another's unlisted name to refuse)
_DTYPES = (
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
)
_PARTS = ("ids (KJT values)", "lengths", "weights")


def _code(t: torch.Tensor | None) -> int:
    if t is None:
        return -1  # no weights: a rank sending weights while another does not breaks the all-to-all too
    return _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)


def _name(code: int) -> str:
    return "none" if code < 0 else str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "other"


def agree_id_dtypes(features: Any, pg: Any) -> None:
    """UserError on every rank of `pg` when the ranks' KJTs differ in the dtype of their ids, lengths
    or weights (or in having weights); nothing with one rank or no group.

    One all-gather of 3 int64 per rank, per sharded module and step, of its own: the first collective
    of TorchRec's input dist (its splits all-to-all) comes too late to carry the codes, since
    row-wise sharding first bucketizes the ids on each rank (fbgemm's block_bucketize, which has no
    float kernel): a rank feeding float ids failed there alone while the others waited in the
    all-to-all. Every rank gathers all codes, so all refuse together (a rank refusing alone would
    leave the others waiting in the next collective)."""
    if pg is None or not dist.is_initialized() or pg.size() < 2:
        return
    weights = features.weights_or_none()
    mine = torch.tensor([_code(features.values()), _code(features.lengths()), _code(weights)], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(pg.size())]
    dist.all_gather(everyone, mine, group=pg)
    table = torch.stack(everyone)  # [rank, part]
    for part, column in zip(_PARTS, table.T.tolist()):
        if len(set(column)) == 1:
            continue
        by_dtype: dict[int, list[int]] = {}
        for rank, code in enumerate(column):
            by_dtype.setdefault(code, []).append(rank)
        fed = "; ".join(
            f"{_name(code)} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            for code, ranks in sorted(by_dtype.items(), key=lambda kv: kv[1][0])
        )
        raise UserError(
            f"the ranks fed {part} of different dtypes ({fed}): every rank must feed the same dtype "
            "(int64 ids and lengths, as TorchRec's KeyedJaggedTensor makes them)"
        )
