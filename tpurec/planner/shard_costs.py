"""`ShardCost`: what one embedding shard costs its device, the figures `estimators.shard_cost` computes
(and host_tier_cost.py extends for a shard on the host tier)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardCost:
    weights: int  # table rows after MOD padding over the device's SparseCores
    optimizer: int
    buffers: int  # SparseCore CSR/COO input buffers sized by the worst-case id limit
    activations: int  # output of this shard for the global batch (pooled, or one row per id), and its gradient
    # TPU only: TorchTPU's fused update ops return a new table and new state (docs/tpu.md), which
    # live beside the old ones until the adapter copies them back. Counted per shard, this is exact
    # when a device's shards form one stack (same width and optimizer, e.g. every MLPerf table) and
    # an upper bound otherwise (stacks are updated one after another, so the true peak is the
    # largest stack's). Zero on CPU, where the reference updates in place.
    transient: int
    lookup_ms: float
    update_ms: float
    input_comm_ms: float  # ids to the shard (all-to-all)
    output_comm_ms: float  # pooled embeddings out (all-to-all / reduce-scatter)
    grad_comm_ms: float  # their gradients back
    # the host tier (host_tier_cost.py): the whole shard and its state in host memory, and the time
    # a step spends copying the rows its cache misses; the fields above are then its cache's
    host: int = 0
    host_ms: float = 0.0

    @property
    def bytes(self) -> int:
        """Device bytes (HBM on a TPU; the rank's memory on CPU)."""
        return self.weights + self.optimizer + self.buffers + self.activations + self.transient

    @property
    def comm_ms(self) -> float:
        return self.input_comm_ms + self.output_comm_ms + self.grad_comm_ms

    @property
    def time_ms(self) -> float:
        return self.lookup_ms + self.update_ms + self.comm_ms + self.host_ms
