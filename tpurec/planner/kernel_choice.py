"""Which TorchRec compute-kernel value and sharding types tpurec's SparseCore kernel answers to.

`EmbeddingComputeKernel` is a closed enum checked by TorchRec's planner and sharded modules, so we
reuse a value instead of patching it. We take CUSTOMIZED_KERNEL: it is TorchRec's documented hook
for kernels it does not know, and it makes the sharded EBC leave state_dict handling to the kernel,
which we need because the SparseCore table is stored MOD-partitioned, not in natural row order.
UNFUSED_TPU is avoided: TorchRec wires it to its own unfused Pallas kernel and GPU placeholder costs.
"""

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ShardingType

from tpurec.runtime.device import DeviceKind

COMPUTE_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value

# Data-parallel is excluded: it replicates the table and leaves updates to a dense optimizer after
# an all-reduce of a dense gradient, which is exactly what a fused SparseCore update avoids.
SHARDING_TYPES = [
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
]
# Table-row-wise needs TorchRec's intra-host and cross-host sub-groups (torchrec/distributed/comm.py,
# `intra_and_cross_node_pg`, from TwRwPooledEmbeddingSharding). TorchTPU 0.2.0 gives no sub-group
# TorchRec can rely on: its ProcessGroupTpu lowers sub-group collectives as SPMD programs over every
# device and refuses "Incomplete or overlapping subgroups" (an intra-host and a cross-host group
# overlap in every rank), its torchcomms `split_group` raises "not yet implemented", and its
# compile-time handshake runs on the global group only (docs/tpu.md). So it is never planned for a TPU.
NEEDS_SUBGROUPS = (ShardingType.TABLE_ROW_WISE.value,)
SUBGROUP_REFUSAL = (
    "needs TorchRec's intra-host and cross-host process sub-groups, which TorchTPU 0.2.0 does not support "
    "(overlapping SPMD sub-groups; split_group not implemented); use row_wise or table_wise"
)


def sharding_types_for(compute_device_type: str) -> list[str]:
    """The sharding types the SparseCore sharder offers on `compute_device_type`."""
    if compute_device_type == DeviceKind.TPU:
        return [t for t in SHARDING_TYPES if t not in NEEDS_SUBGROUPS]
    return list(SHARDING_TYPES)


# For EmbeddingCollections: TorchRec's EmbeddingCollectionSharder offers DP, TW, CW and RW.
EC_SHARDING_TYPES = [ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.ROW_WISE.value]

# What `tpurec train` plans on CPU (tpurec.dlrm.model.planner_constraints) and so what `tpurec plan
# --topology cpu-N` proposes for a named model or a tables file. On CPU every rank shares the same
# host cores, so splitting a table across ranks (column- or table-row-wise) buys no memory or
# bandwidth and only adds shards, lookups and all-to-all pieces: measured on dlrm-tiny at 2 ranks,
# the unconstrained plan (19 tables table-column-wise) trained at 0.60x the speed of a table-wise
# placement. On TPU the planner chooses freely.
CPU_TRAINING_SHARDING_TYPES = [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value]
