"""#36 item 8: a model holding a TorchRec module whose forward needs an op TorchTPU lacks is told at
DMP build, on the TPU path; the CPU path builds it as before."""

import json
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.regroup import KTRegroupAsDict

import tpurec.emulation
from tpurec.errors import UserError
from tpurec.sharding.tpu_ops_check import MODULES_WITHOUT_TPU_KERNELS, refuse_modules_without_tpu_kernels

KERNELS = Path(tpurec.emulation.__file__).parent / "torchtpu_kernels.json"


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10, feature_names=[f"f{i}"])
            for i in range(2)
        ]
        self.ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
        self.regroup = KTRegroupAsDict(groups=[["f0"], ["f1"]], keys=["user", "item"])


def test_every_listed_op_is_in_torchtpus_missing_op_list():
    missing = set(json.loads(KERNELS.read_text())["fallback_ops"])
    assert set(MODULES_WITHOUT_TPU_KERNELS.values()) <= missing


def test_a_regrouping_module_is_named_with_its_op():
    with pytest.raises(UserError, match=r"^regroup \(KTRegroupAsDict\) calls fbgemm::permute_multi_embedding"):
        refuse_modules_without_tpu_kernels(Tower())


def test_a_model_without_one_passes():
    refuse_modules_without_tpu_kernels(Tower().ebc)


def test_distributedmodelparallel_refuses_it_on_the_tpu_path_before_any_group(monkeypatch):
    import tpurec
    from tpurec.sharding import dmp

    def no_group_yet(kind):
        raise AssertionError("a process group was made before the refusal")

    # The TPU path as an emulated rank takes it, without a TPU: the device kind decides.
    monkeypatch.setattr(dmp, "device_kind", lambda device_type: "tpu")
    monkeypatch.setattr(dmp, "_ensure_process_group", no_group_yet)
    with pytest.raises(UserError, match="regroup .KTRegroupAsDict. calls fbgemm::permute_multi_embedding"):
        tpurec.DistributedModelParallel(Tower(), device="cpu")


class WithABag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = Tower().ebc  # TorchRec's EBC: its tables are EmbeddingBags, which tpurec shards
        self.side = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="sum", device="meta"))


BAG_REFUSAL = (
    "side.0 (torch.nn.EmbeddingBag) cannot run on a TPU: its aten::_embedding_bag aborts the process in the chip's "
    "XLA compiler (TPU v5e, torch_tpu 0.2.0), and tpurec does not shard it; use TorchRec's EmbeddingBagCollection "
    "(torchrec.EmbeddingBagCollection), which tpurec shards"
)


def test_a_plain_embedding_bag_is_named_with_the_alternative_and_an_ebcs_own_are_not():
    with pytest.raises(UserError) as err:
        refuse_modules_without_tpu_kernels(WithABag())
    assert str(err.value) == BAG_REFUSAL
    refuse_modules_without_tpu_kernels(WithABag().tower)  # the EBC's own EmbeddingBags pass


def test_distributedmodelparallel_refuses_a_plain_embedding_bag_on_the_tpu_path(monkeypatch):
    import tpurec
    from tpurec.sharding import dmp

    def no_group_yet(kind):
        raise AssertionError("a process group was made before the refusal")

    monkeypatch.setattr(dmp, "device_kind", lambda device_type: "tpu")
    monkeypatch.setattr(dmp, "_ensure_process_group", no_group_yet)
    with pytest.raises(UserError) as err:
        tpurec.DistributedModelParallel(WithABag(), device="cpu")
    assert str(err.value) == BAG_REFUSAL
