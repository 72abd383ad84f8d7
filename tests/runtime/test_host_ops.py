"""The host route for FBGEMM's KJT ops: same results as the op itself, results on the input's device.

A PrivateUse1 (TPU) registration cannot run here; it is exercised in a subprocess on a spare
dispatch key that FBGEMM's ops have no kernel for.
"""

import subprocess
import sys
import textwrap

import torch

from tpurec.runtime.host_ops import HOST_OPS, on_host


def test_on_host_matches_the_op_for_permute_and_cumsum():
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    lengths = torch.tensor([[1, 2, 0], [3, 0, 1]], dtype=torch.int32)
    values = torch.arange(7, dtype=torch.int64)
    weights = torch.rand(7)
    perm = torch.tensor([1, 0], dtype=torch.int32)
    op = torch.ops.fbgemm.permute_2D_sparse_data.default
    want = op(perm, lengths, values, weights, None)
    got = on_host(op)(perm, lengths, values, weights, None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    cumsum = torch.ops.fbgemm.asynchronous_complete_cumsum.default
    assert torch.equal(on_host(cumsum)(lengths.flatten()), cumsum(lengths.flatten()))


def test_register_covers_torchrecs_input_dist_ops_on_a_free_key():
    code = textwrap.dedent("""
        import torch, fbgemm_gpu
        from tpurec.runtime import host_ops
        covered = host_ops.register(dispatch_key="PrivateUse2")
        print("COVERED", sorted({c.split(".")[0] for c in covered}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("COVERED")][0]
    for name in ("permute_2D_sparse_data", "block_bucketize_sparse_features", "asynchronous_complete_cumsum"):
        assert name in line
    assert len(HOST_OPS) >= 10


def test_register_works_before_fbgemm_is_imported_and_is_idempotent():
    # Nothing imports fbgemm_gpu first here: register() must load it rather than cache an empty set.
    code = textwrap.dedent("""
        import sys, torch
        from tpurec.runtime import host_ops
        assert "fbgemm_gpu" not in sys.modules
        first = host_ops.register(dispatch_key="PrivateUse2")
        again = host_ops.register(dispatch_key="PrivateUse2")
        print("COUNTS", len(first), len(again), first == again)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = [x for x in out.stdout.splitlines() if x.startswith("COUNTS")][0].split()
    assert int(counts[1]) >= 10 and counts[1] == counts[2] and counts[3] == "True"
