"""Optimizer specs: the registry finds every module, specs round-trip both vocabularies, and a new
optimizer is one new module that the CLIs, the planner's bytes and the kernel pick up unedited."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import convert_optimizer_type_and_kwargs
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import tpurec.embedding.optimizers as optimizers_pkg
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.optimizers import base, registry

PACKAGE_DIR = Path(optimizers_pkg.__file__).parent

# Non-default settings per optimizer, so a round trip that dropped a field would show.
SETTINGS = {
    "sgd": {"lr": 0.3},
    "adagrad": {"lr": 0.2, "eps": 1e-6, "initial_accumulator_value": 0.1},
    "rowwise_adagrad": {"lr": 0.2, "eps": 1e-6, "initial_accumulator_value": 0.1},
    "adam": {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6},
}


def test_registry_discovers_every_spec_module():
    modules = sorted(
        p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__" and p.stem not in registry._MACHINERY
    )
    assert list(registry.spec_names()) == modules
    classes = registry.spec_classes()
    assert list(classes) == modules
    for name, cls in classes.items():
        assert cls.name == name and cls.__module__ == f"tpurec.embedding.optimizers.{name}"
        assert registry.spec_class(name) is cls
    with pytest.raises(ValueError, match="unknown optimizer 'ftrl'; one of"):
        registry.spec_class("ftrl")


def test_spec_names_imports_no_torch():
    import subprocess

    code = (
        "import sys; from tpurec.embedding.optimizers.registry import spec_names; "
        "assert 'adam' in spec_names(); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", registry.spec_names())
def test_spec_round_trips_torch_and_fbgemm(name):
    cls = registry.spec_class(name)
    spec = registry.spec_from_torch(cls.torch_optimizer(), SETTINGS.get(name, {"lr": 0.3}))
    assert type(spec) is cls
    # torch class + kwargs -> spec -> to_torch -> spec
    optim, kwargs = spec.to_torch()
    assert optim is cls.torch_optimizer()
    assert registry.spec_from_torch(optim, kwargs) == spec
    # what TorchRec's sharder makes of apply_optimizer_in_backward(optim, ..., kwargs) -> spec
    if cls.fbgemm_optim is not None:
        opt_type, fused = convert_optimizer_type_and_kwargs(optim, kwargs)
        assert opt_type.name == cls.fbgemm_optim
        assert registry.spec_from_fused_params({"optimizer": opt_type, **fused}, "t") == spec
    # the names the planner meets resolve to the spec
    for alias in (name, cls.torch_class_name(), *cls.fbgemm_names()):
        assert registry.spec_name_for(alias) == name


def test_state_bytes_per_row_follow_the_state_shapes():
    per_row = {n: registry.spec_class(n).state_bytes_per_row(16) for n in SETTINGS}
    assert per_row == {"sgd": 0, "adagrad": 4 * 16, "rowwise_adagrad": 4, "adam": 2 * 4 * 16}


def test_unknown_fused_params_name_the_optimizers():
    with pytest.raises(ValueError, match=r"table 't': .*apply_optimizer_in_backward\(<.*RowWiseAdagrad.*>"):
        registry.spec_from_fused_params({"optimizer": "lars_sgd"}, "t")


def test_no_fused_optimizer_means_torchrecs_default_exact_sgd():
    spec = registry.spec_from_fused_params({}, "t")
    assert spec.name == "sgd" and spec.lr == 0.01
    assert registry.spec_from_fused_params({"learning_rate": 0.3}, "t").lr == 0.3


TOY = '''
"""A toy optimizer for the extension test: SGD at half the learning rate, counting updates."""
from dataclasses import dataclass

import torch

from tpurec.embedding.optimizers.base import OptimizerSpec, op_head, op_tail


@dataclass(frozen=True)
class ToySpec(OptimizerSpec):
    lr: float = 0.01

    name = "toy_half_sgd"
    torch_optimizer_path = "torch.optim.ASGD"
    fbgemm_optim = "MADGRAD"
    state_names = ("updates",)
    refused_torch_kwargs = ("weight_decay",)

    @classmethod
    def _take_torch_kwargs(cls, kwargs):
        return cls(lr=float(kwargs.pop("lr", 0.01)))

    def torch_kwargs(self):
        return {"lr": self.lr}

    @classmethod
    def state_shape(cls, name, rows, dim):
        return (rows,)

    def initial_value(self, state):
        return 0.0

    def apply_update(self, csr, table, states, grad, lr, step, computation_name="toy", dim=None):
        torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd(*op_head(csr, table), grad, lr / 2, *op_tail(csr),
                                                           computation_name)
        states[0].add_(1.0)
'''


@pytest.fixture
def toy_optimizer(tmp_path, monkeypatch):
    """toy_half_sgd.py dropped into the optimizers package (via its __path__), and nothing else."""
    (tmp_path / "toy_half_sgd.py").write_text(textwrap.dedent(TOY))
    monkeypatch.setattr(optimizers_pkg, "__path__", [*optimizers_pkg.__path__, str(tmp_path)])
    monkeypatch.setattr(base, "_REGISTERED", dict(base._REGISTERED))  # forget the toy afterwards
    yield "toy_half_sgd"
    sys.modules.pop("tpurec.embedding.optimizers.toy_half_sgd", None)


def test_a_new_spec_module_is_picked_up_everywhere(toy_optimizer):
    from torch.distributed.optim import _apply_optimizer_in_backward

    from tpurec.planner import planners
    from tpurec.planner.estimators import shard_cost
    from tpurec.planner.topology import cpu_spec

    assert toy_optimizer in registry.spec_names()  # the CLIs' choices, before anything imports it
    assert registry.spec_class(toy_optimizer).state_bytes_per_row(16) == 4

    # the planner's storage: one f32 per (padded) row
    common = dict(
        sharding_type="table_wise",
        cols=16,
        pooling_factor=1.0,
        batch_per_device=8,
        world_size=1,
        num_shards=1,
        spec=cpu_spec(1),
    )
    toy = shard_cost(rows=1000, optimizer=toy_optimizer, **common)
    sgd = shard_cost(rows=1000, optimizer="sgd", **common)
    assert sgd.optimizer == 0 and toy.optimizer == toy.weights // 16
    ebc = torch.nn.Module()
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc.ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10, feature_names=["f"])],
        device=torch.device("meta"),
    )
    _apply_optimizer_in_backward(torch.optim.ASGD, ebc.parameters(), {"lr": 0.1})
    assert planners.infer_optimizer(ebc) == toy_optimizer

    # the kernel: state allocated from the spec, update run by the spec, state in the FusedOptimizer
    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10, feature_names=["f"])]
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.ASGD, {"lr": 0.4}, num_sparsecores=2)
    ref = SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.2}, num_sparsecores=2)
    ref.load_state_dict(sc.state_dict())
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 3, 3, 7]), lengths=torch.tensor([2, 2]))
    for module in (sc, ref):
        module(kjt).values().sum().backward()
    torch.testing.assert_close(sc.table_weight("t"), ref.table_weight("t"))
    assert sc.kernel.read_state("t", "updates").shape == (10,)
    state = sc.fused_optimizer.state_dict()["state"]["embedding_bags.t.weight"]
    assert torch.equal(state["t.updates"], torch.ones(10))
    assert sc.kernel.step_count("t") == 1
