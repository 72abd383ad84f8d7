"""tpurec.DistributedModelParallel's surface: device forms, default planning, meta models, errors."""

import subprocess
import sys
import textwrap

import pytest

from .multiprocess import run_ranks

SCRIPT = textwrap.dedent("""
    import torch, tpurec
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def model():
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10,
                                                         feature_names=["f"])], device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
        return ebc

    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    for device in ("cpu", "cpu:0", torch.device("cpu")):
        dmp = tpurec.DistributedModelParallel(model(), device=device)  # no process group: one is made
        assert isinstance(dmp.plan, ShardingPlan)
        assert dmp.plan.plan[""]["t"].compute_kernel == "customized_kernel"
        out = dmp(kjt).values()
        assert out.shape == (2, 8)
        out.sum().backward()
    from torchrec.distributed.planner.types import ParameterConstraints
    steered = tpurec.DistributedModelParallel(
        model(), device="cpu", constraints={"t": ParameterConstraints(sharding_types=["row_wise"])})
    assert steered.plan.plan[""]["t"].sharding_type == "row_wise", steered.plan
    try:
        tpurec.DistributedModelParallel(model(), device="tpu")
    except tpurec.runtime.device.TpuUnavailableError as e:
        print("TPU-ERROR:", str(e).replace("\\n", " | "))
    print("OK")
""")


def test_device_forms_default_plan_and_tpu_error_without_launcher():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout
    from tpurec.runtime.device import tpu_status

    if not tpu_status().usable:
        assert "TPU-ERROR: device='tpu' was requested but this host cannot run TPU kernels" in out.stdout


def _meta_dlrm_plan(rank, world_size):
    import torch
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=1000 * (i + 1), feature_names=[f"f{i}"])
        for i in range(4)
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables, device=torch.device("meta")),
        dense_in_features=4,
        dense_arch_layer_sizes=[8, 16],
        over_arch_layer_sizes=[8, 1],
        dense_device=torch.device("meta"),
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": 0.1})
    dmp = tpurec.DistributedModelParallel(model, device=torch.device("cpu"), batch_size=64)
    sd = dmp.state_dict()
    key = "sparse_arch.embedding_bag_collection.embedding_bags.t3.weight"
    return {
        "plan": str(dmp.plan),
        "size": tuple(sd[key].size()),
        "dense_on_cpu": all(not p.is_meta for p in dmp.parameters()),
    }


@pytest.mark.multiprocess
def test_meta_device_model_is_planned_and_materialised_at_world_size_2():
    for r in run_ranks(_meta_dlrm_plan, 2, timeout=300):
        assert "customized_kernel" in r["plan"]
        assert r["size"] == (4000, 16)
        assert r["dense_on_cpu"]


def test_without_a_fused_optimizer_tables_train_with_torchrecs_default_sgd():
    """TorchRec's fused kernel trains with EXACT_SGD (lr 0.01) when no apply_optimizer_in_backward was
    given; tpurec does the same (and says so once) instead of refusing."""
    code = textwrap.dedent("""
        import torch, tpurec
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10,
                                                         feature_names=["f"])], device=torch.device("meta"))
        dmp = tpurec.DistributedModelParallel(ebc, device="cpu")
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([3]), lengths=torch.tensor([1]))
        before = dmp.state_dict()["embedding_bags.t.weight"].local_shards()[0].tensor[3].clone()
        dmp(kjt).values().sum().backward()  # d(sum)/d(row 3) = 1 in every column
        after = dmp.state_dict()["embedding_bags.t.weight"].local_shards()[0].tensor[3]
        print("DELTA", float((before - after).mean()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    delta = float([x for x in out.stdout.splitlines() if x.startswith("DELTA")][0].split()[1])
    assert delta == pytest.approx(0.01, rel=1e-5)
    assert out.stderr.count("training with EXACT_SGD, lr=0.01") == 1
