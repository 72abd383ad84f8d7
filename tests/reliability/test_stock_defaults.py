"""Every default a TorchRec user relies on is TorchRec's (or FBGEMM's) own (issue #29, family 10).

The expected values are read from the stock code itself (inspect.signature of the stock class or
function, TorchRec's dataclass fields and getters, or a stock object built and read), never written
here: a default changed in tpurec, or in a new TorchRec/FBGEMM, fails a test. Where tpurec differs on
purpose the test asserts the difference and docs/dmp.md ("Defaults") says why.

Paths: the standalone module (torch kwargs, torch's defaults), DMP's fused params (FBGEMM's
defaults, as TorchRec's fused kernel fills them in), the sharders' and DMP's constructors,
EmbeddingBagConfig / EmbeddingConfig handling, the planner's batch size, the DLRM model."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingConfig, PoolingType

from tpurec.embedding.optimizers.registry import spec_classes, spec_from_fused_params, spec_name_for

SPECS = spec_classes()
# Torch kwargs that say how to compute, not what (tpurec ignores them, as harmless).
HOW_NOT_WHAT = {"foreach", "differentiable", "capturable", "fused"}


def _defaults(fn) -> dict:
    """A callable's keyword defaults, as its signature states them."""
    return {
        n: p.default
        for n, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def _tbe_defaults() -> dict:
    """FBGEMM's SplitTableBatchedEmbeddingBagsCodegen defaults: what TorchRec's fused kernel trains
    with for every fused param TorchRec's sharder leaves out."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    return _defaults(SplitTableBatchedEmbeddingBagsCodegen.__init__)


def _stock_value(defaults: dict, field: str):
    """A spec field's value among a stock optimizer's defaults (torch names betas as one pair)."""
    if field in ("beta1", "beta2") and "betas" in defaults:
        return defaults["betas"][0 if field == "beta1" else 1]
    if field not in defaults:
        raise AssertionError(f"spec field {field!r} has no stock default among {sorted(defaults)}")
    return defaults[field]


# -- fused optimizers: the standalone module's torch kwargs -------------------------------------


@pytest.mark.parametrize("name", sorted(SPECS))
def test_standalone_optimizer_defaults_are_the_torch_classes(name):
    """SparseCoreEmbeddingBagCollection(tables, torch.optim.X, kwargs) takes X's own defaults for what
    kwargs leave out, for every hyper-parameter, as the unsharded module's in-backward X would."""
    cls = SPECS[name]
    stock = {k: v for k, v in _defaults(cls.torch_optimizer().__init__).items() if k not in HOW_NOT_WHAT}
    implicit = cls.from_torch_kwargs({})
    for f in dataclasses.fields(cls):
        if f.name == "weight_decay_mode":  # torch names no mode: no decay by default, tpurec's None
            assert implicit.weight_decay_mode is None and stock["weight_decay"] == 0
            continue
        assert getattr(implicit, f.name) == _stock_value(stock, f.name), (name, f.name)
    # Every stock default given explicitly (momentum=0, weight_decay=0, amsgrad=False, ...) is accepted
    # and trains as leaving it out: options the fused update lacks are refused only when switched on.
    assert cls.from_torch_kwargs(dict(stock)) == implicit
    assert cls() == implicit  # the spec's own dataclass defaults (DLRM configs start from them)


# -- fused optimizers: DMP's fused params --------------------------------------------------------

# tpurec's spec field -> FBGEMM's fused-param name (TorchRec renames lr to learning_rate).
FUSED_NAME = {"lr": "learning_rate", "eps": "eps", "beta1": "beta1", "beta2": "beta2", "weight_decay": "weight_decay"}


def _fbgemm_initial_accumulator(optim: str) -> float:
    """What FBGEMM's accumulator starts at (it takes no initial value): read from a CPU TBE."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=getattr(EmbOptimType, optim)
    )
    values = {float(v) for states in tbe.split_optimizer_states() for s in states for v in s.flatten().tolist()}
    assert len(values) == 1, values
    return values.pop()


def _assert_fbgemms_defaults(spec, given: dict) -> None:
    """Every hyper-parameter of `spec` not in `given` (fused-param names) is FBGEMM's default."""
    tbe = _tbe_defaults()
    for f in dataclasses.fields(spec):
        if f.name == "initial_accumulator_value":
            assert spec.initial_accumulator_value == _fbgemm_initial_accumulator(type(spec).fbgemm_optim)
            continue
        if f.name == "weight_decay_mode":  # FBGEMM's default mode is NONE: tpurec's None (no decay)
            from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

            assert spec.weight_decay_mode is None and WeightDecayMode(tbe["weight_decay_mode"]).name == "NONE"
            continue
        assert f.name in FUSED_NAME, f"spec field {spec.name}.{f.name}: which FBGEMM fused param is it?"
        want = given.get(FUSED_NAME[f.name], tbe[FUSED_NAME[f.name]])
        assert getattr(spec, f.name) == want, (spec.name, f.name)


@pytest.mark.parametrize("name", sorted(n for n, c in SPECS.items() if c.fbgemm_optim))
def test_fused_params_defaults_are_fbgemms(name):
    """The fused params TorchRec's sharder builds name the optimizer and what the user passed; every
    hyper-parameter left out takes FBGEMM's default, as TorchRec's fused kernel does."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    cls = SPECS[name]
    tbe = _tbe_defaults()
    optim = getattr(EmbOptimType, cls.fbgemm_optim)
    implicit = spec_from_fused_params({"optimizer": optim}, "t")
    assert type(implicit) is cls
    _assert_fbgemms_defaults(implicit, {})
    explicit = {FUSED_NAME[f.name]: tbe[FUSED_NAME[f.name]] for f in dataclasses.fields(cls) if f.name in FUSED_NAME}
    assert spec_from_fused_params({"optimizer": optim, **explicit}, "t") == implicit


def test_no_fused_optimizer_trains_with_fbgemms_default_optimizer_and_lr():
    tbe = _tbe_defaults()
    spec = spec_from_fused_params({}, "t")
    assert spec.name == spec_name_for(tbe["optimizer"].value)  # EXACT_SGD
    assert spec.lr == tbe["learning_rate"]


def _ebc(rows=50, **config):
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=rows, feature_names=["f0"], **config)],
        device=torch.device("meta"),
    )


def _tpurec_dmp(module, **kw):
    import tpurec
    from tpurec.sharding.dmp import _ensure_process_group

    _ensure_process_group("cpu")
    return tpurec.DistributedModelParallel(module, device="cpu", **kw)


@pytest.mark.parametrize("name", sorted(n for n, c in SPECS.items() if c.fbgemm_optim))
def test_dmp_given_only_lr_shows_fbgemms_hyperparameters(name):
    """End to end: apply_optimizer_in_backward(X, params, {"lr": 0.05}) on the unsharded model, then
    tpurec's DMP trains its tables with FBGEMM's defaults for everything else (eps, betas, ...)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    cls = SPECS[name]
    ebc = _ebc()
    apply_optimizer_in_backward(cls.torch_optimizer(), ebc.parameters(), {"lr": 0.05})
    dmp = _tpurec_dmp(ebc)
    (spec,) = {kernel_module.kernel.optimizer for *_, kernel_module in dmp.module._sc_shards()}
    assert type(spec) is cls
    _assert_fbgemms_defaults(spec, {"learning_rate": 0.05})
    # as stock's group shows it: FBGEMM's float32 learning rate read back (test_lr_schedule_dmp.py)
    assert list(dmp.fused_optimizer.param_groups)[0]["lr"] == float(np.float32(0.05))


# -- constructors: sharders, the module, DMP ------------------------------------------------------


def _same_named_defaults(ours, stock) -> set:
    """Assert the defaults of the parameters both take are equal; return stock's parameters ours lacks."""
    mine, theirs = inspect.signature(ours).parameters, inspect.signature(stock).parameters
    for n in set(mine) & set(theirs):
        assert mine[n].default == theirs[n].default, f"{ours.__qualname__}({n}=...) default"
    return set(theirs) - set(mine)


def test_sharder_and_module_constructor_defaults_are_torchrecs():
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
    from tpurec.sharding.ec_sharder import SparseCoreECSharder
    from tpurec.sharding.fp_sharder import SparseCoreFPEBCSharder
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    # What tpurec's constructors lack of TorchRec's: the order of sharded modules (one SparseCore
    # kernel per module has none to reorder) and index dedup (the SparseCore kernel dedups its ids).
    assert _same_named_defaults(SparseCoreEBCSharder.__init__, EmbeddingBagCollectionSharder.__init__) == {
        "sharded_module_order_overwrite"
    }
    assert _same_named_defaults(SparseCoreECSharder.__init__, EmbeddingCollectionSharder.__init__) == {
        "use_index_dedup"
    }
    fp_stock = FeatureProcessedEmbeddingBagCollectionSharder
    assert not _same_named_defaults(SparseCoreFPEBCSharder.__init__, fp_stock.__init__)
    assert not _same_named_defaults(SparseCoreEmbeddingBagCollection.__init__, EmbeddingBagCollection.__init__)


def test_dmp_constructor_defaults_are_torchrecs():
    """tpurec.DistributedModelParallel passes TorchRec's keyword-only-in-practice arguments through;
    built without them it behaves as TorchRec's defaults say."""
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
    from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP

    import tpurec

    stock = _defaults(StockDMP.__init__)
    passed_through = _same_named_defaults(tpurec.DistributedModelParallel.__init__, StockDMP.__init__)
    assert passed_through == {"init_data_parallel", "init_parameters", "data_parallel_wrapper", "model_tracker_configs"}
    # On purpose: `device` is the second positional argument (TorchRec's is `env`), so that
    # DistributedModelParallel(model, "cpu") works; docs/dmp.md says so.
    mine = list(inspect.signature(tpurec.DistributedModelParallel.__init__).parameters)[:5]
    theirs = list(inspect.signature(StockDMP.__init__).parameters)[:5]
    assert (mine[1:3], theirs[1:3]) == (["module", "device"], ["module", "env"])
    assert set(mine) == set(theirs)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = _ebc()
            self.dense = torch.nn.Linear(4, 4, device="meta")

        def forward(self, x):
            return self.dense(x)

    dmp = _tpurec_dmp(Model())
    assert dmp.init_parameters is stock["init_parameters"]
    assert not dmp.module.dense.weight.is_meta  # init_parameters=True materialised it
    assert dmp._ddp_wrapped is stock["init_data_parallel"]
    # TorchRec's DefaultDataParallelWrapper (tpurec's subclass only silences one deprecation warning)
    assert stock["data_parallel_wrapper"] is None and isinstance(dmp._data_parallel_wrapper, DefaultDataParallelWrapper)
    assert stock["model_tracker_configs"] is None and dmp.model_trackers == {}


# -- EmbeddingBagConfig / EmbeddingConfig ---------------------------------------------------------


def _config_default(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _kjt():
    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 2, 3, 4, 5, 0]), lengths=torch.tensor([2, 3, 1]))


def test_config_default_pooling_and_dtype_are_handled_as_torchrecs():
    """A config given neither pooling nor data_type: pooled as stock EBC pools (SUM) and stored as its
    default data type (FP32)."""
    from torchrec.modules.embedding_configs import data_type_to_dtype

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    assert _config_default(EmbeddingBagConfig, "pooling") is PoolingType.SUM
    torch.manual_seed(0)
    stock = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50, feature_names=["f0"])]
    )
    ours = SparseCoreEmbeddingBagCollection(stock.embedding_bag_configs(), torch.optim.SGD, {"lr": 0.1})
    ours.load_state_dict(stock.state_dict())
    torch.testing.assert_close(ours(_kjt()).values(), stock(_kjt()).values(), rtol=0, atol=1e-6)
    want = data_type_to_dtype(_config_default(EmbeddingBagConfig, "data_type"))
    assert ours.table_weight("t0").dtype == want == stock.embedding_bags["t0"].weight.dtype


def _assert_drawn_over(values: torch.Tensor, lo: float, hi: float):
    """Within [lo, hi] and spread over it (a narrower or shifted init fails)."""
    assert lo <= float(values.min()) and float(values.max()) <= hi
    assert float(values.max() - values.min()) > 0.9 * (hi - lo)


@pytest.mark.parametrize("bounds", [{}, {"weight_init_min": -0.01, "weight_init_max": 0.03}], ids=["default", "given"])
def test_tables_start_within_the_configs_init_bounds(bounds):
    """Tables tpurec initialises (a meta-device EBC sharded by DMP, the standalone module) draw from
    TorchRec's bounds: the config's weight_init_min/max, else +-sqrt(1/rows) (TorchRec's getters)."""
    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    ebc = _ebc(rows=400, **bounds)
    config = ebc.embedding_bag_configs()[0]
    lo, hi = config.get_weight_init_min(), config.get_weight_init_max()
    _assert_drawn_over(EmbeddingBagCollection([config]).embedding_bags["t0"].weight.detach(), lo, hi)  # stock
    _assert_drawn_over(SparseCoreEmbeddingBagCollection([config], torch.optim.SGD).table_weight("t0"), lo, hi)
    shard = _tpurec_dmp(ebc).state_dict()["embedding_bags.t0.weight"]
    _assert_drawn_over(shard.local_shards()[0].tensor, lo, hi)


def test_sequence_tables_start_within_the_configs_init_bounds():
    from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection

    config = EmbeddingConfig(
        name="t0",
        embedding_dim=8,
        num_embeddings=400,
        feature_names=["f0"],
        weight_init_min=-0.01,
        weight_init_max=0.03,
    )
    ours = SparseCoreEmbeddingCollection([config], torch.optim.SGD)
    _assert_drawn_over(ours.kernel.read_weight("t0"), config.get_weight_init_min(), config.get_weight_init_max())


# -- the planner ------------------------------------------------------------------------------


def test_planning_batch_size_is_torchrecs_planner_default():
    """DMP plans for the batch TorchRec's planner assumes when given none (its constructor leaves
    batch_size None and falls back to this)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import Topology

    from tpurec.planner import cli as plan_cli
    from tpurec.sharding import dmp

    assert _defaults(EmbeddingShardingPlanner.__init__)["batch_size"] is None
    stock = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))._batch_size
    assert dmp.DEFAULT_PLANNING_BATCH_SIZE == plan_cli.DMP_PLANNING_BATCH_SIZE == stock


# -- the DLRM model ---------------------------------------------------------------------------


def test_dlrm_model_is_torchrecs_with_default_table_configs():
    """`tpurec train`'s model is torchrec.models.dlrm's, over tables configured with TorchRec's defaults
    (pooling, data type, init bounds, ...), and its fused tables' eps is what stock TorchRec's DMP
    would take (FBGEMM's). The dense Adagrad's eps differs from torch's on purpose (docs/dmp.md)."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

    from tpurec.dlrm.configs import CONFIGS
    from tpurec.dlrm.model import _optimizer, build_model

    tbe = _tbe_defaults()
    for cfg in (CONFIGS["dlrm-tiny"], dataclasses.replace(CONFIGS["dlrm-tiny"], interaction="dcn")):
        model = build_model(cfg)
        assert type(model) is DLRMTrain
        assert type(model.model) is (DLRM_DCN if cfg.interaction == "dcn" else DLRM)
        for c in model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs():
            given = {"name", "embedding_dim", "num_embeddings", "feature_names", "init_fn"}
            for f in dataclasses.fields(EmbeddingBagConfig):
                if f.name not in given:
                    assert getattr(c, f.name) == f.default, (c.name, f.name)
    assert CONFIGS["dlrm-tiny"].eps == tbe["eps"]  # the tables' eps, as TorchRec's fused kernel's default
    torch_adagrad_eps = _defaults(torch.optim.Adagrad.__init__)["eps"]
    cls, kwargs = _optimizer("adagrad", 0.1, CONFIGS["dlrm-tiny"].eps)
    assert cls is torch.optim.Adagrad and kwargs["eps"] == tbe["eps"] != torch_adagrad_eps
