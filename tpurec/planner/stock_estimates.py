"""TorchRec's own planner estimating tpurec's kernel: perf and storage for `customized_kernel`.

Stock `torchrec.distributed.DistributedModelParallel` and `shard_modules` without a plan build
`EmbeddingShardingPlanner(topology=...)` themselves, with TorchRec's default estimators, and those
refuse or misjudge our kernel:

* perf: `EmbeddingPerfEstimator` asks its `HardwarePerfConfig` for a device bandwidth per compute
  kernel and raises "Unrecognized or unsupported compute kernel: customized_kernel for hardware aware
  perf estimators". Its documented hook, a config registered with `EmbeddingPerfEstimatorFactory`,
  would have to replace TorchRec's default config for everyone (the planner always asks for the
  default name), and it sees one `ShardPerfContext` per shard: no optimizer, no topology.
* storage: `EmbeddingStorageEstimator` sizes every kernel with `compute_storage_usage` and a fixed
  optimizer multiplier, with no MOD padding and nothing for the SparseCore buffers, and 0 bytes of
  HBM on a "tpu" device; the sharder's `storage_usage` hook is no longer called in 1.9.2 (sharders
  are snapshotted into `SharderData`, which keeps only a `StorageUsageType`).

No extension point reaches both, so this module patches TorchRec, narrowly: the two `estimate`
methods are wrapped once, when a tpurec sharder is built (sharder.py). Options whose compute kernel
is `customized_kernel` get tpurec's cost model (`estimators.shard_cost`, the figures tpurec's own
planner plans with); every other option goes to TorchRec's method unchanged, the very same list
when none is ours. `customized_kernel` is TorchRec's value for kernels it does not know, which its
estimators could not price before either.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterator, List

import torch
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import Shard, SharderDataMap, ShardingOption

from tpurec.embedding.optimizers.registry import TORCHREC_DEFAULT_OPTIMIZER, spec_name_for, spec_names
from tpurec.errors import UserError
from tpurec.planner.estimators import ShardCost, option_costs, shard_perf, shard_storage, spec_of
from tpurec.planner.kernel_choice import COMPUTE_KERNEL

_ORIGINAL = "_tpurec_original"  # set on a wrapper: the TorchRec method it delegates to


# TorchRec's two estimators tpurec's costs stand in for; both keep the planner's topology.
_Estimator = EmbeddingPerfEstimator | EmbeddingStorageEstimator


def option_costs_for_torchrec(
    estimator: _Estimator, option: ShardingOption, sharder_data_map: SharderDataMap | None
) -> List[ShardCost]:
    """tpurec's cost of each shard of `option`, on the topology TorchRec's `estimator` plans for.

    The optimizer state counted is that of the table's own fused optimizer (`table_optimizer`).
    """
    topology = estimator._topology  # both TorchRec estimators keep the planner's topology here
    data = (sharder_data_map or {}).get(option.module_type_key)
    optimizer = table_optimizer(option.tensor, getattr(data, "fused_params", None))
    return option_costs(option, spec_of(topology), topology.world_size, optimizer, topology.compute_device)


def table_optimizer(weight: torch.Tensor, fused_params: Dict[str, Any] | None) -> str:
    """tpurec's name of the optimizer a table's fused update runs, resolved as the sharded module
    resolves it: the table's apply_optimizer_in_backward class (the one TorchRec's own storage
    estimator reads too), else the sharder's fused params' "optimizer", else EXACT_SGD."""
    classes = getattr(weight, "_optimizer_classes", None) or []
    given = classes[0].__name__ if classes else (fused_params or {}).get("optimizer")
    if given is None:
        return TORCHREC_DEFAULT_OPTIMIZER
    name = spec_name_for(str(getattr(given, "value", given)))  # an FBGEMM EmbOptimType has a value
    if name is None:
        raise UserError(f"optimizer {given!r} has no fused SparseCore update; one of {sorted(spec_names())}")
    return name


def _shard_costs(
    estimator: _Estimator, options: List[ShardingOption], data: SharderDataMap | None
) -> Iterator[tuple[Shard, ShardCost]]:
    for option in options:
        yield from zip(option.shards, option_costs_for_torchrec(estimator, option, data))


def _estimate_perf(estimator: _Estimator, options: List[ShardingOption], data: SharderDataMap | None) -> None:
    for shard, cost in _shard_costs(estimator, options, data):
        shard.perf = shard_perf(cost)


def _estimate_storage(estimator: _Estimator, options: List[ShardingOption], data: SharderDataMap | None) -> None:
    for shard, cost in _shard_costs(estimator, options, data):
        shard.storage = shard_storage(cost, estimator._topology.compute_device)


def _wrap(cls: type[_Estimator], ours: Callable[[Any, List[ShardingOption], Any], None]) -> None:
    original = cls.estimate
    if getattr(original, _ORIGINAL, None) is not None:
        return  # already wrapped

    @functools.wraps(original)
    def estimate(self: Any, sharding_options: List[ShardingOption], *args: Any, **kwargs: Any) -> Any:
        mine = [o for o in sharding_options if o.compute_kernel == COMPUTE_KERNEL]
        if not mine:
            return original(self, sharding_options, *args, **kwargs)
        rest = [o for o in sharding_options if o.compute_kernel != COMPUTE_KERNEL]
        if rest:
            original(self, rest, *args, **kwargs)
        ours(self, mine, kwargs.get("sharder_data_map", args[0] if args else None))
        return None

    setattr(estimate, _ORIGINAL, original)
    setattr(cls, "estimate", estimate)  # noqa: B010  (a method replaced on the class)


def install() -> None:
    """Let TorchRec's default perf and storage estimators price `customized_kernel` with tpurec's
    cost model (idempotent; see the module docstring for why this is a patch)."""
    _wrap(EmbeddingPerfEstimator, _estimate_perf)
    _wrap(EmbeddingStorageEstimator, _estimate_storage)


def original_estimate(cls: type[_Estimator]) -> Callable[..., Any]:
    """TorchRec's own `cls.estimate`, wrapped or not (tests compare against it)."""
    return getattr(cls.estimate, _ORIGINAL, cls.estimate)
