"""The compute kernels TorchRec's sharded lookups run for tpurec tables: one embedding kernel per group.

A `GroupedEmbeddingConfig` lists this rank's table shards (rows and columns after sharding) and the
features that feed them, in order. Every shard becomes a kernel table of its local size; inside the
shard, rows are MOD-partitioned over this device's SparseCores by the kernel. The fused optimizer
comes from the per-table fused params TorchRec derived from `apply_optimizer_in_backward`.

`SparseCoreEmbeddingBag` (pooled, for the sharded EmbeddingBagCollection) returns [batch, sum of
dims]; `SparseCoreEmbedding` (unpooled, for the sharded EmbeddingCollection) returns one row per id,
[ids, dim], as TorchRec's sequence kernels do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import FusedOptimizerModule

from tpurec.embedding import direct
from tpurec.embedding.dtypes import table_dtype
from tpurec.embedding.fused_optimizer import SparseCoreFusedOptimizer
from tpurec.embedding.host_tier.kernel import host_tier_factory
from tpurec.embedding.kernel_kinds import kernel_classes, kernel_kind
from tpurec.embedding.kernel_table import POOLINGS, KernelTable
from tpurec.embedding.optimizers.registry import spec_from_fused_params
from tpurec.embedding.preprocessed import PreprocessedFeatures
from tpurec.embedding.sequence_inputs import SequenceInputs
from tpurec.embedding.settings import KernelSettings
from tpurec.embedding.vbe import pad_to_common_batch, to_vbe_layout
from tpurec.embedding.weight_grad import with_weight_grad
from tpurec.errors import UserError
from tpurec.sharding.evicted_rows import EvictedRowsReset

if TYPE_CHECKING:
    from torchrec.distributed.types import CacheParams, ShardingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.kernel_protocol import EmbeddingKernel, KernelFactory, SequenceEmbeddingKernel


class _SparseCoreGroupKernel(BaseEmbedding, FusedOptimizerModule):
    """One group's tables on one embedding kernel (kernel_protocol.py); subclasses say whether lookups pool."""

    pooled = True
    kernel: EmbeddingKernel
    prepared_limit = 16  # inputs built ahead and kept until looked up (a pipeline's depth + slack)

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        num_sc_per_device: int,
        sharding_type: ShardingType | str | None = None,
        cache_params: Mapping[str, CacheParams] | None = None,
    ) -> None:
        """cache_params: the tables (by the user's name) on the host tier, with their CacheParams
        (tpurec/embedding/host_tier/); the group's shards of them keep their rows in host memory."""
        super().__init__()
        # Row-wise shards see only part of each bag: TorchRec sums there and divides by the full bag
        # length after the reduce-scatter (its mean-pooling callback), so the kernel must sum.
        rowwise = getattr(sharding_type, "value", sharding_type) in ("row_wise", "table_row_wise")
        self._config = config
        specs = {spec_from_fused_params(t.fused_params, t.name) for t in config.embedding_tables}
        if len(specs) != 1:
            raise ValueError(
                f"tables {[t.name for t in config.embedding_tables]} grouped together use different "
                f"fused optimizers {specs}; TorchRec groups tables by fused params, so this is a bug"
            )
        (spec,) = specs
        # Shard k of table t gets the kernel name "t/k" (a rank may hold several column shards of t)
        # and its features become slots "index:feature" (a feature repeats across those shards).
        self.shards: list[tuple[str, str, object]] = []  # (table, kernel name, ShardMetadata)
        tables, slot = [], 0
        seen: dict[str, int] = {}
        # Expected ids per sample by table (the `pooling_factors` fused param, which
        # tpurec.DistributedModelParallel fills from ParameterConstraints): they order the stack.
        expected = dict((config.embedding_tables[0].fused_params or {}).get("pooling_factors") or ())
        for t in config.embedding_tables:
            k = seen[t.name] = seen.get(t.name, -1) + 1
            kname = f"{t.name}/{k}"
            slots = []
            for f in t.feature_names:
                slots.append(f"{slot}:{f}")
                slot += 1
            if self.pooled and t.pooling not in POOLINGS:
                raise UserError(f"table {t.name!r}: pooling {t.pooling} is not supported (SUM or MEAN)")
            pooling = PoolingType.SUM if rowwise or not self.pooled else t.pooling
            tables.append(
                KernelTable(
                    kname,
                    t.local_rows,
                    t.local_cols,
                    tuple(slots),
                    pooling,
                    init_rows=t.num_embeddings,
                    init_min=t.weight_init_min,
                    init_max=t.weight_init_max,
                    dtype=table_dtype(t.data_type, t.name),
                    source=t.name,
                    source_features=tuple(t.feature_names),
                    row_offset=int(t.local_metadata.shard_offsets[0]) if t.local_metadata is not None else 0,
                    # a row shard gets its share of the table's ids (hashed ids spread over the rows)
                    expected_ids=(
                        float(expected[t.name]) * t.local_rows / max(t.num_embeddings, 1)
                        if t.name in expected
                        else None
                    ),
                )
            )
            self.shards.append((t.name, kname, t.local_metadata))
        fused = config.embedding_tables[0].fused_params or {}
        extra: dict[str, Any] = {"is_weighted": config.is_weighted} if self.pooled else {}
        # the kernel class for this device and chip (kernel_kinds.py)
        kind = kernel_classes(kernel_kind(device.type if device is not None else None))
        factory: KernelFactory = kind.pooled if self.pooled else kind.sequence
        cache_params = cache_params or {}
        on_host = {kname: cache_params[t] for t, kname, _ in self.shards if t in cache_params}
        if on_host:
            factory = host_tier_factory(
                kind.pooled if self.pooled else None,
                sorted({t for t, _, _ in self.shards if t in cache_params}),
                device,
            )
            extra["cache_params"] = on_host
        self.kernel = factory(
            tables,
            spec,
            num_sc_per_device,
            device=device,
            positional=True,
            **extra,
            # the one KernelSettings the sharder carries (KernelSettings.fused), whole
            settings=KernelSettings.from_fused(fused),
        )
        self._optim = SparseCoreFusedOptimizer(self.kernel, param_prefix="", key_of=self._param_key)
        # TorchRec's `output_dtype` fused param (an FBGEMM SparseType): its TBE kernels return lookups in
        # that dtype, so the output collectives carry it. The kernel computes in float32 (as TBE's CPU
        # kernel accumulates) and rounds once; autograd casts the gradient back.
        out = fused.get("output_dtype")
        self._output_dtype = out.as_dtype() if out is not None and hasattr(out, "as_dtype") else out
        if self._output_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise UserError(
                f"tables {[t.name for t in config.embedding_tables]}: output_dtype {out} is not supported "
                "(FP32, FP16 or BF16)"
            )
        self._prepared: list = []  # (KJT, SparseCore inputs) built ahead, oldest first
        self._prepared_lock = threading.Lock()
        self.prepared_hits = self.prepared_misses = 0

    @staticmethod
    def _param_key(kname: str) -> str:
        # TorchRec keys fused-optimizer params "<table>.weight"; the sharded EBC prefixes "embedding_bags.".
        return f"{kname.split('/')[0]}.weight" if kname.endswith("/0") else f"{kname}.weight"

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def _emb_module(self) -> EvictedRowsReset:
        # TorchRec's managed-collision modules reach a lookup's TBE here to reset evicted rows
        # (tpurec/sharding/evicted_rows.py).
        return EvictedRowsReset(self)

    @property
    def fused_optimizer(self) -> SparseCoreFusedOptimizer:
        return self._optim

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        out = self.kernel(features)
        return out if self._output_dtype in (None, out.dtype) else out.to(self._output_dtype)

    # -- SparseCore inputs built ahead (pooled lookups) -----------------------------------------
    def prepare(self, features: KeyedJaggedTensor) -> None:
        """Build the SparseCore inputs of a KJT this lookup will receive later (on a background
        thread, e.g. the input pipeline's), through the kernel's own `preprocess`. `forward` uses them
        when its KJT has the same ids, lengths and weights; otherwise it preprocesses inline.
        Nothing is built when the kernel's next step takes the direct CPU path (no SparseCore layout
        to build: embedding/direct.py), so a pipelined run takes the same path as an inline one, nor
        for a weighted lookup handed ids without weights (`_weights_come_later`), nor for a kernel with
        host-tier tables, whose inputs depend on the cache when the step runs (embedding/host_tier/)."""
        if direct.applies(self.kernel) or self._weights_come_later(features) or self.kernel.host_tier is not None:
            return
        features = _common_batch(features)  # kept as looked up: forward compares the padded KJT
        csrs = self.kernel.preprocess(features)
        with self._prepared_lock:
            self._prepared.append((features, csrs))
            del self._prepared[: -self.prepared_limit]

    def prepare_later(self, features: KeyedJaggedTensor, submit: Callable[..., Future]) -> None:
        """`prepare` on another thread: submit(fn, *args) returns a Future (an executor's submit);
        `forward` waits for it when its KJT matches. Nothing, as in `prepare`, on the direct path,
        while the weights are still to come, or on the host tier."""
        if direct.applies(self.kernel) or self._weights_come_later(features) or self.kernel.host_tier is not None:
            return
        features = _common_batch(features)
        future = submit(self.kernel.preprocess, features)
        with self._prepared_lock:
            self._prepared.append((features, future))
            del self._prepared[: -self.prepared_limit]

    def _weights_come_later(self, features: KeyedJaggedTensor) -> bool:
        """A weighted lookup's ids without weights: a FeatureProcessedEmbeddingBagCollection's, whose
        position weights its forward computes (trainable: nothing to build ahead; the kernel would refuse
        the KJT, which is not the one the lookup receives)."""
        return bool(self.kernel.is_weighted) and features.weights_or_none() is None

    def _take_prepared(self, features: Any) -> Any:
        with self._prepared_lock:
            for j, (kjt, csrs) in enumerate(self._prepared):
                if _same_ids(kjt, features):
                    del self._prepared[: j + 1]  # older ones were never looked up (e.g. skipped)
                    self.prepared_hits += 1
                    return csrs.result() if isinstance(csrs, Future) else csrs
        if self.training:  # a training lookup nothing was built ahead for
            self.prepared_misses += 1
        return None

    def clear_prepared(self) -> None:
        with self._prepared_lock:
            self._prepared.clear()

    def named_parameters_by_table(self) -> Iterator:
        # Tables live in the kernel's storage, as buffers; the sharded module registers their
        # parameters itself (tpurec/sharding/table_params.py) and publishes state_dict through its hooks.
        return iter(())

    def named_split_embedding_weights(self, *args: Any, **kwargs: Any) -> Iterator:
        return iter(())

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        # TorchRec's grouped lookups call their kernels' state_dict(destination, prefix, keep_vars)
        # positionally (torchrec/distributed/embedding_lookup.py), which torch's Module.state_dict
        # answers with a FutureWarning per lookup: taken here and passed on by keyword.
        return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def flush(self) -> None:
        pass

    def purge(self) -> None:
        pass


class SparseCoreEmbeddingBag(_SparseCoreGroupKernel):
    """Pooled: [batch, sum of the group's dims] (TorchRec's pooled lookups)."""

    pooled = True

    def forward(
        self,
        features: KeyedJaggedTensor,
        vbe_output_offsets: torch.Tensor | None = None,
        vbe_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[batch, sum of dims]; for a VBE batch (a batch per feature) FBGEMM's flat VBE layout, as
        TorchRec's sharded EBC expects it from its lookups (embedding/vbe.py). `vbe_output` and
        `vbe_output_offsets`: TorchRec's pre-allocated output of a lookup with several kernels."""
        padded = _common_batch(features)
        csrs = self._take_prepared(padded) if self._prepared else None
        if csrs is None:
            out = super().forward(padded)
        else:
            out = with_weight_grad(self.kernel, padded, self.kernel.lookup(csrs, padded.stride()))
            out = out if self._output_dtype in (None, out.dtype) else out.to(self._output_dtype)
        if padded is features:
            return out
        return to_vbe_layout(out, features, self._config.embedding_dims(), vbe_output, vbe_output_offsets)

    def lookup_preprocessed(self, features: PreprocessedFeatures) -> torch.Tensor:
        """`forward`'s device half on SparseCore inputs built ahead (tpurec/sharding/sharded_preprocess.py):
        traceable by torch.compile. Per-id weights that require grad need the KJT (`forward`)."""
        out = self.kernel.lookup(features.inputs, features.batch)
        return out if self._output_dtype in (None, out.dtype) else out.to(self._output_dtype)

    def assemble_raw(self, raw: list[torch.Tensor], features: PreprocessedFeatures) -> torch.Tensor:
        """`lookup_preprocessed`'s output from its stacks' lookup-op outputs computed earlier (a
        pipelined step's SparseCore forward, tpurec/sharding/step/pipelined.py)."""
        out = self.kernel.assemble(raw, features.batch)
        return out if self._output_dtype in (None, out.dtype) else out.to(self._output_dtype)

    def feature_keys(self) -> list[str]:
        """The KJT keys this lookup receives, in order (TorchRec passes a group's features in table
        order; a feature repeats for each column shard of its table held here)."""
        return [f for t in self._config.embedding_tables for f in t.feature_names]


class SparseCoreEmbedding(_SparseCoreGroupKernel):
    """Unpooled: one row per id, [ids, dim], in the KeyedJaggedTensor's values order (TorchRec's
    sequence lookups, which view it as [-1, dim])."""

    pooled = False
    kernel: SequenceEmbeddingKernel  # built as kernel_kinds' sequence class (`pooled` False)

    def preprocess_padded(self, features: KeyedJaggedTensor) -> SequenceInputs:
        """The kernel's fixed-shape lookup's host half (SparseCoreSequenceKernel.forward_padded; eager, ahead
        of a compiled step: tpurec/sharding/ec_preprocess.py)."""
        return self.kernel.preprocess_sequence(features)

    def lookup_padded(self, inputs: SequenceInputs) -> torch.Tensor:
        """Its device half: the lookup's whole output [rows, dim] (traceable by torch.compile)."""
        out = self.kernel.lookup_sequence(inputs)
        return out if self._output_dtype in (None, out.dtype) else out.to(self._output_dtype)

    def assemble_padded(self, raw: list[torch.Tensor], inputs: SequenceInputs) -> torch.Tensor:
        """`lookup_padded`'s output from its stacks' lookup-op outputs computed earlier (a pipelined step's
        SparseCore forward, tpurec/sharding/step/pipelined.py)."""
        kernel = self.kernel
        out = kernel.assemble(raw, inputs.capacity).reshape(inputs.rows(), kernel.dim)
        return out if self._output_dtype in (None, out.dtype) else out.to(self._output_dtype)


def _common_batch(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A VBE batch as the kernel takes it (one batch for all features, embedding/vbe.py); others as they are."""
    return pad_to_common_batch(features) if features.variable_stride_per_key() else features


def _same_ids(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    """Same stride, ids, lengths and weights: then the SparseCore inputs are the same too."""
    if a.stride() != b.stride() or a.values().shape != b.values().shape:
        return False
    if b.values().device != a.values().device:  # a TPU lookup's KJT against the host copy built ahead
        b = b.to(a.values().device)
    wa, wb = a.weights_or_none(), b.weights_or_none()
    if (wa is None) != (wb is None):
        return False
    return (
        torch.equal(a.lengths().to(torch.int64), b.lengths().to(torch.int64))
        and torch.equal(a.values().to(torch.int64), b.values().to(torch.int64))
        and (wa is None or wb is None or torch.equal(wa, wb))
    )
