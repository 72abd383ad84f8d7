"""HostTierKernel: a SparseCore kernel some of whose tables live on the host tier.

A host-tier table is, to the kernel underneath, a table of `cached_rows` rows: its cache. The whole
table and its optimizer state live in host memory (`TableTier`). Before each batch's lookup (the
forward, or `preprocess` ahead of a compiled step) the batch's ids of those tables are mapped to
cache slots, loading the rows missing; the kernel then runs unchanged on the remapped ids. The cache
is the kernel's own storage, on the CPU or a TPU (there its copies take a few fixed shapes, all
compiled when the kernel is made: device_copies.py); the host table, the slot map, the policy and the
counters stay in host memory.

Everything that reads or writes a table as a whole (`read_weight`, `write_weight`, `read_state`,
`write_state`: state_dict, the fused optimizer's state, checkpoints, named_parameters) gets the
host table, made whole first (`TableTier.flush`), so what users see is the whole table, coherent,
and a checkpoint written into those views in place is what the next step reads: host tensors, with
the kernel on a TPU too.

Not here yet (docs/host_tier.md): inputs built ahead on other threads (the lookups build them at
step time instead), trainable per-id weights, EmbeddingCollections (unpooled kernels).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import torch

from tpurec.embedding.host_tier.host_rows import Rows, host_rows, warm_up
from tpurec.embedding.host_tier.kjt_remap import remap_kjt
from tpurec.embedding.host_tier.params import host_tier_params
from tpurec.embedding.host_tier.table_tier import CacheCounters, TableTier
from tpurec.embedding.kernel import SparseCoreKernel
from tpurec.embedding.kernel_input import StackInput
from tpurec.embedding.kernel_table import KernelTable
from tpurec.embedding.kjt_checks import check_kjt
from tpurec.embedding.optimizers.base import OptimizerSpec
from tpurec.errors import UserError
from tpurec.runtime import host_copies
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from torchrec.distributed.types import CacheParams
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.kernel_protocol import KernelFactory


class HostTierKernel(SparseCoreKernel):
    def __init__(
        self,
        tables: Sequence[KernelTable],
        optimizer: OptimizerSpec,
        num_sc_per_device: int,
        *,
        cache_params: Mapping[str, CacheParams | None],
        **keywords: Any,
    ) -> None:
        """cache_params: the host-tier tables by kernel table name, each with its TorchRec CacheParams
        (None: the defaults, params.py); the other tables stay resident. The rest: SparseCoreKernel's."""
        unknown = sorted(set(cache_params) - {t.name for t in tables})
        if unknown:
            raise UserError(f"cache_params name tables this kernel does not have: {unknown}")
        params = {
            t.name: host_tier_params(t.source or t.name, t.num_embeddings, cache_params[t.name])
            for t in tables
            if t.name in cache_params
        }
        # the kernel's own table is the cache; the initial values' bound stays the whole table's
        cached = [
            replace(t, num_embeddings=params[t.name].cached_rows, init_rows=t.init_rows or t.num_embeddings)
            if t.name in params
            else t
            for t in tables
        ]
        super().__init__(cached, optimizer, num_sc_per_device, **keywords)  # (draws no values: reset_parameters)
        # each feature's table as the user sized it: ids are checked against its rows
        self._full_table_of = {f: t for t in tables for f in t.feature_names}
        tiers = {}
        for name, p in params.items():
            dtype = self.stacks[self._stack_of[name]].layout.dtype
            host = host_rows(p.rows, self._table[name].embedding_dim, dtype, optimizer)
            tiers[name] = TableTier(self._table[name].source or name, p, host)
            warm_up(host, self._cache(name))  # on a TPU: each copy's shapes compiled now, not mid-run
        self.host_tier = tiers
        self.reset_parameters()  # every table in order, host-tier ones into the host: the resident kernel's draws

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.host_tier is None:  # inside SparseCoreKernel.__init__: the host tables do not exist yet
            return
        super().reset_parameters()

    # -- the batch's ids, mapped to cache slots -----------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return super().forward(self._mapped(features))

    def preprocess(self, features: KeyedJaggedTensor) -> list[StackInput]:
        """SparseCoreKernel.preprocess of the batch mapped to cache slots: call it for the batch the
        next lookup runs (it loads and evicts rows), as a compiled step's host half does."""
        return super().preprocess(self._mapped(features))

    def preprocess_blocks(self, blocks: list[KeyedJaggedTensor]) -> list[StackInput]:
        raise UserError("several batches as one step (preprocess_blocks) are not supported on the host tier yet")

    def _mapped(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        features = host_copies.to_host(features, "ids")
        check_kjt(features)
        weights = features.weights_or_none()
        if self.is_weighted and weights is not None and weights.requires_grad and torch.is_grad_enabled():
            raise UserError(
                f"tables {sorted(self._tier.keys())} on the host tier: trainable per-id weights (a "
                "FeatureProcessedEmbeddingBagCollection's) are not supported on the host tier yet"
            )
        keys = features.keys()
        key_features = list(self.feature_order[: len(keys)]) if self.positional else list(keys)
        grad = torch.is_grad_enabled()  # the batch's update will run: its rows stay until it has

        def map_ids(table: str, ids: np.ndarray) -> np.ndarray:
            return self._tier[table].map_ids(ids, self._step_of(table), grad, self._cache(table))

        return remap_kjt(features, key_features, self._full_table_of, self._tier, map_ids)

    @property
    def _tier(self) -> dict[str, TableTier]:
        assert self.host_tier is not None  # set in __init__, before any batch
        return self.host_tier

    def _step_of(self, table: str) -> int:
        return self._steps[self._stack_of[table]]

    def _cache(self, table: str) -> Rows:
        """The cache of `table`: the kernel's own storage of it."""
        states = {s: super(HostTierKernel, self).read_state(table, s) for s in self.optimizer.state_names}
        return Rows(super().read_weight(table), states)

    # -- whole tables: the host's, made whole first ------------------------------------------------
    def _flushed_host(self, table: str) -> Rows | None:
        tier = self.host_tier.get(table) if self.host_tier is not None else None
        if tier is None:
            return None
        tier.flush(self._step_of(table), self._cache(table))
        return tier.host

    def read_weight(self, table: str) -> torch.Tensor:
        host = self._flushed_host(table)
        return super().read_weight(table) if host is None else host.weight

    def read_state(self, table: str, name: str) -> torch.Tensor:
        host = self._flushed_host(table)
        return super().read_state(table, name) if host is None else host.states[name]

    def write_weight(self, table: str, value: torch.Tensor) -> None:
        host = self._flushed_host(table)
        if host is None:
            super().write_weight(table, value)
        else:
            _write(host.weight, value, table)

    def write_state(self, table: str, name: str, value: torch.Tensor) -> None:
        host = self._flushed_host(table)
        if host is None:
            super().write_state(table, name, value)
        else:
            _write(host.states[name], value, table)

    def host_tier_counters(self) -> dict[str, CacheCounters]:
        """Each host-tier table's cache counters (hits, misses, evictions, write-backs, flushes)."""
        return {name: tier.counters for name, tier in self._tier.items()}


def _write(target: torch.Tensor, value: torch.Tensor, table: str) -> None:
    if value.shape != target.shape:
        raise UserError(f"table {table!r}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
    if value.data_ptr() != target.data_ptr():  # a view handed out and loaded in place is already there
        with torch.no_grad():
            target.copy_(value)


def host_tier_factory(pooled: KernelFactory | None, tables: list[str], device: torch.device | None) -> KernelFactory:
    """The kernel class of a sharded lookup group holding host-tier `tables`: HostTierKernel over the
    pooled kernel every kind shares (kernel_kinds.py), its cache on the CPU or a TPU; `pooled` None
    (an EmbeddingCollection's unpooled lookup) and other devices are refused: not there yet
    (docs/host_tier.md)."""
    if pooled is None:
        refuse_unpooled(tables)
    if device is not None and device.type not in (DeviceKind.CPU, DeviceKind.TPU):
        raise UserError(
            f"tables {tables}: the host tier (compute kernel fused_uvm_caching) runs on the CPU and a TPU only so "
            f"far, not on {device.type}; plan them on another kernel (fused) there"
        )
    if pooled is not SparseCoreKernel:  # a kind with its own pooled class would need its own host tier
        raise ValueError(f"the host tier extends SparseCoreKernel, not {pooled}")
    return cast("KernelFactory", HostTierKernel)


def refuse_unpooled(tables: list[str]) -> NoReturn:
    """An EmbeddingCollection's `tables` asked for the host tier: refused, its kernel has none yet."""
    raise UserError(
        f"tables {tables}: the host tier (compute kernel fused_uvm_caching) runs EmbeddingBagCollection tables "
        "only so far, not an EmbeddingCollection's; plan them on another kernel (fused)"
    )
