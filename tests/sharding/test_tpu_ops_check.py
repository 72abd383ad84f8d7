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
