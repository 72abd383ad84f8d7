"""Which KeyedJaggedTensor of a batch feeds which sharded EmbeddingBagCollection, for the compiled and
pipelined steps (compiled.py, pipelined.py).

A model's forward hands each sharded EBC a KJT of its batch: TorchRec's DLRM hands
`batch.sparse_features` to its one EBC; a model of several EBCs may hand them all the same KJT (each
takes its own features, as TorchRec's input dist selects them) or each a field of its own (TorchRec's
test models: `idlist_features` and `idscore_features`). The steps run each EBC's host half ahead of the
compiled part, so each such field is replaced by a `ModuleInputs`: for every sharded EBC it feeds,
that module's SparseCore inputs (`ShardedPreprocessed`) or its looked-up activations
(`ShardedActivations`); each module's forward takes its own part (`ShardedSparseCoreEBC.forward`).

A sharded EBC is fed by the one field of the batch (a dataclass) whose keys hold every feature it
reads; none, or more than one, is a one-line UserError before anything runs: a part prepared for a
field the model does not hand to it would be a batch the module never sees (its input dist's
collectives would still run, and a pipelined step would update its tables from a zero gradient).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.errors import UserError
from tpurec.sharding.sharded_preprocess import ModuleInputs


def sharded_ebcs(model: nn.Module, who: str, fp: bool = False) -> list[Any]:
    """The model's tpurec-sharded EmbeddingBagCollections and EmbeddingCollections (and with `fp`,
    FeatureProcessedEmbeddingBagCollections over tpurec's EBC sharder: fp_preprocess.py), in module
    order; at least one. An EmbeddingCollection must be on its fixed-shape output path
    (ec_preprocess.py). Any other sharded module (an FP-EBC without `fp`, whose own forward runs the
    EBC inside it, stock TorchRec's) is refused by name: the step would hand it SparseCore inputs it
    does not take."""
    from torchrec.distributed.types import ShardedModule

    from tpurec.sharding.ec_preprocess import fixed_path_needed
    from tpurec.sharding.ec_sharder import ShardedSparseCoreEC
    from tpurec.sharding.fp_sharder import ShardedSparseCoreFPEBC
    from tpurec.sharding.sharder import ShardedSparseCoreEBC

    others, inner = [], set()
    for name, m in model.named_modules():
        if fp and isinstance(m, ShardedSparseCoreFPEBC):
            if isinstance(m._embedding_bag_collection, ShardedSparseCoreEBC):
                inner.add(id(m._embedding_bag_collection))  # stepped through its FP module
                continue
        if isinstance(m, ShardedModule) and not isinstance(m, (ShardedSparseCoreEBC, ShardedSparseCoreEC)):
            others.append(f"{name or 'the model'} ({type(m).__name__})")
    if others:
        what = "EmbeddingBagCollections, EmbeddingCollections" + (
            " and FeatureProcessedEmbeddingBagCollections" if fp else ""
        )
        raise UserError(
            f"{who} steps sharded {what} only; this model also has {', '.join(others)}: train it with the eager step"
        )
    for name, m in model.named_modules():
        if isinstance(m, ShardedSparseCoreEC) and m._fixed_output is None:
            raise UserError(f"{who}: {fixed_path_needed(name or 'the model')}")
    found = [
        m
        for m in model.modules()
        if (isinstance(m, (ShardedSparseCoreEBC, ShardedSparseCoreEC)) and id(m) not in inner)
        or (fp and isinstance(m, ShardedSparseCoreFPEBC))
    ]
    if not found:
        raise UserError(
            f"{who} needs a model with a sharded EmbeddingBagCollection or EmbeddingCollection (tpurec's "
            "sharders); this one has none"
        )
    return found


def kernels(sharded: Any) -> list[Any]:
    """The embedding kernels of a sharded EBC's (or EC's) lookups."""
    return [k.kernel for lookup in sharded._lookups for k in lookup._emb_modules]


def lr_at_update(modules: list[Any]) -> None:
    """The kernels of `modules` read their param group's lr when their update runs, whatever runs it
    (the compiled and pipelined steps set the lr of each update themselves, an eager batch's too),
    not the lr the fused optimizer handed over last (`SparseCoreKernel.forward_lr`)."""
    for module in modules:
        for kernel in kernels(module):
            kernel.lr_at_update = True


def is_ec(module: Any) -> bool:
    from tpurec.sharding.ec_sharder import ShardedSparseCoreEC

    return isinstance(module, ShardedSparseCoreEC)


def features_of(module: Any) -> list[str]:
    """The features a sharded EBC, EC or FP-EBC (its inner EBC's) reads (its input dist's, in its
    shardings' order)."""
    module = getattr(module, "_embedding_bag_collection", module)
    shardings = module._sharding_type_to_sharding.values() if is_ec(module) else module._embedding_shardings
    return [f for sharding in shardings for f in sharding.feature_names()]


class FieldMap:
    """The batch fields feeding each sharded EBC of `model` (worked out from the first batch's keys,
    again when a batch's fields or keys differ)."""

    def __init__(self, model: nn.Module, who: str, fp: bool = False) -> None:
        self.who = who
        self.modules = sharded_ebcs(model, who, fp)
        self._names = {id(m): name for name, m in model.named_modules()}
        self._seen: tuple | None = None
        self._fields: dict[str, list[Any]] = {}

    def fields(self, batch: Any) -> dict[str, list[Any]]:
        """field name -> the sharded EBCs it feeds, in module order (fields feeding none left out)."""
        if not dataclasses.is_dataclass(batch):
            raise UserError(f"{self.who} needs a batch dataclass (torchrec's Batch, say); got {type(batch).__name__}")
        kjts = {
            f.name: v for f in dataclasses.fields(batch) if isinstance(v := getattr(batch, f.name), KeyedJaggedTensor)
        }
        seen = tuple((name, tuple(kjt.keys())) for name, kjt in kjts.items())
        if seen != self._seen:
            self._fields = self._match(kjts)
            self._seen = seen
        return self._fields

    def _match(self, kjts: dict[str, KeyedJaggedTensor]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for module in self.modules:
            wanted = features_of(module)
            name = self._names.get(id(module), "?")
            fits = [field for field, kjt in kjts.items() if set(wanted) <= set(kjt.keys())]
            if not fits:
                raise UserError(
                    f"{self.who}: no KeyedJaggedTensor of the batch holds every feature of the sharded EBC "
                    f"{name!r} ({', '.join(wanted)}); the batch's: "
                    + "; ".join(f"{f}: {', '.join(k.keys())}" for f, k in kjts.items())
                )
            if len(fits) > 1:
                raise UserError(
                    f"{self.who}: the batch fields {', '.join(fits)} all hold the features of the sharded EBC "
                    f"{name!r} ({', '.join(wanted)}): which one the model hands it is not known; give each "
                    "field features of its own"
                )
            out.setdefault(fits[0], []).append(module)
        return out


def prepare(batch: Any, fields: dict[str, list[Any]]) -> tuple[Any, list[Any]]:
    """The host half of every sharded EBC (`preprocess_sharded`), EC (`preprocess_sharded_ec`) and FP-EBC
    (`preprocess_fp`): `batch` with each field that feeds one replaced by its ModuleInputs, and every
    module's inputs in `parts` order (field order, then module order: the order the steps keep their
    per-module state in)."""
    from tpurec.sharding.ec_preprocess import preprocess_sharded_ec
    from tpurec.sharding.fp_preprocess import preprocess_fp
    from tpurec.sharding.fp_sharder import ShardedSparseCoreFPEBC
    from tpurec.sharding.sharded_preprocess import preprocess_sharded

    def host_half(m: Any, kjt: KeyedJaggedTensor) -> Any:
        if isinstance(m, ShardedSparseCoreFPEBC):
            return preprocess_fp(m, kjt)
        return (preprocess_sharded_ec if is_ec(m) else preprocess_sharded)(m, kjt)

    replaced, flat = {}, []
    for f in dataclasses.fields(batch):  # (the batch's field order, as `parts` reads them back)
        if f.name in fields:
            kjt = getattr(batch, f.name)
            prepared = [host_half(m, kjt) for m in fields[f.name]]
            replaced[f.name] = ModuleInputs(prepared, kjt.stride())
            flat += prepared
    return dataclasses.replace(batch, **replaced), flat


def over_limits(part: Any) -> list[str]:
    """What keeps one module's prepared inputs out of the one fixed graph (empty: nothing)."""
    from tpurec.sharding.ec_preprocess import ShardedECPreprocessed, ec_over_limits
    from tpurec.sharding.sharded_preprocess import over_limits as ebc_over_limits

    return ec_over_limits(part) if isinstance(part, ShardedECPreprocessed) else ebc_over_limits(part)


def any_rank_over_limits(parts: list[Any], group: Any, world_size: int, device: torch.device | None) -> bool:
    """Whether any rank's batch is over its fixed id limits (`over_limits` of its `parts`). A rank
    sees only its own shards' inputs; the ranks agree so that all of them take the same step, eager
    or compiled: on a TPU a compiled step's collectives are its own programs, whose first run
    handshakes with every rank's (TorchTPU's SplitCompiler: fingerprint and collective counts, docs/tpu.md),
    and a pipelined rank that did not drain would look its rows up stale across the batch.

    One all-reduce of a flag: on the host where the group has a CPU backend (tpurec's TPU group pairs
    gloo with tpu_dist: dmp.process_group_backend), so reading it back waits for the other hosts and
    not for this device's queue of work; else on `device` (the dense parameters')."""
    over = any(over_limits(p) for p in parts)
    if group is None or world_size == 1 or not dist.is_initialized():
        return over
    host = "gloo" in str(dist.get_backend(group))
    flag = torch.tensor([int(over)], dtype=torch.int32, device="cpu" if host or device is None else device)
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


def parts(batch: Any) -> list[Any]:
    """Every ModuleInputs part of a prepared batch, in `prepare`'s order."""
    out: list[Any] = []
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, ModuleInputs):
            out += value.parts
    return out


def with_parts(batch: Any, new_parts: list[Any]) -> Any:
    """A prepared batch with its ModuleInputs' parts replaced, in `parts` order (activations for inputs)."""
    replaced, k = {}, 0
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, ModuleInputs):
            n = len(value.parts)
            replaced[f.name] = ModuleInputs(new_parts[k : k + n], value.batch)
            k += n
    if k != len(new_parts):
        raise ValueError(f"{len(new_parts)} parts for a batch of {k}")
    return dataclasses.replace(batch, **replaced)
