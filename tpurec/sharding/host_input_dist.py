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
"""

from __future__ import annotations

import torch

from tpurec.runtime import host_copies
from tpurec.sharding.sharded_host import ShardedHost

_HOST = torch.device("cpu")


class HostInputDistMixin(ShardedHost):
    """Mixed into a TorchRec sharded EBC/EC (before it in the bases)."""

    def input_dist(self, ctx, features, *args, **kwargs):
        return super().input_dist(ctx, host_copies.to_host(features, "ids"), *args, **kwargs)

    def _create_input_dist(self, *args, **kwargs) -> None:
        shardings = list(getattr(self, "_embedding_shardings", None) or self._sharding_type_to_sharding.values())
        saved = [(self, self._device)] + [(s, s._device) for s in shardings]
        try:
            for owner, _ in saved:
                owner._device = _HOST
            super()._create_input_dist(*args, **kwargs)
        finally:
            for owner, device in saved:
                owner._device = device
