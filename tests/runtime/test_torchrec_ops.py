"""`torch.ops.torchrec.permute_pooled_embs` on the TPU path (issue #36 item 5): TorchRec 1.9.2 calls it for
column-wise splits on a tpu device; tpurec defines it (TorchRec's own definition, no jax) and serves it
on the TPU key with aten ops, equal to FBGEMM's permute and its gradient."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from itertools import accumulate

import pytest
import torch


def _layout(gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Random column blocks (dims) and their order."""
    blocks = int(torch.randint(1, 7, (1,), generator=gen))
    dims = torch.randint(1, 10, (blocks,), generator=gen).tolist()
    return dims, torch.randperm(blocks, generator=gen).tolist()


def _fbgemm_args(dims: list[int], order: list[int]) -> tuple[torch.Tensor, ...]:
    """FBGEMM's (offset_dim_list, permute_list, inv_offset_dim_list, inv_permute_list), as its
    PermutePooledEmbeddingsSplit (TorchRec's CW output permute off the TPU) builds them."""
    inv = [0] * len(order)
    for i, p in enumerate(order):
        inv[p] = i
    inv_dims = [dims[i] for i in order]
    return (
        torch.tensor([0, *accumulate(dims)]),
        torch.tensor(order),
        torch.tensor([0, *accumulate(inv_dims)]),
        torch.tensor(inv),
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_kernels_equal_fbgemms_permute_and_its_gradient(seed):
    import fbgemm_gpu  # noqa: F401

    from tpurec.runtime import torchrec_ops

    gen = torch.Generator().manual_seed(seed)
    dims, order = _layout(gen)
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    x = torch.randn(batch, sum(dims), generator=gen)
    args = _fbgemm_args(dims, order)
    # TorchRec's TPU branch passes int32 metadata (cw_sharding._build_tpu_permute).
    offsets, permute = torch.tensor([0, *accumulate(dims)], dtype=torch.int32), torch.tensor(order, dtype=torch.int32)

    got = torchrec_ops.permute_pooled_embs(x, offsets, permute)
    assert torch.equal(got, torch.ops.fbgemm.permute_pooled_embs(x, *args))
    xs = x.clone().requires_grad_()
    split = torch.ops.fbgemm.permute_pooled_embs_auto_grad_split(xs, *args)  # what cw_sharding runs on CPU
    assert torch.equal(got, split)
    grad = torch.randn(split.shape, generator=gen)
    split.backward(grad)
    assert torch.equal(torchrec_ops.permute_pooled_embs_backward(grad, offsets, permute), xs.grad)


def test_the_op_is_defined_and_served_on_the_tpu_key_once_tpurecs_tpu_registration_runs():
    """In a fresh process without a TPU: tpurec's TPU backend loading (its SparseCore adapter, which
    needs TorchTPU, skipped) defines TorchRec's op with TorchRec's schema, registers PrivateUse1 ("tpu")
    kernels for it and its backward, and imports neither jax nor torch_tpu."""
    code = textwrap.dedent("""
        import sys, torch
        from itertools import accumulate
        assert not torch._C._jit_get_schemas_for_operator("torchrec::permute_pooled_embs")
        from tpurec.embedding import backend, tpu
        tpu.register = lambda kernels: None  # the SparseCore adapter needs TorchTPU
        backend.load_tpu_backend()
        pu1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
        for name in ("permute_pooled_embs", "permute_pooled_embs_backward"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torchrec::{name}", "PrivateUse1"), name
        print("SCHEMA", torch.ops.torchrec.permute_pooled_embs.default._schema)
        import fbgemm_gpu
        dims, order = [3, 5, 2], [2, 0, 1]
        x = torch.randn(4, 10)
        off, perm = torch.tensor([0, *accumulate(dims)], dtype=torch.int32), torch.tensor(order, dtype=torch.int32)
        got = torch.ops.torchrec.permute_pooled_embs.default.redispatch(pu1, x, off, perm)
        inv_off = torch.tensor([0, *accumulate(dims[i] for i in order)])
        want = torch.ops.fbgemm.permute_pooled_embs(x, off.long(), perm.long(), inv_off, torch.tensor([1, 2, 0]))
        assert torch.equal(got, want)
        print("MODULES", "jax" in sys.modules, "torch_tpu" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    from tpurec.runtime.torchrec_ops import SCHEMAS

    assert f"SCHEMA {SCHEMAS['permute_pooled_embs']}" in out.stdout  # TorchRec 1.9.2's, pallas/ops.py
    assert "MODULES False False" in out.stdout
