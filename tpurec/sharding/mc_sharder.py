"""Managed-collision modules (TorchRec's MC-EBC / MC-EC) sharded with the SparseCore kernels inside.

TorchRec composes them itself: `ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=...)` shards the
inner collection with the given sharder and the `ManagedCollisionCollection` (the id remap and its
eviction) with its own, and its sharded module runs the remap's input distribution, the remap, the
eviction and then the inner collection's lookup (`torchrec/distributed/mc_embedding_modules.py`). The remap
runs where the ids are, before the SparseCore input build; evicted rows are reset through the group
kernels' `_emb_module` (tpurec/sharding/evicted_rows.py), as FBGEMM's TBE resets them.

The changes to TorchRec's sharders: their compute kernels are the inner sharder's (TorchRec lists
FBGEMM's), so plans for them name tpurec's kernel; and on a TPU the remap stays on the host. TorchRec
builds the `ManagedCollisionCollection` (its identities, eviction metadata, input all-to-all) on the
compute device; tpurec's input distribution keeps ids on the host until the SparseCore input build, so
the remap is built on the host (`HostManagedCollisionCollectionSharder`): no id crosses to the device
unremapped, and nothing of the remap is a device program. Evicted rows are re-initialised as TorchRec
does (`init_fn` of the rows), drawn on the host on a TPU so the draws are the CPU's. Sharding types are
TorchRec's: row-wise only (the remap's own sharding, `ManagedCollisionCollectionSharder.sharding_types`).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

import torch
from torch import nn
from torchrec.distributed.mc_embedding import (
    ShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.mc_embeddingbag import (
    ShardedManagedCollisionEmbeddingBagCollection,
)
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder, ShardedManagedCollisionCollection

from tpurec.planner.planners import TpuPlanningMCEBCSharder, TpuPlanningMCECSharder
from tpurec.runtime.device import DeviceKind
from tpurec.sharding.ec_sharder import SparseCoreECSharder
from tpurec.sharding.evicted_rows import write_rows
from tpurec.sharding.sharder import SparseCoreEBCSharder

_HOST = torch.device("cpu")


class HostShardedManagedCollisionCollection(ShardedManagedCollisionCollection):
    """TorchRec's sharded remap, built on the host. Its input all-to-alls take their block sizes from the
    embedding shardings' device (`sharding._device`, the TPU's): moved to the host when they are made
    (at the first batch), else every step would copy them back to the host ids."""

    def _create_managed_collision_modules(self, module: Any) -> None:
        """TorchRec's per-rank remap modules; a multi-probe hash remap (`HashZchManagedCollisionModule`)
        inserts ids with tpurec's host insert (tpurec/embedding/zero_collision_hash.py: FBGEMM's CUDA
        kernel one id at a time), since fbgemm-gpu-cpu's kernel only looks ids up; lookups stay FBGEMM's."""
        super()._create_managed_collision_modules(module)
        # a model holding one has imported its class: never imported here, since importing it runs
        # `torch.jit.script` (torchrec/modules/hash_mc_evictions.py), whose FutureWarning every rank printed
        hash_mc = sys.modules.get("torchrec.modules.hash_mc_modules")
        if hash_mc is None:
            return
        from tpurec.embedding.zero_collision_hash import zero_collision_hash

        for mcm in self._managed_collision_modules.values():
            if isinstance(mcm, hash_mc.HashZchManagedCollisionModule):
                mcm._zero_collision_hash = zero_collision_hash

    def _create_input_dists(self, input_feature_names: List[str]) -> None:
        super()._create_input_dists(input_feature_names)
        for input_dist in self._input_dists:
            if isinstance(input_dist, nn.Module):
                input_dist.to(_HOST)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """Module.to/cuda/... of a model holding the remap leave its tensors on the host. TorchRec's DMP
        moves its whole wrapped module to the compute device before DDP wraps it when the model has dense
        parameters (`DefaultDataParallelWrapper`: `module.to(device)`): the remap's identities and eviction
        metadata would follow to the TPU, and the host ids meet them there. A conversion whose result
        leaves the host (probed on an empty tensor) is skipped; others (a dtype, share_memory) apply."""

        def on_host(t: torch.Tensor) -> torch.Tensor:
            return t if fn(t.new_empty(0)).device.type != DeviceKind.CPU else fn(t)

        return super()._apply(on_host, recurse)


class HostManagedCollisionCollectionSharder(ManagedCollisionCollectionSharder):
    """TorchRec's remap sharder, building the sharded remap on the host whatever the compute device."""

    def shard(
        self,
        module: Any,
        params: Any,
        env: Any,
        embedding_shardings: Any,
        device: torch.device | None = None,
        use_index_dedup: bool = False,
    ) -> Any:
        return HostShardedManagedCollisionCollection(
            module,
            params,
            env=env,
            device=_HOST,
            embedding_shardings=embedding_shardings,
            use_index_dedup=use_index_dedup,
            restore_dedup_feature_boundary=self._restore_dedup_feature_boundary,
        )


def _host_remap(mc_sharder: ManagedCollisionCollectionSharder | None) -> ManagedCollisionCollectionSharder:
    if mc_sharder is None or type(mc_sharder) is ManagedCollisionCollectionSharder:
        return HostManagedCollisionCollectionSharder()
    return mc_sharder  # a user's own remap sharder: theirs to place


class _HostRemapMixin:
    """What TorchRec's sharded MC module keeps on the compute device for the remap, on the host instead:
    the per-table index tensors it passes to the reset (so reading them is no device->host copy), and
    the re-init of evicted rows drawn on the host on a TPU."""

    _embedding_module: Any
    _table_to_tbe_and_index: Dict[str, Any]
    _buffer_ids: torch.Tensor
    bagged: bool

    def _indices_on_host(self) -> None:
        for lookup in self._embedding_module._lookups:
            for emb_module in lookup._emb_modules:
                for i, table in enumerate(emb_module._config.embedding_tables):
                    tbe = self._table_to_tbe_and_index[table.name][0]
                    self._table_to_tbe_and_index[table.name] = (tbe, torch.tensor([i], dtype=torch.int))
        self._buffer_ids = torch.tensor([0], dtype=torch.int)

    def _evict(self, evictions_per_table: Dict[str, torch.Tensor | None]) -> None:
        tables = self._embedding_module.embedding_bags if self.bagged else self._embedding_module.embeddings
        on_host = all(p.device.type == DeviceKind.CPU for p in tables.parameters())
        if on_host:  # TorchRec's own eviction, as it runs on a CPU
            super()._evict(evictions_per_table)  # type: ignore[misc]
            return
        for table, rows in evictions_per_table.items():
            if rows is None:
                continue
            tbe, index = self._table_to_tbe_and_index[table]
            rows = rows.long()
            with torch.no_grad():
                tbe.reset_embedding_weight_momentum(
                    pruned_indices=rows,
                    pruned_indices_offsets=torch.tensor([0, rows.numel()]),
                    logical_table_ids=index,
                    buffer_ids=self._buffer_ids,
                )
                weight = tables.get_parameter(f"{table}.weight")
                init_fn = self._embedding_module._table_name_to_config[table].init_fn
                # TorchRec: weight[rows] = init_fn(weight[rows]); drawn on the host here (the CPU's draws,
                # no device->host copy of the rows), then written to the device
                fresh = init_fn(torch.empty(rows.numel(), weight.shape[1], dtype=weight.dtype))
                write_rows(weight.data, rows, fresh)  # fixed-shape chunks: no program per eviction size


class ShardedSparseCoreMCEBC(_HostRemapMixin, ShardedManagedCollisionEmbeddingBagCollection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._indices_on_host()


class ShardedSparseCoreMCEC(_HostRemapMixin, ShardedManagedCollisionEmbeddingCollection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._indices_on_host()


class SparseCoreMCEBCSharder(TpuPlanningMCEBCSharder):
    """TorchRec's managed-collision EBC sharder around tpurec's EBC sharder."""

    def __init__(
        self,
        ebc_sharder: SparseCoreEBCSharder,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            ebc_sharder=ebc_sharder, mc_sharder=_host_remap(mc_sharder), qcomm_codecs_registry=qcomm_codecs_registry
        )

    def shard(self, module: Any, params: Any, env: Any, device: Any = None, module_fqn: Any = None) -> Any:
        return ShardedSparseCoreMCEBC(
            module, params, ebc_sharder=self._e_sharder, mc_sharder=self._mc_sharder, env=env, device=device
        )


class SparseCoreMCECSharder(TpuPlanningMCECSharder):
    """TorchRec's managed-collision EC sharder around tpurec's EC sharder."""

    def __init__(
        self,
        ec_sharder: SparseCoreECSharder,
        mc_sharder: ManagedCollisionCollectionSharder | None = None,
        qcomm_codecs_registry: Dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            ec_sharder=ec_sharder, mc_sharder=_host_remap(mc_sharder), qcomm_codecs_registry=qcomm_codecs_registry
        )

    def shard(self, module: Any, params: Any, env: Any, device: Any = None, module_fqn: Any = None) -> Any:
        return ShardedSparseCoreMCEC(
            module, params, ec_sharder=self._e_sharder, mc_sharder=self._mc_sharder, env=env, device=device
        )
