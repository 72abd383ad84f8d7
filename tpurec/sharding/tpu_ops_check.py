"""TorchRec modules whose forward calls an op TorchTPU 0.2.0 has no kernel for: refused at DMP build.

On a TPU an op without a TorchTPU kernel raises TorchTPU's "operator '...' is not implemented for
TPU" when the forward first reaches it (its CPU fallback is off by default). Most such calls are
in code a model runs, which only running it shows (the emulated device names the op then,
tpurec/emulation/device.py). Some are whole TorchRec modules, visible in the model before any step:
those are refused when `tpurec.DistributedModelParallel` is built for a TPU, naming the module, the
op and what to do instead. The ops are in TorchTPU's missing-op list
(tpurec/emulation/torchtpu_kernels.json, `fallback_ops`; tests/sharding/test_tpu_ops_check.py
checks each against it).
"""

from __future__ import annotations

from torch import nn

from tpurec.errors import UserError

# TorchRec module class (module path, name) -> the FBGEMM op its forward calls on the device.
MODULES_WITHOUT_TPU_KERNELS = {
    ("torchrec.modules.regroup", "KTRegroupAsDict"): "fbgemm::permute_multi_embedding",
    ("torchrec.modules.regroup", "PermuteMultiEmbedding"): "fbgemm::permute_multi_embedding",
}


def refuse_modules_without_tpu_kernels(model: nn.Module) -> None:
    """Raise UserError for the first module of `model` whose forward needs an op TorchTPU lacks."""
    for name, m in model.named_modules():
        op = MODULES_WITHOUT_TPU_KERNELS.get((type(m).__module__, type(m).__name__))
        if op is not None:
            where = name or "the model"
            raise UserError(
                f"{where} ({type(m).__name__}) calls {op}, which TorchTPU 0.2.0 has no TPU kernel for (its CPU "
                "fallback is off): regroup the pooled embeddings with torch ops instead, e.g. "
                "torch.split / torch.cat of KeyedTensor.values() by KeyedTensor.length_per_key()"
            )
