"""Which pooling the TensorCore kernel (TPUs without SparseCores: v5e, v4) runs for each stack it will
build: tpurec's Pallas pooling where its output fits the chip's VMEM, else XLA's segment sum (#59:
the kernel's choice per shape, recorded in the plan's report).

The kernel decides at run time by the same rule (`tpu_bridge.pool_options`: the most output copies,
up to `pool_vmem.ACCUMULATORS`, that fit VMEM for the stack's segments and width; none: XLA's); the
planner cuts the stacks as the kernel does (`layout.build_stacks`, one partition,
`TENSORCORE_MAX_STACK_BYTES`). On v5e the lookup with the Pallas pooling took 0.99 ms against 1.72
with XLA's segment sum for 131,072 ids at 1M x 128 (docs/results.md, session 41): a stack that falls
to XLA's pays ~1.7x for its lookup (tensorcore_cost prices it so).
"""

from __future__ import annotations

from collections.abc import Iterable

from tpurec.data.catalog import TableSpec
from tpurec.embedding import pool_vmem
from tpurec.runtime.device import tensorcore_only

# VMEM per TensorCore: JAX 0.10.2's table (jax/_src/pallas/mosaic/tpu_info.py, vmem_capacity_bytes):
# v5e 128 MiB, v4 16 MiB per core.
VMEM_BYTES = {"v5e": 128 << 20, "v4": 16 << 20}


def pooling_per_stack(tables: Iterable[TableSpec], generation: str, samples: int) -> list[dict] | None:
    """A row per pooled stack the TensorCore kernel builds on `generation` for `samples` samples a
    step on a device (the global batch: a table's shard serves every sample, as under table-wise
    sharding; an upper bound elsewhere): its tables, segments (features x samples), width, the
    pooling it gets and the VMEM that needs. None on a chip with SparseCores or a CPU. Sequence
    (unpooled) tables have no pooling and no row."""
    from tpurec.embedding.layout import build_stacks
    from tpurec.embedding.settings import TENSORCORE_MAX_STACK_BYTES

    if not tensorcore_only(generation):
        return None
    pooled = {t.name: t for t in tables if t.pooling != "none"}
    stacks = build_stacks(
        [(t.name, t.num_embeddings, t.embedding_dim) for t in pooled.values()],
        1,  # the TensorCore kernel's stacks have one partition
        expected_ids={name: t.pooling_factor for name, t in pooled.items()},
        max_bytes=TENSORCORE_MAX_STACK_BYTES,
    )
    capacity = VMEM_BYTES.get(generation)
    rows = []
    for stack in stacks:
        names = [t.name for t in stack.tables]
        segments = samples * sum(len(pooled[n].feature_names) for n in names)
        width = stack.storage_dim
        acc = pool_vmem.accumulators_that_fit(segments, width, capacity)
        rows.append(
            {
                "stack": stack.name,
                "tables": names,
                "segments": segments,
                "width": width,
                "pooling": "pallas" if acc else "xla",
                "accumulators": acc,
                "vmem_bytes": pool_vmem.vmem_bytes(segments, width, accumulators=max(acc, 1)),
                "vmem_capacity_bytes": capacity,
            }
        )
    return rows
