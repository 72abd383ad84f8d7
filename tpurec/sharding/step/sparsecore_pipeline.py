"""TorchRec's `TrainPipelineSparseDist` that builds SparseCore inputs once the input all-to-all is in.

With several ranks a lookup's ids come from the input all-to-all. This pipeline waits for batch i+1's
all-to-all as soon as TorchRec has started it (after batch i's forward; TorchRec's own experimental
pipelines wait there too) and hands each sharded SparseCore module its distributed input, whose CSR
inputs are built on worker threads while batch i's backward and optimizer step run; batch i+1's
forward takes them. Imported only when such a pipeline is built (it imports TorchRec's pipelines).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import LazyNoWait

from tpurec.sharding.sharded_state import SparseCoreShardedMixin

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim import Optimizer
    from torchrec.distributed.train_pipeline.utils import TrainPipelineContext


class SparseCoreTrainPipeline(TrainPipelineSparseDist):
    def __init__(self, dmp: nn.Module, optimizer: Optimizer, device: torch.device, *, workers: int) -> None:
        super().__init__(dmp, optimizer, device)
        self._sharded = {name: m for name, m in dmp.named_modules() if isinstance(m, SparseCoreShardedMixin)}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tpurec-csr")

    def _module_for(self, name: str) -> SparseCoreShardedMixin | None:
        # the pipeline names modules from the wrapped model; named_modules() from the DMP
        return next((m for fqn, m in self._sharded.items() if fqn == name or fqn.endswith("." + name)), None)

    def wait_sparse_data_dist(self, context: TrainPipelineContext) -> None:
        super().wait_sparse_data_dist(context)
        for name, request in list(context.input_dist_tensors_requests.items()):
            module = self._module_for(name)
            if module is None:
                continue
            # Wait now for the ids and hand forward the result unchanged.
            features = request.wait()
            context.input_dist_tensors_requests[name] = LazyNoWait(features)
            module.prepare_dist_input(features, self._pool.submit)

    def close(self) -> None:
        """Stop the worker threads (builds still running finish first)."""
        self._pool.shutdown(wait=True)
