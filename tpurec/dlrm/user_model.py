"""`tpurec train --model-module MOD:FN`: the user's own TorchRec model, trained by the same Trainer.

The contract is `tpurec plan --model-module`'s (tpurec/planner/model_module.py: FN() returns the model,
or `(model, constraints)`), plus what training needs (docs/your_model.md):

- the model's forward takes `(dense_features, sparse_features)`: a float32 tensor [B, D] of the data's
  dense columns, in the data's order, and a KeyedJaggedTensor keyed by feature name, each feature read
  from the data column of its name; it returns logits, [B] or [B, 1] (TorchRec's DLRM and DLRM_DCN
  are such models). tpurec adds the loss as TorchRec's DLRMTrain does (binary cross-entropy on the
  logits), in `UserModelTrain`;
- or its forward takes one `batch` (torchrec.datasets.utils.Batch) and returns
  `(loss, (loss, logits, labels))`, as DLRMTrain does: it is trained as it is.

The tables' optimizer is the model's own when it set one (apply_optimizer_in_backward), else the
run's `--embedding-optimizer` / `--embedding-lr`, fused into backward as for the built-in models.
Only the model is the user's: data, DMP, pipeline, evaluation, checkpoints and reports are the Trainer's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tpurec.errors import UserError

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.planner.types import ParameterConstraints

    from tpurec.data.catalog import TableSpec
    from tpurec.dlrm.configs import DLRMConfig
    from tpurec.planner.model_module import ModelFeature


class UserModelTrain(torch.nn.Module):
    """The user's (dense, KJT) -> logits model with DLRMTrain's loss and outputs: forward(batch) ->
    (loss, (loss, logits, labels)), what TorchRec's TrainPipelineSparseDist and the Trainer take. The
    model sits at `.model`, as in DLRMTrain (checkpoint keys `model.<the model's own>`)."""

    def __init__(self, model: nn.Module, target: str) -> None:
        super().__init__()
        self.model = model
        self.target = target
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        try:
            logits = self.model(batch.dense_features, batch.sparse_features)
        except Exception as e:  # raised in the user's forward (also under the pipeline's torch.fx trace)
            from tpurec.planner.model_module import raised_by_user_code, user_code_failed

            if not raised_by_user_code(e):
                raise  # out of tpurec: a bug, its traceback kept
            raise user_code_failed(self.target, f"{type(self.model).__name__}.forward", e) from e
        tensor = isinstance(logits, (torch.Tensor, torch.fx.Proxy))  # a Proxy: the tensor under the trace
        if not tensor:
            raise UserError(
                f"--model-module {self.target!r}: {type(self.model).__name__}.forward returned "
                f"{type(logits).__name__}, not a tensor of logits ([B] or [B, 1] for a batch of B; docs/your_model.md)"
            )
        # TorchRec's pipeline traces this forward (torch.fx) to find the input distribution: no checks then
        if not torch.fx._symbolic_trace.is_fx_tracing():
            self._check(logits, batch.labels)
        logits = logits.reshape(-1)  # [B, 1] -> [B]
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())

    def _check(self, logits: Any, labels: torch.Tensor) -> None:
        """Logits [B] or [B, 1], or one line saying what shape the model returned."""
        b = labels.shape[0]
        if tuple(logits.shape) not in ((b,), (b, 1)):
            raise UserError(
                f"--model-module {self.target!r}: the model returned logits of shape {list(logits.shape)} for a batch "
                f"of {b}; expected [{b}] or [{b}, 1]"
            )


@dataclass
class UserModel:
    """A loaded `--model-module` target: the module to shard (forward(batch)), its constraints, tables
    and features, and how many dense features it takes (None: it does not say; the data's count)."""

    target: str
    module: nn.Module
    constraints: dict[str, ParameterConstraints] | None
    tables: list[TableSpec]
    features: list[ModelFeature]
    dense_in_features: int | None
    own_optimizer: bool  # the model set its tables' optimizer (apply_optimizer_in_backward)

    def remap_ranges(self) -> dict[str, int]:
        """{feature: its remap's input range} of the features of managed-collision tables: the reader
        hands them the column's ids unhashed (below that range), for TorchRec's remap to place."""
        return {f.name: f.remap_range for f in self.features if f.remap_range is not None}

    def checkpoint_config(self) -> dict:
        """What a checkpoint records of the model, for a resume to match: the target and its tables."""
        return {
            "model_module": self.target,
            "tables": {t.name: [t.num_embeddings, t.embedding_dim] for t in self.tables},
        }


def _takes_batch(model: nn.Module) -> bool | None:
    """True: forward(batch); False: forward(dense, sparse); None: neither (wrong model for training)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False  # a compiled or C forward: assume the (dense, sparse) form and let the step tell
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params) or len(positional) >= 2:
        return False
    if len(positional) == 1 and positional[0].name == "batch":
        return True
    return None


BATCH_CALL = (
    "train calls a forward of one argument with the batch (a torchrec Batch: dense_features, sparse_features, "
    "labels) and trains it on its own loss, as DLRMTrain"
)


def _checked_batch_forward(self: nn.Module, batch: Any, *, target: str) -> Any:
    """A forward(batch) model's own forward, with what it raises or returns other than DLRMTrain's
    (loss, (loss, logits, labels)) as one line: TorchRec's pipeline unpacks the result itself
    (`ValueError: too many values to unpack`). Bound to the instance (`_check_batch_forward`): the
    pipeline's torch.fx trace reads the class's forward, and a deep copy binds to its copy."""
    name = f"{type(self).__name__}.forward(batch)"
    try:
        out = type(self).forward(self, batch)
    except Exception as e:
        from tpurec.planner.model_module import raised_by_user_code, user_code_failed

        if not raised_by_user_code(e):
            raise  # out of tpurec: a bug, its traceback kept
        raise user_code_failed(target, name, e, BATCH_CALL) from e
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (tuple, list)) and len(out[1]) == 3):
        what = type(out).__name__ if not isinstance(out, tuple) else f"a tuple of {len(out)}"
        raise UserError(
            f"--model-module {target!r}: {name} returned {what}, not (loss, (loss, logits, labels)): {BATCH_CALL}; "
            "a model returning logits takes (dense_features, sparse_features) (docs/your_model.md)"
        )
    return out


def _check_batch_forward(model: nn.Module, target: str) -> None:
    import functools
    import types

    # an instance attribute, not a submodule or a buffer: the state dict's keys stay the model's own
    model.forward = types.MethodType(functools.partial(_checked_batch_forward, target=target), model)


def _embedding_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    params: list[torch.nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            params += list(m.parameters())
    return params


def load(target: str, seed: int) -> UserModel:
    """Build the user's model (the torch seed set first: every rank, and every run with this seed,
    initialises the dense part alike) and check it can be trained; one UserError line otherwise."""
    from tpurec.planner import model_module

    torch.manual_seed(seed)
    model, constraints = model_module.load_model(target)
    takes_batch = _takes_batch(model)
    if takes_batch is None:
        raise UserError(
            f"--model-module {target!r}: {type(model).__name__}.forward takes neither (dense_features, "
            "sparse_features) nor (batch): training needs the whole model, returning logits (docs/your_model.md)"
        )
    params = _embedding_parameters(model)
    own = any(getattr(p, "_optimizer_classes", None) for p in params)
    if takes_batch:
        _check_batch_forward(model, target)
    module = model if takes_batch else UserModelTrain(model, target)
    return UserModel(
        target,
        module,
        constraints,
        model_module.model_tables(model, constraints),
        model_module.model_features(model, constraints),
        model_module.dense_in_features(model),
        own,
    )


def apply_table_optimizer(user: UserModel, cfg: DLRMConfig) -> None:
    """The run's table optimizer fused into backward, unless the model set its own."""
    if user.own_optimizer:
        return
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tpurec.dlrm.model import table_optimizer

    cls, kwargs = table_optimizer(cfg)
    apply_optimizer_in_backward(cls, _embedding_parameters(user.module), kwargs)


def data_table_sizes(user: UserModel, meta: dict, where: str) -> list[int]:
    """For each sparse column of the data (its metadata `meta`), the size its ids are read into: the
    model's table for a feature the model reads (raw ids are hashed into it), the remap's input range
    for a feature of a managed-collision table (raw ids go to the remap unhashed, `remap_ranges`), the
    data's own for a column it does not read. One line naming the column when data and model disagree."""
    sparse = meta.get("sparse") or []
    names = [f["name"] for f in sparse]
    missing = [f.name for f in user.features if f.name not in names]
    if missing:
        raise UserError(
            f"{where}: no column for feature(s) {', '.join(missing[:8])} of --model-module {user.target} "
            f"(a feature is read from the sparse column of its name); the data's sparse columns: {_listing(names)}"
        )
    dense = meta.get("dense") or []
    if user.dense_in_features is not None and len(dense) != user.dense_in_features:
        raise UserError(
            f"{where}: {len(dense)} dense column(s){_named(dense)}; --model-module {user.target} takes "
            f"{user.dense_in_features} (its dense_in_features){_inference(user, meta)}"
        )
    by_name = {f.name: f for f in user.features}
    sizes = []
    for f in sparse:
        held = f.get("num_embeddings")
        feature = by_name.get(f["name"])
        if feature is None:  # a column the model does not read: its ids go nowhere
            sizes.append(int(held) if held is not None else 2)
            continue
        bound = feature.rows if feature.remap_range is None else feature.remap_range
        if held is not None and int(held) > bound:
            takes = (
                f"has {bound:,} rows"
                if feature.remap_range is None
                else f"takes ids below {bound:,} (its remap's input_hash_size)"
            )
            raise UserError(
                f"{where}: column {f['name']!r} holds ids in [0, {int(held):,}), but table {feature.table!r} of "
                f"--model-module {user.target} {takes}"
            )
        sizes.append(bound if held is None else int(held))
    return sizes


def _named(columns: list[str]) -> str:
    return f" ({_listing(columns, 6)})" if columns else ""


def _inference(user: UserModel, meta: dict) -> str:
    """What the column mapping inferred that explains a dense count other than the model's: the integer
    columns read as sparse that no table of the model reads, or the float columns read as dense."""
    inferred = meta.get("mapping_inferred") or []
    kinds = meta.get("sparse_kinds") or {}
    read = {f.name for f in user.features}
    dense = list(meta.get("dense") or [])
    if "sparse" in inferred:
        unread = [n for n, k in kinds.items() if k == "int" and n not in read]
        if unread and len(dense) < (user.dense_in_features or 0):
            return (
                f"; the column mapping inferred integer column(s) {_listing(unread, 6)} as sparse, and no table of "
                f"the model reads them: give --dense {','.join([*dense, *unread])} (or --columns FILE) to read them "
                "as dense"
            )
    if "dense" in inferred:
        return "; the column mapping inferred the float and bool columns as dense: give --dense COL,... to choose"
    return ""


def _listing(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f" ... ({len(names)} in all)" if len(names) > most else "")
