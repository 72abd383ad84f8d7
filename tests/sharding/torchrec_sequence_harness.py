"""TorchRec's model-parallel harness on a sequence (EmbeddingCollection) model, with tpurec's EC sharder.

TorchRec's sequence-model tests (torchrec repo: `distributed/tests/test_sequence_model_parallel.py`,
not in the wheel) call the wheel's harness, `sharding_single_rank_test`, with a model of their own
(`TestSequenceSparseNN` of `distributed/tests/test_sequence_model.py`: one EmbeddingCollection whose
sequences are padded to a fixed length and fed, with the dense arch's output, to a linear layer), six
16-dim tables (11, 22, 33, 44, 11, 22 rows; the last two reading feature_0 and feature_1 again),
EXACT_SGD, and a `TestEmbeddingCollectionSharder` (one sharding type, one kernel, fused
learning_rate 0.1). Those files are not shipped; this module holds our own model of the same shape
(`SequenceHarnessNN`) and sharder classes, and runs the wheel's
`sharding_single_rank_test_single_process` (the body of `sharding_single_rank_test` once the process
group exists) with them: it builds the unsharded model and the global/local `ModelInput`s
(`ModelInput.generate` takes `EmbeddingConfig` tables), shards a meta-device copy with the given
sharder, planner and DMP, copies the weights over with `copy_state_dict`, trains both one step and
compares the predictions after the step.

For tpurec's runs, as in torchrec_harness.py, the planner and DMP the harness hard-wires are patched
(`EmbeddingShardingPlanner` -> `TpurecHarnessPlanner`, `DistributedModelParallel` ->
`tpurec.DistributedModelParallel`); the sharder is passed in. With `case["stock"]` nothing is
patched: stock TorchRec's `EmbeddingCollectionSharder` (FBGEMM's fused kernel), planner and DMP run.

Beyond the harness's check each case records, through a forward hook on the sparse arch, every
feature's padded sequence embeddings in the training forward and in the forward after the step (sharded:
local batch; unsharded: global batch), and every table before and after the step.
"""

from __future__ import annotations

import copy
import traceback
from contextlib import ExitStack
from typing import Any, Dict, List, cast
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torchrec.distributed.test_utils.test_model import ModelInput, TestDenseArch, TestSparseNNBase
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .torchrec_harness import TpurecHarnessPlanner, _harness

MAX_LEN = 16  # ModelInput.generate's lengths are |N(10, 1)|: 16 is 6 sigma away
# The sparse arch's output is scaled up (TorchRec's sequence model does the same, for the same
# reason): otherwise the predictions barely depend on the embeddings.
SPARSE_SCALE = 10.0


class PaddedSequenceArch(nn.Module):
    """An EmbeddingCollection whose output sequences are each padded with zeros to MAX_LEN ids and
    flattened: (batch, sum over embedding names of MAX_LEN * dim)."""

    def __init__(self, tables: List[EmbeddingConfig], embedding_names: List[str], device=None) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=tables, device=device or torch.device("cpu"))
        self.embedding_names = embedding_names

    def forward(self, features: KeyedJaggedTensor, batch_size: int) -> torch.Tensor:
        sequences = self.ec(features)
        return torch.cat([_pad(sequences[name], batch_size) for name in self.embedding_names], dim=1)


def _pad(jt, batch_size: int) -> torch.Tensor:
    values, lengths = jt.values(), jt.lengths().long()
    if lengths.numel() and int(lengths.max()) > MAX_LEN:
        # Truncating would hide ids from every check: refuse instead.
        raise ValueError(f"a sequence of {int(lengths.max())} ids is longer than MAX_LEN={MAX_LEN}")
    dim = values.size(1)
    starts = torch.cumsum(lengths, 0) - lengths
    row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.arange(values.size(0)) - torch.repeat_interleave(starts, lengths)
    # batch_size rows, not lengths.numel(): with the harness's variable_batch_size a rank's KJT holds
    # fewer samples than its float features (rank 1: 3 of 4); the trailing ones have no ids (zero
    # rows), as in the global batch (the sequence check compares those rows too).
    padded = values.new_zeros(batch_size, MAX_LEN, dim).index_put((row, pos), values)
    return padded.view(batch_size, MAX_LEN * dim)


class SequenceHarnessNN(TestSparseNNBase):
    """A sequence model the harness can build: the constructor arguments it passes its model class,
    `forward(ModelInput)` returning (loss, prediction) in training and the prediction otherwise.
    The EC's embedding names are those of the first embedding group (in its order)."""

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        num_float_features: int = 16,
        weighted_tables: List[EmbeddingConfig] | None = None,
        embedding_groups: Dict[str, List[str]] | None = None,
        dense_device: torch.device | None = None,
        sparse_device: torch.device | None = None,
        feature_processor_modules=None,
    ) -> None:
        # TorchRec's base takes List[BaseEmbeddingConfig] (invariant): these are EmbeddingConfigs
        super().__init__(
            cast(List[BaseEmbeddingConfig], tables),
            cast(List[BaseEmbeddingConfig] | None, weighted_tables),
            embedding_groups,
            dense_device,
            sparse_device,
        )
        if weighted_tables or feature_processor_modules:
            raise ValueError("an EmbeddingCollection has no weighted features")
        assert embedding_groups is not None, "TorchRec's test model passes its embedding groups"
        names = list(embedding_groups.values())[0]
        dims = {n: t.embedding_dim for t, n in embedding_names(tables)}
        self.dense = TestDenseArch(num_float_features, dense_device)
        self.sparse = PaddedSequenceArch(tables, names, device=sparse_device)
        in_features = self.dense.linear.out_features + sum(MAX_LEN * dims[n] for n in names)
        self.over = nn.Linear(in_features, 16, device=dense_device)

    def forward(self, input: ModelInput):
        dense = self.dense(input.float_features)
        sparse = self.sparse(input.idlist_features, input.float_features.size(0))
        logit = self.over(torch.cat([dense, SPARSE_SCALE * sparse], dim=1)).mean(dim=1)
        pred = torch.sigmoid(logit)
        if self.training:
            return nn.functional.binary_cross_entropy_with_logits(logit, input.label), pred
        return pred


def tables() -> List[EmbeddingConfig]:
    """TorchRec's sequence tests' tables: 4 features on tables of 11 * (i + 1) rows, and 2 more
    tables reading feature_0 and feature_1 again (so those features' embedding names are
    `feature@table`)."""
    out = [
        EmbeddingConfig(
            name=f"table_{i}", num_embeddings=(i + 1) * 11, embedding_dim=16, feature_names=[f"feature_{i}"]
        )
        for i in range(4)
    ]
    out += [
        EmbeddingConfig(
            name=f"table_{i + 4}", num_embeddings=(i + 1) * 11, embedding_dim=16, feature_names=[f"feature_{i}"]
        )
        for i in range(2)
    ]
    return out


def embedding_names(tabs: List[EmbeddingConfig]) -> list:
    """(table, embedding name) per output of an EmbeddingCollection over `tabs`: a feature read by
    several tables is named `feature@table`, as the EC names it."""
    count: Dict[str, int] = {}
    for t in tabs:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    return [(t, f"{f}@{t.name}" if count[f] > 1 else f) for t in tabs for f in t.feature_names]


def embedding_groups(tabs: List[EmbeddingConfig]) -> Dict[str, List[str]]:
    return {"group_0": [name for _, name in embedding_names(tabs)]}


def _one_type(base):
    class OneShardingType(base):
        """TorchRec's TestEmbeddingCollectionSharder on `base`: one sharding type, one kernel, fused
        learning rate 0.1 unless given."""

        def __init__(self, sharding_type, kernel_type, fused_params=None, qcomm_codecs_registry=None):
            self._sharding_type = sharding_type
            self._kernel_type = kernel_type
            fused_params = {"learning_rate": 0.1, **(fused_params or {})}
            super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)

        def sharding_types(self, compute_device_type):
            return [self._sharding_type]

        def compute_kernels(self, sharding_type, compute_device_type):
            return [self._kernel_type]

    OneShardingType.__qualname__ = f"OneShardingType{base.__name__}"
    return OneShardingType


def in_backward_config(optim: str):
    """The harness's `apply_optimizer_in_backward_config` (on both models' embedding parameters:
    names containing "embeddings"). "in_backward_sgd" is TorchRec's sequence tests' own (lr 0.2)."""
    if optim == "in_backward_sgd":
        return {"embeddings": (torch.optim.SGD, {"lr": 0.2})}
    if optim == "in_backward_rowwise_adagrad":
        from torchrec.optim import RowWiseAdagrad

        return {"embeddings": (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-6})}
    assert optim == "fused_sgd", optim
    return None  # the sharder's fused SGD at 0.1, as the unsharded model's torch.optim.SGD


def harness_kwargs(case: dict, pg, rank: int, world_size: int) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
    from torchrec.distributed.planner import ParameterConstraints

    from tpurec.planner.kernel_choice import COMPUTE_KERNEL
    from tpurec.sharding.ec_sharder import SparseCoreECSharder

    tabs = tables()
    qcomms = QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16) if case["qcomms"] else None
    registry = get_qcomm_codecs_registry(qcomms, device=torch.device("cpu")) if qcomms else None
    base, kernel = (EmbeddingCollectionSharder, "fused") if case.get("stock") else (SparseCoreECSharder, COMPUTE_KERNEL)
    fused = {"learning_rate": case["learning_rate"]} if "learning_rate" in case else None
    sharder = _one_type(base)(case["sharding"], kernel, fused_params=fused, qcomm_codecs_registry=registry)
    constraints = None
    if case["sharding"] == "column_wise":  # as TorchRec's test_sharding_nccl_cw: 16-dim tables in 2 shards
        constraints = {t.name: ParameterConstraints(min_partition=8) for t in tabs}
    index = {"int32": torch.int32, "int64": torch.int64}[case["index"]]
    config = in_backward_config(case["optim"])
    return dict(
        pg=pg,
        device=torch.device("cpu"),
        rank=rank,
        world_size=world_size,
        model_class=SequenceHarnessNN,
        embedding_groups=embedding_groups(tabs),
        tables=tabs,
        sharders=[sharder],
        optim=EmbOptimType.EXACT_SGD,
        constraints=constraints,
        qcomms_config=qcomms,
        # A fresh copy per case: TorchRec's sharding adds keys to the kwargs dicts registered on the
        # parameters.
        apply_optimizer_in_backward_config=copy.deepcopy(config),
        variable_batch_size=case["variable_batch"],
        global_constant_batch=True,  # as TorchRec's sequence tests pass it
        use_offsets=case["offsets"],
        indices_dtype=index,
        offsets_dtype=index,
        lengths_dtype=index,
    )


def _full_tables(model, rank: int) -> dict:
    """Every table of a (sharded or not) model as a full FP32 tensor; sharded ones gathered to rank 0
    (a collective: every rank calls it)."""
    out = {}
    for key, value in model.state_dict().items():
        if ".embeddings." not in key:
            continue
        if hasattr(value, "local_shards"):
            dst = torch.zeros(value.size(), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=dst)
            value = dst
        if value is not None:
            out[key] = value.detach().float().clone()
    return out


def run_case(case: dict, rank: int, world_size: int) -> dict:
    """One harness run. The harness's own check may fail; the models it trained are still compared."""
    import tpurec

    ts = _harness()
    seen = []  # (model, sparse arch outputs, tables before the step) in the order the harness steps them
    original_step = ts.gen_full_pred_after_one_step

    def recording_step(model, opt, input, *args, **kwargs):
        calls: list = []
        inner = getattr(model, "module", model)
        handle = inner.sparse.register_forward_hook(lambda _m, _i, out: calls.append(out.detach().clone()))
        before = None if isinstance(model, ts.DistributedModelParallel) else _full_tables(model, rank)
        seen.append((model, calls, before))
        try:
            return original_step(model, opt, input, *args, **kwargs)
        finally:
            handle.remove()

    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(ts, "gen_full_pred_after_one_step", recording_step))
        if not case.get("stock"):
            patches.enter_context(mock.patch.object(ts, "EmbeddingShardingPlanner", TpurecHarnessPlanner))
            patches.enter_context(mock.patch.object(ts, "DistributedModelParallel", tpurec.DistributedModelParallel))
        kwargs = harness_kwargs(case, dist.group.WORLD, rank, world_size)
        error = None
        try:
            ts.sharding_single_rank_test_single_process(**kwargs)
        except Exception:  # the harness's check (or anything before it): reported, models still compared
            error = traceback.format_exc()
    result: dict[str, Any] = {"harness_error": error}
    sharded = [s for s in seen if isinstance(s[0], ts.DistributedModelParallel)]
    unsharded = [s for s in seen if not isinstance(s[0], ts.DistributedModelParallel)]
    if sharded:
        model, calls, _ = sharded[0]
        result["sequences"] = calls
        result["dmp"] = f"{type(model).__module__}.{type(model).__qualname__}"
        result["sharded_module"] = type(model.module.sparse.ec).__qualname__
        result["tables"] = _full_tables(model, rank)
        result["kernels"] = sorted({ps.compute_kernel for mp in model.plan.plan.values() for ps in mp.values()})
        result["sharding_types"] = sorted({ps.sharding_type for mp in model.plan.plan.values() for ps in mp.values()})
    if unsharded:
        model, calls, before = unsharded[0]
        result["global_sequences"] = calls
        result["global_tables_before"] = before
        result["global_tables"] = _full_tables(model, rank)
    return result


def run_cases(rank: int, world_size: int, cases: list) -> list:
    """Rank function for tests.sharding.multiprocess.run_ranks: every case in turn on this rank."""
    torch.use_deterministic_algorithms(True)  # as the harness's MultiProcessContext sets
    out = []
    for case in cases:
        try:
            out.append(run_case(case, rank, world_size))
        except Exception:
            out.append({"harness_error": traceback.format_exc(), "setup_error": True})
        dist.barrier()
    return out
