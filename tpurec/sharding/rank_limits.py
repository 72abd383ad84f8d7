"""The ranks' fixed id limits made equal, so that their compiled steps can trace the same graph.

A pooled kernel's fixed limits (max ids and max unique ids per partition of each stack) are constants
of the SparseCore ops in a compiled step's graph. Measured limits (`tpurec data stats`) bound each
rank's own tables, so two ranks whose stacks are alike but whose tables differ (the planner's
table-wise shards) trace graphs that differ in those constants alone. TorchTPU keeps a collective
graph one program only when every rank's graph code is the same (its handshake, off unless
`TORCH_TPU_SPMD_HANDSHAKE_STAGE` is set; docs/tpu.md), so with the handshake on, DMP raises each
stack's limits to the largest any rank has for it. Larger limits are still bounds (buffers a little
larger on some ranks; no batch runs in more passes). Only where every rank has the same kernels with
the same number of stacks: elsewhere the graphs differ by more than limits. Limits left to the first
batch (no limits file) are aligned by the compiled and pipelined steps once that batch set them
(`after_first_batch`).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tpurec.runtime.device import HANDSHAKE_STAGE_ENV
from tpurec.sharding.kernel_module import SparseCoreEmbeddingBag

if TYPE_CHECKING:
    from tpurec.embedding.kernel_protocol import EmbeddingKernel


def handshake_on() -> bool:
    """Whether TorchTPU will handshake compiled collective graphs (`TORCH_TPU_SPMD_HANDSHAKE_STAGE`)."""
    return os.environ.get(HANDSHAKE_STAGE_ENV) in ("COMPILE_STAGE", "DISPATCH_STAGE")


def _kernels(module: nn.Module) -> list[tuple[str, EmbeddingKernel]]:
    """The pooled kernels with fixed limits, named by their sharded module's path, lookup and group
    (TorchRec keeps a sharded module's lookups in a plain list, out of `named_modules`)."""
    out = []
    for name, m in module.named_modules():
        for i, lookup in enumerate(getattr(m, "_lookups", None) or ()):
            for j, group in enumerate(getattr(lookup, "_emb_modules", None) or ()):
                # pooled lookups only (the module docstring), as SparseCoreEmbeddingBag builds them
                if isinstance(group, SparseCoreEmbeddingBag) and group.kernel.fixed_limits:
                    out.append((f"{name}._lookups.{i}.{j}", group.kernel))
    return out


def _max_over_ranks(values: list[int], group: Any) -> list[int]:
    host = "gloo" in str(dist.get_backend(group))  # tpurec's TPU group pairs gloo with tpu_dist
    t = torch.tensor(values, dtype=torch.int64, device="cpu" if host else None)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def align_fixed_limits(module: nn.Module, group: Any) -> int:
    """Raise every fixed stack limit of `module`'s pooled kernels to the largest any rank of `group`
    has for it, when all ranks hold the same kernels and stacks. A collective: every rank calls it.
    Returns how many of this rank's stacks were raised."""
    kernels = _kernels(module)
    shape = repr([(name, len(k.stacks)) for name, k in kernels])
    digest = int.from_bytes(hashlib.sha256(shape.encode()).digest()[:7], "big")
    low, high = _max_over_ranks([-digest, digest], group)
    if -low != high:  # some rank's kernels or stacks differ: its graph differs whatever the limits
        return 0
    mine = [k.stack_limits(i) for _, k in kernels for i in range(len(k.stacks))]
    flat = [v for lim in mine for v in (lim if lim is not None else (-1, -1))]
    top = _max_over_ranks(flat, group) if flat else []
    raised, j = 0, 0
    for _, k in kernels:
        for i in range(len(k.stacks)):
            ids, uniq = top[2 * j], top[2 * j + 1]
            j += 1
            if ids >= 0 and (ids, uniq) != k.stack_limits(i):
                k.set_stack_limits(i, (ids, uniq))
                raised += 1
    return raised


def after_first_batch(module: nn.Module, group: Any, world_size: int) -> bool:
    """With the handshake on, the ranks' limits aligned once their first batch has set those left to
    it (each rank's own: twice its fullest partition). A collective, called by every rank at its first
    step. Whether this rank's limits changed: its first batch must then be prepared again."""
    if world_size <= 1 or group is None or not handshake_on():
        return False
    return align_fixed_limits(module, group) > 0
