"""TorchRec modules whose forward calls an op TorchTPU 0.2.0 has no kernel for: refused at DMP build.

On a TPU an op without a TorchTPU kernel raises TorchTPU's "operator '...' is not implemented for
TPU" when the forward first reaches it (its CPU fallback is off by default). Most such calls are
in code a model runs, which only running it shows (the emulated device names the op then,
tpurec/emulation/device.py). Some are whole TorchRec modules, visible in the model before any step:
those are refused when `tpurec.DistributedModelParallel` is built for a TPU, naming the module, the
op and what to do instead. The ops are in TorchTPU's missing-op list
(tpurec/emulation/torchtpu_kernels.json, `fallback_ops`; tests/sharding/test_tpu_ops_check.py
checks each against it). A plain `torch.nn.EmbeddingBag` is refused too: the v5e chip aborts the
process compiling its op (`chip_aborts` there).
"""

from __future__ import annotations

from torch import nn

from tpurec.errors import UserError

# TorchRec module class (module path, name) -> the FBGEMM op its forward calls on the device.
MODULES_WITHOUT_TPU_KERNELS = {
    ("torchrec.modules.regroup", "KTRegroupAsDict"): "fbgemm::permute_multi_embedding",
    ("torchrec.modules.regroup", "PermuteMultiEmbedding"): "fbgemm::permute_multi_embedding",
}


def _plain_embedding_bags(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """`torch.nn.EmbeddingBag`s of `module` outside TorchRec's and tpurec's modules (an EmbeddingBagCollection
    holds its tables as EmbeddingBags, which tpurec shards: those never run as they are)."""
    if type(module).__module__.startswith(("torchrec.", "tpurec.")):
        return []
    if isinstance(module, nn.EmbeddingBag):
        return [(prefix, module)]
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        found += _plain_embedding_bags(child, f"{prefix}.{name}" if prefix else name)
    return found


def refuse_modules_without_tpu_kernels(model: nn.Module) -> None:
    """Raise UserError for the first module of `model` whose forward needs an op TorchTPU lacks, or that
    the chip aborts on: a plain `torch.nn.EmbeddingBag` (`aten::_embedding_bag`: the v5e chip's XLA
    compiler killed the process, "Unsupported conversion from vmreg/vreg to U64", docs/tpu.md)."""
    for name, _ in _plain_embedding_bags(model):
        raise UserError(
            f"{name or 'the model'} (torch.nn.EmbeddingBag) cannot run on a TPU: its aten::_embedding_bag aborts the "
            "process in the chip's XLA compiler (TPU v5e, torch_tpu 0.2.0), and tpurec does not shard it; use "
            "TorchRec's EmbeddingBagCollection (torchrec.EmbeddingBagCollection), which tpurec shards"
        )
    for name, m in model.named_modules():
        op = MODULES_WITHOUT_TPU_KERNELS.get((type(m).__module__, type(m).__name__))
        if op is not None:
            where = name or "the model"
            raise UserError(
                f"{where} ({type(m).__name__}) calls {op}, which TorchTPU 0.2.0 has no TPU kernel for (its CPU "
                "fallback is off): regroup the pooled embeddings with torch ops instead, e.g. "
                "torch.split / torch.cat of KeyedTensor.values() by KeyedTensor.length_per_key()"
            )
