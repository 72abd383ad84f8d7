"""TPU kernels for the `torchrec::` ops TorchRec 1.9.2 calls on a tpu device that nothing else serves there.

Column-wise sharding: when a table is split column-wise over several ranks, the pooled output of each
rank's shards must be put back in the table's column order. On a `tpu` device (and
`torch.tpu.is_available()`) TorchRec 1.9.2 does this with `torch.ops.torchrec.permute_pooled_embs`
(`torchrec/distributed/sharding/cw_sharding.py`, `_build_tpu_permute`; elsewhere FBGEMM's
`permute_pooled_embs_auto_grad_split`, which has no TorchTPU kernel). The op is defined by
`torchrec/experimental/torch_tpu/pallas/ops.py` (schema, CPU kernels and the autograd formula, torch
only), and its TPU kernels by `pallas/impl.py`, which needs jax and TorchTPU's Pallas bridge and which
nothing in TorchRec imports. So `register()` loads TorchRec's own definition (the same schema by
construction; its autograd calls `torchrec::permute_pooled_embs_backward`) and registers PrivateUse1
("tpu") kernels for both ops written with aten ops TorchTPU 0.2.0 has device kernels for
(`index_select`, `searchsorted`, `cumsum`, `arange`, `index_add`; tpurec/emulation/torchtpu_kernels.json):
no host round trip, shapes fixed by the layout. Called by `tpurec.embedding.backend` on the TPU path.
Not yet run on TPU hardware.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

OPS = ("permute_pooled_embs", "permute_pooled_embs_backward")
# TorchRec 1.9.2's schemas (torchrec/experimental/torch_tpu/pallas/ops.py), checked by `define`.
SCHEMAS = {
    "permute_pooled_embs": "torchrec::permute_pooled_embs(Tensor pooled_embs, Tensor offset_dim_list, "
    "Tensor permute_list) -> Tensor",
    "permute_pooled_embs_backward": "torchrec::permute_pooled_embs_backward(Tensor grad_out, "
    "Tensor offset_dim_list, Tensor permute_list) -> Tensor",
}
_registered: list = []


def source_columns(offset_dim_list: torch.Tensor, permute_list: torch.Tensor, width: int) -> torch.Tensor:
    """For each of the `width` output columns, the input column it takes: the output is the input's
    column blocks (`offset_dim_list`: block starts and the end) in the order `permute_list`."""
    offsets = offset_dim_list.long()
    permute = permute_list.long()
    dims = offsets[1:] - offsets[:-1]
    out_dims = dims.index_select(0, permute)
    out_ends = torch.cumsum(out_dims, 0)
    column = torch.arange(width, dtype=torch.long, device=offsets.device)
    block = torch.searchsorted(out_ends, column, right=True)  # the output block of each column
    start_in = offsets.index_select(0, permute).index_select(0, block)
    start_out = (out_ends - out_dims).index_select(0, block)
    return start_in + column - start_out


def permute_pooled_embs(
    pooled_embs: torch.Tensor, offset_dim_list: torch.Tensor, permute_list: torch.Tensor
) -> torch.Tensor:
    """`pooled_embs` [batch, dims] with its column blocks permuted (FBGEMM's `permute_pooled_embs`)."""
    return pooled_embs.index_select(1, source_columns(offset_dim_list, permute_list, pooled_embs.shape[1]))


def permute_pooled_embs_backward(
    grad_out: torch.Tensor, offset_dim_list: torch.Tensor, permute_list: torch.Tensor
) -> torch.Tensor:
    """The gradient of `permute_pooled_embs`: each output column's gradient back to its input column."""
    columns = source_columns(offset_dim_list, permute_list, grad_out.shape[1])
    return torch.zeros_like(grad_out).index_add(1, columns, grad_out)


def _defined(name: str) -> bool:
    return bool(torch._C._jit_get_schemas_for_operator(f"torchrec::{name}"))


def define() -> None:
    """`torch.ops.torchrec.permute_pooled_embs(_backward)` with TorchRec's schema and autograd: TorchRec's
    own definition module (torch only: no jax, no torch_tpu), unless something loaded it already."""
    if not all(_defined(name) for name in OPS):
        import torchrec.experimental.torch_tpu.pallas.ops  # noqa: F401  (defines them)
    for name, schema in SCHEMAS.items():
        got = str(getattr(torch.ops.torchrec, name).default._schema)
        if got != schema:
            raise RuntimeError(f"torchrec::{name} has schema {got!r}; tpurec's kernel is for {schema!r}")


def kernels() -> dict[str, Callable[..., Any]]:
    """{"torchrec::op": tpurec's device kernel} (the emulated TPU device calls them); defines the ops."""
    define()
    return {
        "torchrec::permute_pooled_embs": permute_pooled_embs,
        "torchrec::permute_pooled_embs_backward": permute_pooled_embs_backward,
    }


def register(dispatch_key: str = "PrivateUse1") -> list[str]:
    """Define the ops (`define`) and install tpurec's kernels for them on `dispatch_key` (idempotent);
    returns the ops covered. A kernel already there for that key is kept."""
    if _registered:
        return list(_registered[0][0])
    define()
    lib = torch.library.Library("torchrec", "IMPL")
    covered = []
    for name, kernel in kernels().items():
        short = name.partition("::")[2]
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key):
            logger.info("%s keeps its %s kernel", name, dispatch_key)
            continue
        lib.impl(short, kernel, dispatch_key)
        covered.append(short)
    _registered.append((tuple(covered), lib))  # the Library must stay alive for its kernels to stay
    return covered
