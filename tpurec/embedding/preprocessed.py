"""`PreprocessedFeatures`: a batch's SparseCore inputs, built on the host ahead of the device step.

`SparseCoreEmbeddingBagCollection.preprocess(kjt)` builds one; the module's `forward` takes it in
place of the KeyedJaggedTensor and runs only the device half (the lookups, and the fused update in
backward). That split is what lets `torch.compile(fullgraph=True)` trace a model's step: the host
half is data-dependent and stays eager before it, as TorchRec's `SparseCoreTrainPipeline` feeds its
compiled step preprocessed inputs (docs/kernels.md, "Compiled step").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpurec.embedding.kernel_input import StackInput


@dataclass
class PreprocessedFeatures:
    inputs: list[StackInput]  # one per stack of the kernel that built them (SparseCoreKernel.preprocess)
    batch: int  # the KJT's stride

    def stride(self) -> int:
        """The batch size, as a KeyedJaggedTensor says it (models call `features.stride()`)."""
        return self.batch
