"""TorchRec's own model-parallel test harness, run with tpurec's sharder, planner and DMP.

The harness is shipped in the torchrec wheel: `torchrec.distributed.test_utils.test_sharding`
(`sharding_single_rank_test_single_process`: the body of `sharding_single_rank_test` once its
`MultiProcessContext` has made the process group), the `TestSparseNN` model and `ModelInput`
generator of `test_utils/test_model.py`, and the tables, groups and options of `ModelParallelTestShared`
in `test_utils/test_model_parallel.py`. It builds an unsharded `TestSparseNN` (6 tables, dims 16 to 40,
two of them sharing features, plus 2 weighted tables and dense layers), copies its weights into a
sharded one with `copy_state_dict`, trains both one step on the same global batch and compares the
8 predictions after the step.

Here tpurec replaces what the harness hard-wires, each by patching one module attribute of
`test_sharding` that the harness looks up when it runs:

* `TestEBCSharder` -> `OneShardingTypeSparseCoreSharder`: the harness's `create_test_sharder` builds
  its sharder from this name (one sharding type, one kernel, fused params with learning_rate 0.1,
  the qcomm codecs of its `QCommsConfig`); ours has the same constructor and restrictions;
* `EmbeddingShardingPlanner` -> `TpurecHarnessPlanner`: tpurec's planner (its topology for the
  harness's world size on CPU, the harness's constraints, the sharders);
* `DistributedModelParallel` -> `tpurec.DistributedModelParallel`.

Two more patches serve stock TorchRec's runs as well: `alter_global_ebc_dtype` keeps the unsharded
model's in-backward optimizers (`_keeping_in_backward_optimizers`), and `gen_full_pred_after_one_step`
is wrapped to record what the checks below need (it calls the harness's own). The harness itself is
imported through `_harness()` (a module the wheel lacks). With `case["stock"]`, only the recording
and the optimizer fix apply: stock TorchRec's sharder (FBGEMM's fused kernel), planner and DMP run.

Beyond the harness's own check, each case records (rank functions return them to the test):
each feature's pooled output of the sparse arch (both EBCs' KeyedTensor) in the training forward
and in the forward after the step, for the sharded model (local batch) and the unsharded one
(global batch); and every table before and after the step (sharded: gathered to rank 0).
"""

from __future__ import annotations

import copy
import sys
import traceback
import types
from contextlib import ExitStack
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist


def _harness():
    """Import TorchRec's harness module. In the wheel, `test_sharding` imports
    `torchrec.distributed.tests.test_sequence_model` (the torchrec repo's own tests, not shipped) for
    one name, `TestEmbeddingCollectionSharder`, used only by its 2D-parallel `submodule_configs` path;
    a stand-in module supplies that name (raising if ever used) so the harness imports."""
    name = "torchrec.distributed.tests.test_sequence_model"
    try:
        import torchrec.distributed.tests.test_sequence_model  # noqa: F401
    except ModuleNotFoundError:
        tests_pkg = types.ModuleType("torchrec.distributed.tests")
        tests_pkg.__path__ = []
        seq = types.ModuleType(name)

        class TestEmbeddingCollectionSharder:  # only the harness's 2D-parallel path builds one
            def __init__(self, *args, **kwargs):
                raise NotImplementedError("2D-parallel submodule_configs need torchrec's repo tests")

        seq.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder
        sys.modules.setdefault("torchrec.distributed.tests", tests_pkg)
        sys.modules.setdefault(name, seq)
    from torchrec.distributed.test_utils import test_sharding

    return test_sharding


def _sharder_class():
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    class OneShardingTypeSparseCoreSharder(SparseCoreEBCSharder):
        """TorchRec's TestEBCSharder (one sharding type, one kernel) on tpurec's sharder."""

        def __init__(self, sharding_type, kernel_type, fused_params=None, qcomm_codecs_registry=None):
            self._sharding_type = sharding_type
            self._kernel_type = kernel_type
            super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)

        def sharding_types(self, compute_device_type):
            return [self._sharding_type]

        def compute_kernels(self, sharding_type, compute_device_type):
            return [self._kernel_type]

    return OneShardingTypeSparseCoreSharder


class TpurecHarnessPlanner:
    """Stands where the harness builds `EmbeddingShardingPlanner(topology=Topology(...), constraints=...)`
    and calls `.collective_plan(model, sharders, pg)`: plans with tpurec's planner on tpurec's CPU
    topology of the same world size."""

    def __init__(self, topology, constraints=None, **_ignored):
        self._world_size = topology.world_size
        self._constraints = constraints

    def collective_plan(self, module, sharders, pg):
        from tpurec.planner.planners import plan
        from tpurec.planner.topology import make_topology
        from tpurec.sharding.dmp import DEFAULT_PLANNING_BATCH_SIZE

        topology = make_topology(None, world_size=self._world_size, compute_device="cpu")
        return plan(
            module,
            topology,
            batch_size=DEFAULT_PLANNING_BATCH_SIZE,
            constraints=self._constraints,
            sharders=sharders,
            pg=pg,
        )


def tables_and_groups(data_type):
    """`ModelParallelTestShared._build_tables_and_groups` of test_model_parallel.py: that method only
    fills attributes of a unittest.TestCase, so it is run on a bare stand-in for `self`."""
    from torchrec.distributed.test_utils.test_model_parallel import ModelParallelTestShared

    shared = types.SimpleNamespace(
        num_features=4,
        num_weighted_features=2,
        num_shared_features=2,
        table_names=[f"table_{i}" for i in range(6)],
    )
    ModelParallelTestShared._build_tables_and_groups(shared, data_type=data_type)
    return shared


IN_BACKWARD_SGD = {  # test_model_parallel.py's apply_optimizer_in_backward_config
    "embedding_bags": (torch.optim.SGD, {"lr": 0.01}),
    "embeddings": (torch.optim.SGD, {"lr": 0.2}),
}


def harness_kwargs(case: dict, pg, rank: int, world_size: int) -> dict:
    """The arguments `ModelParallelTestShared._test_sharding` passes the harness, for one case."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.distributed.test_utils.test_sharding import SharderType, create_test_sharder
    from torchrec.modules.embedding_configs import DataType, PoolingType

    from tpurec.planner.kernel_choice import COMPUTE_KERNEL

    t = tables_and_groups(DataType[case["dtype"].upper()])
    qcomms = QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16) if case["qcomms"] else None
    fused_params = None  # create_test_sharder adds {"learning_rate": 0.1}
    if case["optim"] == "fused_explicit":
        fused_params = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    if "learning_rate" in case:  # a deliberately wrong one, to show what the checks catch
        fused_params = {"learning_rate": case["learning_rate"]}
    sharder = create_test_sharder(
        SharderType.EMBEDDING_BAG_COLLECTION.value,
        case["sharding"],
        "fused" if case.get("stock") else COMPUTE_KERNEL,
        fused_params=fused_params,
        qcomms_config=qcomms,
        device=torch.device("cpu"),
    )
    constraints = None
    if case["sharding"] in ("column_wise", "table_column_wise"):  # as test_sharding_cw / _twcw
        constraints = {name: ParameterConstraints(min_partition=4) for name in t.table_names}
    index = {"int32": torch.int32, "int64": torch.int64}[case["index"]]
    pooling = PoolingType[case["pooling"]]
    return dict(
        pg=pg,
        device=torch.device("cpu"),
        rank=rank,
        world_size=world_size,
        model_class=TestSparseNN,
        embedding_groups=t.embedding_groups,
        tables=t.tables if pooling == PoolingType.SUM else t.mean_tables,
        weighted_tables=t.weighted_tables,
        sharders=[sharder],
        optim=EmbOptimType.EXACT_SGD,
        constraints=constraints,
        qcomms_config=qcomms,
        # A fresh copy per case: TorchRec's sharding adds keys to the kwargs dicts registered on the
        # parameters (torchrec's own tests run each case in a new process, so never see it).
        apply_optimizer_in_backward_config=copy.deepcopy(IN_BACKWARD_SGD) if case["optim"] == "in_backward" else None,
        variable_batch_size=case["variable_batch"],
        variable_batch_per_feature=case.get("vbe", False),
        use_offsets=case["offsets"],
        indices_dtype=index,
        offsets_dtype=index,
        lengths_dtype=index,
    )


def _full_tables(model, rank: int) -> dict:
    """Every embedding table of a (sharded or not) model as a full tensor; sharded ones gathered to
    rank 0 (a collective: every rank calls it)."""
    out = {}
    for key, value in model.state_dict().items():
        if ".embedding_bags." not in key:
            continue
        if hasattr(value, "local_shards"):
            dst = torch.zeros(value.size(), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=dst)
            value = dst
        if value is not None:
            out[key] = value.detach().float().clone()
    return out


def _pooled_recorder(model, calls: list):
    """A forward hook on the model's sparse arch (TestEBCSparseArch: the KeyedTensor of both EBCs)."""
    inner = getattr(model, "module", model)

    def hook(_module, _inputs, output):
        calls.append({k: v.detach().float().clone() for k, v in output.to_dict().items()})

    return inner.sparse.register_forward_hook(hook)


def _keeping_in_backward_optimizers(alter):
    """Wraps the harness's `alter_global_ebc_dtype`, which makes the unsharded model's weighted tables
    fp32 by re-creating each as a new `nn.Parameter(weight.float())` (even when it is fp32 already).
    A new Parameter has lost the in-backward SGD (lr 0.01) registered on the old one, so those tables
    then train with the dense SGD (lr 0.1) instead: stock TorchRec's own run shows its weighted tables
    updated 10x less than the unsharded ones, unseen by the prediction check. Here fp32 tables are
    left as they are, and FP16 ones converted as the harness does, then given the old Parameter's
    in-backward optimizers again."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    def wrapped(model) -> None:
        bags = [
            bag
            for m in model.modules()
            if isinstance(m, EmbeddingBagCollection) and m._is_weighted
            for bag in m.embedding_bags.values()
        ]
        if all(bag.weight.dtype == torch.float32 for bag in bags):
            return
        old = [bag.weight for bag in bags]
        alter(model)
        for bag, param in zip(bags, old):
            # From the optimizers themselves: `_optimizer_kwargs` holds the harness's dicts, which
            # TorchRec's sharding of the other model has added fused-param keys to by now.
            for opt in getattr(param, "_in_backward_optimizers", []):
                _apply_optimizer_in_backward(type(opt), [bag.weight], dict(opt.defaults))

    return wrapped


def run_case(case: dict, rank: int, world_size: int) -> dict:
    """One harness run. The harness's own check may fail; the models it trained are still compared."""
    import tpurec

    ts = _harness()
    seen = []  # (model, pooled calls, tables before the step) in the order the harness steps them
    original_step = ts.gen_full_pred_after_one_step

    def recording_step(model, opt, input, *args, **kwargs):
        calls: list = []
        handle = _pooled_recorder(model, calls)
        before = None if isinstance(model, ts.DistributedModelParallel) else _full_tables(model, rank)
        seen.append((model, calls, before))
        try:
            return original_step(model, opt, input, *args, **kwargs)
        finally:
            handle.remove()

    with ExitStack() as patches:
        # Record the models, pooled outputs and tables at the harness's training steps.
        patches.enter_context(mock.patch.object(ts, "gen_full_pred_after_one_step", recording_step))
        patches.enter_context(
            mock.patch.object(ts, "alter_global_ebc_dtype", _keeping_in_backward_optimizers(ts.alter_global_ebc_dtype))
        )
        if not case.get("stock"):
            # The three stock classes the harness hard-wires, each replaced by tpurec's.
            patches.enter_context(mock.patch.object(ts, "TestEBCSharder", _sharder_class()))
            patches.enter_context(mock.patch.object(ts, "EmbeddingShardingPlanner", TpurecHarnessPlanner))
            patches.enter_context(mock.patch.object(ts, "DistributedModelParallel", tpurec.DistributedModelParallel))
        kwargs = harness_kwargs(case, dist.group.WORLD, rank, world_size)
        error = None
        try:
            ts.sharding_single_rank_test_single_process(**kwargs)
        except Exception:  # the harness's check (or anything before it): reported, models still compared
            error = traceback.format_exc()
    result: dict[str, Any] = {"harness_error": error, "batch_size": 4}
    sharded = [s for s in seen if isinstance(s[0], ts.DistributedModelParallel)]
    unsharded = [s for s in seen if not isinstance(s[0], ts.DistributedModelParallel)]
    if sharded:
        model, calls, _ = sharded[0]
        result["pooled"] = calls
        result["dmp"] = f"{type(model).__module__}.{type(model).__qualname__}"
        result["tables"] = _full_tables(model, rank)
        result["kernels"] = sorted(
            {ps.compute_kernel for module_plan in model.plan.plan.values() for ps in module_plan.values()}
        )
        result["sharding_types"] = sorted(
            {ps.sharding_type for module_plan in model.plan.plan.values() for ps in module_plan.values()}
        )
    if unsharded:
        model, calls, before = unsharded[0]
        result["global_pooled"] = calls
        result["global_tables_before"] = before
        result["global_tables"] = _full_tables(model, rank)
    return result


def run_cases(rank: int, world_size: int, cases: list) -> list:
    """Rank function for tests.sharding.multiprocess.run_ranks: every case in turn on this rank."""
    # What the harness's MultiProcessContext sets besides the process group.
    torch.use_deterministic_algorithms(True)
    out = []
    for case in cases:
        try:
            out.append(run_case(case, rank, world_size))
        except Exception:
            out.append({"harness_error": traceback.format_exc(), "setup_error": True})
        dist.barrier()
    return out
