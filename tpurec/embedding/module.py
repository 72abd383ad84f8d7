"""SparseCoreEmbeddingBagCollection: a drop-in EmbeddingBagCollection with a fused SparseCore optimizer.

Same inputs (KeyedJaggedTensor), same output (KeyedTensor in the same key order), same state_dict
keys (`embedding_bags.<table>.weight`, natural row order) as torchrec's EmbeddingBagCollection, so
`load_state_dict` works both ways between the two. Backward through the output updates the tables
in place with the optimizer given at construction; `fused_optimizer` holds its state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tpurec.embedding import natural_state, table_params
from tpurec.embedding.dtypes import table_dtype
from tpurec.embedding.fused_optimizer import SparseCoreFusedOptimizer
from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
from tpurec.embedding.kernel_table import POOLINGS
from tpurec.embedding.optimizers.registry import spec_from_torch
from tpurec.embedding.preprocessed import PreprocessedFeatures
from tpurec.embedding.settings import KernelSettings
from tpurec.embedding.sparsecores import resolve_num_sparsecores
from tpurec.embedding.vbe import expand_to_batch, pad_to_common_batch
from tpurec.errors import UserError

if TYPE_CHECKING:
    from torchrec.distributed.types import CacheParams

    from tpurec.embedding.preprocess import PreprocessStats


def kernel_tables(tables: Sequence[EmbeddingBagConfig], pooling_factors: dict | None = None) -> list[KernelTable]:
    """pooling_factors: expected ids per sample by table name (they place each stack's tables)."""
    pooling_factors = pooling_factors or {}
    unknown = sorted(set(pooling_factors) - {t.name for t in tables})
    if unknown:
        raise UserError(f"pooling_factors name tables this collection does not have: {unknown}")
    for name, pf in pooling_factors.items():
        if not (isinstance(pf, (int, float)) and math.isfinite(pf) and pf >= 0):
            raise UserError(f"pooling_factors[{name!r}] = {pf!r}: expected ids per sample, a finite number >= 0")
    out = []
    for t in tables:
        if t.pooling not in POOLINGS:
            raise UserError(f"table {t.name!r}: pooling {t.pooling} is not supported (SUM or MEAN)")
        out.append(
            KernelTable(
                t.name,
                t.num_embeddings,
                t.embedding_dim,
                tuple(t.feature_names),
                t.pooling,
                dtype=table_dtype(t.data_type, t.name),
                expected_ids=float(pooling_factors[t.name]) if t.name in pooling_factors else None,
                init_min=t.weight_init_min,
                init_max=t.weight_init_max,
            )
        )
    return out


class SparseCoreEmbeddingBagCollection(nn.Module, FusedOptimizerModule):
    STATE_PREFIX = "embedding_bags"  # state_dict keys embedding_bags.<table>.weight, as TorchRec's EBC

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        optimizer: type,
        optimizer_kwargs: dict | None = None,
        num_sparsecores: int | None = None,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        allow_id_dropping: bool = False,
        stack_tables: bool = True,
        fixed_limits: bool | None = None,
        pad_dims: bool | None = None,
        widen_tables: bool | None = None,
        settings: KernelSettings | None = None,
        pooling_factors: dict[str, float] | None = None,
        cache_params: Mapping[str, CacheParams | None] | None = None,
    ) -> None:
        """pooling_factors: expected ids per sample by table name, as in TorchRec's
        ParameterConstraints; with them each stack places its tables so that the SparseCore
        partitions share the ids (tpurec/embedding/stack_order.py). Results do not depend on it.
        cache_params: tables to keep on the host tier, by name, each with TorchRec's CacheParams (its
        load_factor and algorithm; None: the defaults): the table and its optimizer state in host
        memory, a cache of its rows in the kernel (docs/host_tier.md). Results do not depend on it."""
        super().__init__()
        from tpurec.embedding.backend import select_device

        self._device = select_device(device)
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        kernel_class: Callable[..., SparseCoreKernel] = SparseCoreKernel
        extra: dict[str, Any] = {}
        if cache_params:
            from tpurec.embedding.host_tier.kernel import HostTierKernel

            kernel_class, extra = HostTierKernel, {"cache_params": cache_params}
        self.kernel = kernel_class(
            kernel_tables(tables, pooling_factors),
            spec_from_torch(optimizer, optimizer_kwargs),
            resolve_num_sparsecores(num_sparsecores, self._device.type),
            is_weighted=is_weighted,
            device=self._device,
            settings=KernelSettings.of(
                settings,
                max_ids_per_partition=max_ids_per_partition,
                max_unique_ids_per_partition=max_unique_ids_per_partition,
                allow_id_dropping=allow_id_dropping,
                stack_tables=stack_tables,
                fixed_limits=fixed_limits,
                pad_dims=pad_dims,
                widen_tables=widen_tables,
            ).for_tables((t.name for t in self._embedding_bag_configs), "this SparseCoreEmbeddingBagCollection"),
            **extra,
        )
        self._fused_optimizer = SparseCoreFusedOptimizer(self.kernel)
        natural_state.register(self)
        table_params.register(self)  # named_parameters() lists the tables, as TorchRec's does

    # -- torchrec EBC surface ------------------------------------------------------------------
    def preprocess(self, features: KeyedJaggedTensor) -> PreprocessedFeatures:
        """The host half of `forward(features)`, to run ahead of (and outside) a compiled step."""
        if features.variable_stride_per_key():
            raise UserError(
                "a batch per feature (VBE KJT) cannot be preprocessed ahead of a compiled step yet: call forward "
                "with the KJT"
            )
        return PreprocessedFeatures(self.kernel.preprocess(features), features.stride())

    def forward(self, features: KeyedJaggedTensor | PreprocessedFeatures) -> KeyedTensor:
        """features: a KJT, or what `preprocess` built from one (then only the device half runs; per-id
        weights that require grad need the KJT)."""
        kernel = self.kernel  # (once: nn.Module's __getattr__ costs ~4 us a read, pooling 1 feels it)
        if isinstance(features, PreprocessedFeatures):
            values = kernel.lookup(features.inputs, features.batch)
        elif features.variable_stride_per_key():
            # a batch per feature (VBE): pooled per feature's own bags, then expanded to the full
            # batch by the KJT's inverse indices, as TorchRec's EmbeddingBagCollection does
            padded = kernel(pad_to_common_batch(features))
            values = expand_to_batch(padded, features, kernel.feature_dims, kernel.feature_order)
        else:
            values = kernel(features)
        return KeyedTensor(
            keys=list(kernel.feature_order),
            length_per_key=list(kernel.feature_dims),
            values=values,
            key_dim=1,
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def fused_optimizer(self) -> SparseCoreFusedOptimizer:
        return self._fused_optimizer

    def table_weight(self, name: str) -> torch.Tensor:
        """One table in natural row order: a view of the live storage."""
        return self.kernel.read_weight(name)

    def id_stats(self) -> dict[str, PreprocessStats]:
        """PreprocessStats of the last batch, per stack: observed ids per partition, for tuning limits."""
        return dict(self.kernel.last_stats)
