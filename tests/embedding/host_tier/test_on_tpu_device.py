"""The host tier with its caches on the emulated TPU device (tpurec/emulation/device.py): a module
with t0 and t2 on the host tier (a tenth of their rows cached) trains as the same module all resident
on the same device, and the row copies between host and cache compile a few fixed shapes, all of
them when the cache is made, whatever each batch misses.

The device renames PrivateUse1 for the whole process, so the modules train in a fresh interpreter
made an emulated rank (as tests/embedding/test_fixed_programs_on_device.py does), which prints what it
saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
STEPS = 30

PROBE = textwrap.dedent(
    """
    import json, sys, torch
    import tpurec  # an emulated rank: the device is installed here
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torchrec.distributed.types import CacheParams
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tests.embedding.helpers import fused_optimizers
    from tests.embedding.host_tier import training
    from tpurec.embedding.host_tier import device_copies
    from tpurec.embedding.host_tier.kernel import HostTierKernel, host_tier_factory
    from tpurec.embedding.kernel import SparseCoreKernel
    from tpurec.emulation import device

    steps, optimizer = int(sys.argv[1]), fused_optimizers()[sys.argv[2]]
    data = training.batches(steps)
    COPY_OPS = ("aten::index_select", "aten::index_copy_", "aten::_to_copy")

    def copy_programs():
        return {(op, str(key)) for _, op, key in device.RECORD.programs if op in COPY_OPS}

    def to_list(state):
        return {k: v.detach().cpu().flatten().tolist() for k, v in state.items()}

    def varied(count, seed):
        # batches of at most 0 to 5 ids per bag by turn: from no miss to most of a cache
        gen = torch.Generator().manual_seed(seed)
        for i in range(count):
            lengths = torch.randint(0, i % 6 + 1, (len(training.ROWS) * training.BATCH,), generator=gen)
            values = []
            for k, rows in enumerate(training.ROWS):
                n = int(lengths[k * training.BATCH : (k + 1) * training.BATCH].sum())
                values.append((torch.rand(n, generator=gen) ** 3 * rows).long())
            yield i, KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.cat(values), lengths=lengths)

    # what a sharded lookup asks for a host-tier table on the device (DMP's path)
    factory = host_tier_factory(SparseCoreKernel, ["t0"], torch.device("tpu")) is HostTierKernel
    resident = training.build(optimizer, device="tpu")
    out = {"factory": factory, "resident": {"losses": training.train(resident, data).cpu().tolist()}}
    out["resident"]["state"] = to_list(training.tables_and_state(resident))
    sizes = []  # (rows copied, cache rows, padded length) of every chunk
    bucket = device_copies.bucket
    device_copies.bucket = lambda n, cap: sizes.append((n, cap, bucket(n, cap))) or bucket(n, cap)
    late = []  # programs a batch's copies (loads, write-backs, flushes) asked the device for first

    def recording(copy):
        def recorded(*args):
            known = len(device.RECORD.programs)
            out = copy(*args)
            late.extend(str(p)[:200] for p in list(device.RECORD.programs)[known:])
            return out

        return recorded

    device_copies.load = recording(device_copies.load)
    device_copies.start_write_back = recording(device_copies.start_write_back)
    device_copies.PendingWriteBack.complete = recording(device_copies.PendingWriteBack.complete)
    for algorithm in ("LRU", "LFU"):
        before = copy_programs()
        cache = {t: CacheParams(load_factor=0.1, algorithm=CacheAlgorithm[algorithm]) for t in ("t0", "t2")}
        tiered = training.build(optimizer, cache, device="tpu")
        made, late[:] = copy_programs(), []  # (the warm-up's copies, made by the build, are not late)
        losses = training.train(tiered, data).cpu().tolist()
        state = to_list(training.tables_and_state(tiered))  # (a flush: all the cache written back)
        for i, kjt in varied(2 * steps, 1):
            tiered.ebc(kjt).values().sum().backward()
            if i % 20 == 19:
                tiered.ebc.state_dict()  # a flush: every changed row written back
        out[algorithm] = {
            "losses": losses,
            "state": state,
            "counters": {n: vars(c) for n, c in tiered.ebc.kernel.host_tier_counters().items()},
            "cache_device": str(tiered.ebc.kernel.stack_weight(0).device),
            "host_tier_devices": sorted({str(tiered.ebc.table_weight(t).device) for t in ("t0", "t2")}),
            "programs_made": len(made - before),
            "programs_after": sorted(set(late)),
        }
    out["sizes"] = sorted(set(sizes))
    out["index_lengths"] = sorted(
        {(str(key[0][0][1]), key[0][2][1][0]) for _, op, key in device.RECORD.programs if op == "aten::index_select"}
    )
    print(json.dumps(out))
    """
)


def _run(tpu_slice: str, optimizer: str) -> dict:
    env = dict(os.environ, TPUREC_EMULATE_TPU=tpu_slice, LOCAL_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(STEPS), optimizer],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# v5e: the TensorCore kernel (JAX programs); v5p: TorchTPU's SparseCore ops (their stand-in)
@pytest.mark.parametrize(
    ("tpu_slice", "optimizer"),
    [pytest.param("v5e-8", "adam", marks=pytest.mark.slow), ("v5p-8", "rowwise_adagrad")],  # (v5e: 20 s)
)
def test_host_tier_on_the_tpu_device_trains_as_resident_with_fixed_copy_shapes(tpu_slice, optimizer):
    seen = _run(tpu_slice, optimizer)
    assert seen["factory"]  # a TPU device's sharded lookups get the host-tier kernel (DMP: tests/sharding)
    want = seen["resident"]
    for algorithm in ("LRU", "LFU"):
        got = seen[algorithm]
        # The caches are the kernel's storage on the device; the whole tables stay in host memory.
        assert got["cache_device"] == "tpu:0" and got["host_tier_devices"] == ["cpu"]
        # Within float32 rounding, not bit for bit: on the TPU path a bag's rows are summed in partition
        # order, which follows the cache slots, not the rows (docs/host_tier.md, "What is exact").
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
        assert sorted(got["state"]) == sorted(want["state"])
        for key, values in want["state"].items():
            assert got["state"][key] == pytest.approx(values, rel=1e-4, abs=1e-5), key
        for name in ("t0", "t2"):
            c = got["counters"][name]
            assert c["batches"] == 3 * STEPS and c["hits"] > 0 and c["evictions"] > 0 and c["writebacks"] > 0
            assert c["flushes"] == 4
        # Every shape the copies use was compiled when the cache was made (device_copies.warm_up); none
        # after, through 90 batches missing from no row to most of the cache, and 4 flushes.
        assert got["programs_after"] == []
    assert seen["LRU"]["programs_made"] > 0  # (the LFU module's caches have the same shapes: compiled already)
    # The chunks copied: from 1 row to the whole cache (a flush), padded to 4 buckets (t0's 100-row
    # cache: 16, 32, 64, 100) or 5 (t2's 200 rows: 16 to 128, 200).
    for cap, buckets in ((100, [16, 32, 64, 100]), (200, [16, 32, 64, 128, 200])):
        counts = {n for n, c, _ in seen["sizes"] if c == cap}
        assert sorted({b for _, c, b in seen["sizes"] if c == cap}) == buckets
        assert len(counts) > 30 and max(counts) == cap
        # each cache tensor's gathers on the device: one program per bucket, no more (Adam's two states
        # have the weight's shape; row-wise Adagrad's one float a row is a second tensor shape)
        lengths = sorted(n for shape, n in seen["index_lengths"] if shape.startswith(f"({cap},"))
        assert lengths == sorted(buckets * (1 + (optimizer == "rowwise_adagrad"))), lengths
