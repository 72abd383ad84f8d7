"""Managed-collision modules (TorchRec's MC-EBC / MC-EC) sharded with the SparseCore kernels inside.

TorchRec composes them itself: `ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=...)` shards the
inner collection with the given sharder and the `ManagedCollisionCollection` (the id remap and its
eviction) with its own, and its sharded module runs the remap's input distribution, the remap, the
eviction and then the inner collection's lookup (`torchrec/distributed/mc_embedding_modules.py`). The remap
runs where the ids are, before the SparseCore input build; evicted rows are reset through the group
kernels' `_emb_module` (tpurec/sharding/evicted_rows.py), as FBGEMM's TBE resets them.

The only change to TorchRec's sharders: their compute kernels are the inner sharder's (TorchRec lists
FBGEMM's), so plans for them name tpurec's kernel. Sharding types are TorchRec's: row-wise only (the
remap's own sharding, `ManagedCollisionCollectionSharder.sharding_types`).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

from torch import nn
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder

from tpurec.errors import UserError
from tpurec.sharding.ec_sharder import SparseCoreECSharder
from tpurec.sharding.sharder import SparseCoreEBCSharder


class SparseCoreMCEBCSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """TorchRec's managed-collision EBC sharder around tpurec's EBC sharder."""

    def __init__(
        self,
        ebc_sharder: SparseCoreEBCSharder,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(ebc_sharder=ebc_sharder, mc_sharder=mc_sharder, qcomm_codecs_registry=qcomm_codecs_registry)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._e_sharder.compute_kernels(sharding_type, compute_device_type)


class SparseCoreMCECSharder(ManagedCollisionEmbeddingCollectionSharder):
    """TorchRec's managed-collision EC sharder around tpurec's EC sharder."""

    def __init__(
        self,
        ec_sharder: SparseCoreECSharder,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(ec_sharder=ec_sharder, mc_sharder=mc_sharder, qcomm_codecs_registry=qcomm_codecs_registry)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return self._e_sharder.compute_kernels(sharding_type, compute_device_type)


def refuse_hash_zch_training(module: nn.Module) -> None:
    """A training model with TorchRec's multi-probe ZCH remap (`HashZchManagedCollisionModule`) is refused at
    DMP build: the remap runs on the host, and fbgemm-gpu-cpu's `zero_collision_hash` inserts no ids (its
    CPU kernel requires `readonly`: "Expected readonly to be true"), so its first training step would fail
    there, as stock TorchRec's does on a CPU."""
    # A model holding one has imported its class: never imported here, since importing it runs
    # `torch.jit.script` (torchrec/modules/hash_mc_evictions.py), whose FutureWarning every rank printed.
    hash_mc = sys.modules.get("torchrec.modules.hash_mc_modules")
    if hash_mc is None:
        return
    HashZchManagedCollisionModule = hash_mc.HashZchManagedCollisionModule  # noqa: N806

    for path, m in module.named_modules():
        if isinstance(m, HashZchManagedCollisionModule) and m.training:
            raise UserError(
                f"{path}: HashZchManagedCollisionModule cannot train here: its remap runs on the host and "
                "fbgemm-gpu-cpu's zero_collision_hash only looks ids up (readonly); use "
                "MCHManagedCollisionModule (LRU/LFU/DistanceLFU eviction)"
            )
