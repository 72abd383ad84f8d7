"""SparseCoreEmbeddingCollection: a drop-in EmbeddingCollection with a fused SparseCore optimizer.

Same input (KeyedJaggedTensor), same output (a dict of JaggedTensors, one embedding per id, keyed
by TorchRec's embedding names: the feature, or "feature@table" for a feature shared by tables),
same `need_indices`, same state_dict keys (`embeddings.<table>.weight`, natural row order) as
torchrec's EmbeddingCollection, so `load_state_dict` works both ways. Backward through the outputs
updates the tables in place with the optimizer given at construction (`SparseCoreSequenceKernel`:
the pooled kernel with every id its own bag); `fused_optimizer` holds its state.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from tpurec.embedding import natural_state, table_params
from tpurec.embedding.dtypes import table_dtype
from tpurec.embedding.fused_optimizer import SparseCoreFusedOptimizer
from tpurec.embedding.kernel import KernelTable
from tpurec.embedding.kjt_checks import check_kjt
from tpurec.embedding.optimizers.registry import spec_from_torch
from tpurec.embedding.sequence_kernel import SparseCoreSequenceKernel
from tpurec.embedding.settings import KernelSettings
from tpurec.embedding.sparsecores import resolve_num_sparsecores
from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind


class SparseCoreEmbeddingCollection(nn.Module, FusedOptimizerModule):
    STATE_PREFIX = "embeddings"  # state_dict keys embeddings.<table>.weight, as TorchRec's EC

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        optimizer: type,
        optimizer_kwargs: dict | None = None,
        num_sparsecores: int | None = None,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        max_ids_per_feature: int | None = None,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        allow_id_dropping: bool = False,
        stack_tables: bool = True,
        fixed_limits: bool | None = None,
        pad_dims: bool | None = None,
        widen_tables: bool | None = None,
        settings: KernelSettings | None = None,
    ) -> None:
        super().__init__()
        from tpurec.embedding.backend import select_device

        self._device = select_device(device)
        self._embedding_configs = list(tables)
        self._need_indices = need_indices
        for t in self._embedding_configs:
            if not t.feature_names:  # as torchrec's EmbeddingCollection: a table without features feeds its name
                t.feature_names = [t.name]
        self._embedding_names_by_table = get_embedding_names_by_table(self._embedding_configs)
        dims = {t.embedding_dim for t in self._embedding_configs}
        if len(dims) > 1:
            raise UserError(
                "All tables in an EmbeddingCollection must have the same embedding dim (as in TorchRec); got "
                + ", ".join(f"{t.name}: {t.embedding_dim}" for t in self._embedding_configs)
            )
        self._embedding_dim = dims.pop() if dims else -1
        # Kernel slots are embedding names (unique even when tables share a feature); slot k reads the
        # input feature _slot_features[k].
        self._slot_names = [n for names in self._embedding_names_by_table for n in names]
        self._slot_features = [f for t in self._embedding_configs for f in t.feature_names]
        self.kernel = SparseCoreSequenceKernel(
            [
                KernelTable(
                    t.name, t.num_embeddings, t.embedding_dim, tuple(names), dtype=table_dtype(t.data_type, t.name)
                )
                for t, names in zip(self._embedding_configs, self._embedding_names_by_table)
            ],
            spec_from_torch(optimizer, optimizer_kwargs),
            resolve_num_sparsecores(num_sparsecores, self._device.type),
            device=self._device,
            settings=KernelSettings.of(
                settings,
                max_ids_per_feature=max_ids_per_feature,
                max_ids_per_partition=max_ids_per_partition,
                max_unique_ids_per_partition=max_unique_ids_per_partition,
                allow_id_dropping=allow_id_dropping,
                stack_tables=stack_tables,
                fixed_limits=fixed_limits,
                pad_dims=pad_dims,
                widen_tables=widen_tables,
            ).for_tables((t.name for t in self._embedding_configs), "this SparseCoreEmbeddingCollection"),
        )
        self.reset_parameters()
        self._fused_optimizer = SparseCoreFusedOptimizer(self.kernel, param_prefix="embeddings.")
        natural_state.register(self)
        table_params.register(self)  # named_parameters() lists the tables, as TorchRec's does

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each table's `init_fn` (TorchRec's default: uniform(+-sqrt(1/rows))) on its natural-order
        view, as torchrec's EmbeddingCollection applies it to its weight."""
        for t in self._embedding_configs:
            view = self.kernel.read_weight(t.name)
            if view.is_meta or t.init_fn is None:
                continue
            if view.device.type == DeviceKind.CPU and view.dtype == torch.float32 and view.is_contiguous():
                t.init_fn(view)
            else:  # drawn as TorchRec draws it (a contiguous tensor of the config's dtype), then stored
                fresh = torch.empty(t.num_embeddings, t.embedding_dim, dtype=table_dtype(t.data_type, t.name))
                t.init_fn(fresh)
                self.kernel.write_weight(t.name, fresh)

    # -- torchrec EmbeddingCollection surface ----------------------------------------------------
    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        if features.variable_stride_per_key():
            check_kjt(features)  # refuses it by name (the KJT rebuilt below would lose its batches)
        keys = features.keys()
        index = {k: j for j, k in enumerate(keys)}
        missing = sorted({f for f in self._slot_features if f not in index})
        if missing:
            raise KeyError(f"KeyedJaggedTensor lacks features {missing}; it has {keys}")
        perm = [index[f] for f in self._slot_features]
        slots = features if perm == list(range(len(keys))) else features.permute(perm)
        pieces = self.kernel.forward_per_feature(
            KeyedJaggedTensor(
                keys=self._slot_names, values=slots.values(), lengths=slots.lengths(), stride=slots.stride()
            )
        )
        out: Dict[str, JaggedTensor] = {}
        lengths = slots.lengths().view(len(self._slot_names), -1) if self._slot_names else None
        per_slot = lengths.sum(1).tolist() if lengths is not None else []
        ids = slots.values().split(per_slot) if self._need_indices else [None] * len(per_slot)
        for k, (name, piece) in enumerate(zip(self._slot_names, pieces)):
            assert lengths is not None  # there is a slot
            out[name] = JaggedTensor(values=piece, lengths=lengths[k], weights=ids[k])
        return out

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def fused_optimizer(self) -> SparseCoreFusedOptimizer:
        return self._fused_optimizer

    def table_weight(self, name: str) -> torch.Tensor:
        """One table in natural row order: a view of the live storage."""
        return self.kernel.read_weight(name)
