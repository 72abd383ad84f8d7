"""One CPU forward of a --model-module model, in the launcher, for ops TorchTPU 0.2.0 lacks (issue 63 item 2).

An op without a TorchTPU kernel in the model's forward (`JaggedTensor.to_padded_dense`) used to fail
at step 1 on every rank, after the ranks had started, read their data and built the model: 98 s on
an emulated v5p-16, and on a real TPU TorchTPU's traceback per rank. Before the ranks start, the
launcher runs the model's forward once on a batch of 2 samples under `op_trace.MissingOpTrace`,
which raises the emulated device's one line (the user's file:line, the op, what to use instead).

Cheap by construction: the model is the one the preflight built for its data checks (tables on the
meta device, as docs/your_model.md advises), so its embedding modules, which tpurec shards and the
forward never runs as they are, are stood in for by ones of 1-row tables (their outputs' keys and
shapes are the real ones'); a dense part built on the meta device gets zero tensors on the CPU for
the call. A forward that fails for another reason here (2 samples of zero ids and zero dense
values are not the data) is left to the ranks, which report it on the real batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tpurec.emulation.missing_op import MissingTpuKernel

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.dlrm.user_model import UserModel

BATCH = 2
# A dense part on the meta device above this is not materialised for one forward: the check is skipped.
_DENSE_BYTES_MAX = 256 << 20


def check_forward(user: UserModel, meta: dict) -> bool:
    """Raise MissingTpuKernel (a UserError, one line) when the model's forward, on 2 samples of the
    data's columns (`meta`: its metadata), calls an op TorchTPU 0.2.0 has no kernel for. Returns whether
    the forward ran to its end (False: not cheaply runnable here, or it failed otherwise)."""
    from torchrec.datasets.utils import Batch

    from tpurec.emulation.op_trace import MissingOpTrace
    from tpurec.runtime.library_notices import quiet_fx_tracing_notice

    quiet_fx_tracing_notice()  # the batch's KeyedJaggedTensor: torch's is_fx_tracing line otherwise
    dense = user.dense_in_features or len(meta.get("dense") or []) or 1
    names = [f["name"] for f in meta.get("sparse") or []] or [f.name for f in user.features]
    hots = {f.name: f.ids_per_sample for f in user.features}
    batch = Batch(torch.zeros(BATCH, dense), _tiny_kjt(names, hots), torch.zeros(BATCH))
    with _stood_in(user.module) as ready:
        if not ready:
            return False
        try:
            with MissingOpTrace():
                user.module(batch)
        except MissingTpuKernel:
            raise
        except Exception:  # not the data's batch: the ranks run the real ones and report what they raise
            return False
    return True


def _tiny_kjt(names: list[str], hots: dict[str, int]) -> KeyedJaggedTensor:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.tensor([hots.get(n, 1) for n in names for _ in range(BATCH)], dtype=torch.int64)
    return KeyedJaggedTensor(keys=names, values=torch.zeros(int(lengths.sum()), dtype=torch.int64), lengths=lengths)


@contextlib.contextmanager
def _stood_in(model: nn.Module) -> Iterator[bool]:
    """The model with its embedding modules' forwards stood in for and its meta tensors on the CPU, put
    back after; yields False (nothing changed) where it cannot be done cheaply."""
    embedding, other = _split(model)
    stand_ins = [_stand_in(m) for m in embedding]
    if any(s is None for s in stand_ins) or _meta_bytes(other) > _DENSE_BYTES_MAX:
        yield False
        return
    swapped: list[tuple[dict, str, Any]] = []
    try:
        for m, stand_in in zip(embedding, stand_ins):
            swapped.append((m.__dict__, "forward", m.__dict__.get("forward")))
            m.forward = stand_in
        for m in other:
            stores: tuple[dict[str, Any], ...] = (m._parameters, m._buffers)
            for store in stores:
                for name, t in list(store.items()):
                    if t is not None and t.is_meta:
                        swapped.append((store, name, t))
                        store[name] = _zeros_like(t)
        yield True
    finally:
        for store, name, old in reversed(swapped):
            if old is None:
                store.pop(name, None)
            else:
                store[name] = old


def _split(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the outermost modules tpurec shards, every module outside them)."""
    sharded = _sharded_types()
    embedding: list[nn.Module] = []
    other: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if isinstance(m, sharded):
            embedding.append(m)
            return
        other.append(m)
        for child in m.children():
            walk(child)

    walk(model)
    return embedding, other


def _sharded_types() -> tuple[type, ...]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    return (
        EmbeddingBagCollection,
        EmbeddingCollection,
        FeatureProcessedEmbeddingBagCollection,
        BaseManagedCollisionEmbeddingCollection,
        ManagedCollisionCollection,
    )


def _meta_bytes(modules: list[nn.Module]) -> int:
    tensors = [t for m in modules for t in [*m._parameters.values(), *m._buffers.values()] if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors if t.is_meta)


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros(t.shape, dtype=t.dtype)
    return nn.Parameter(zeros, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else zeros


def _stand_in(m: nn.Module) -> Any:
    """A forward for the sharded module `m` giving what its real one gives (keys, shapes, the
    (embeddings, remapped features) pair of a managed-collision one), from 1-row tables; None for a
    module it does not know."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    if isinstance(m, ManagedCollisionCollection):
        return lambda features, *args, **kwargs: features  # the remap: ids stay 0
    if isinstance(m, BaseManagedCollisionEmbeddingCollection):
        inner = _stand_in(m._embedding_module)
        remapped = m._return_remapped_features
        return None if inner is None else lambda f, *a, **k: (inner(f), f if remapped else None)
    if isinstance(m, FeatureProcessedEmbeddingBagCollection):
        m = m._embedding_bag_collection
    if isinstance(m, EmbeddingBagCollection):
        tables = [dataclasses.replace(c, num_embeddings=1) for c in m.embedding_bag_configs()]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        return lambda f, *a, **k: ebc(_zero_ids(f))
    if isinstance(m, EmbeddingCollection):
        ec_tables = [dataclasses.replace(c, num_embeddings=1) for c in m.embedding_configs()]
        ec = EmbeddingCollection(tables=ec_tables, device=torch.device("cpu"), need_indices=m.need_indices())
        return lambda f, *a, **k: ec(_zero_ids(f))
    return None


def _zero_ids(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The features with every id 0 (the stand-in's tables have 1 row) and no weights (its
    EmbeddingBagCollection is unweighted: a feature processor's weights are not needed for shapes)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values = torch.zeros_like(features.values())
    return KeyedJaggedTensor(keys=features.keys(), values=values, lengths=features.lengths())
