"""TorchRec's managed-collision modules under tpurec's DMP (issue #38): an MC-EBC / MC-EC over raw ids,
sharded row-wise with TorchRec's own MC sharder (its inner sharder swapped for tpurec's), trains as stock
TorchRec's DMP does on the same plan, tables and batches: the same remapped ids, evictions, tables,
optimizer state and losses, at 1 and 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from .mc_cases import run
from .multiprocess import run_ranks

STEPS = 20


def _compare(world: int, policy: str, optimizer: str, bagged: bool = True, ours_impl: str = "tpurec") -> None:
    stock = run_ranks(run, world, "stock", policy, optimizer, bagged, STEPS)
    ours = run_ranks(run, world, ours_impl, policy, optimizer, bagged, STEPS)
    for a, b in zip(stock, ours):
        assert sum(a["evicted"]) > 0 and a["evicted"] == b["evicted"]  # rows were evicted, the same ones
        assert len(a["remapped"]) == STEPS
        for x, y in zip(a["remapped"], b["remapped"]):
            assert torch.equal(x, y)
        assert set(a["state"]) == set(b["state"])
        for key, x in a["state"].items():  # tables and the remap's buffers (identities, eviction metadata)
            if x.is_floating_point():
                # float32 sums in another order, grown by the loss's square term: at most 3e-6 relative
                # (4e-6 on a value of 1.3) after 20 SGD steps at 1 rank; Adagrad's within 1e-7
                torch.testing.assert_close(b["state"][key], x, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(b["state"][key], x), key
        assert set(a["optim"]) == set(b["optim"])
        for key, x in a["optim"].items():
            torch.testing.assert_close(b["optim"][key], x, rtol=1e-6, atol=1e-6, msg=key)
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-6, atol=1e-5)


# 21 s: make test-all (the default suite's 20 minutes); MC training stays fast in tests/dlrm/test_user_model_mc.py
@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_mc_ebc_planned_by_tpurec_trains_as_stock_torchrec_at_2_ranks():
    # no plan, no sharders: tpurec's planner plans the MC tables row-wise on its kernel (TorchRec's own
    # planner refuses a one-bucket remap over 2 ranks), and stock is given that plan
    _compare(2, "lfu", "adagrad", ours_impl="tpurec-planned")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("policy", ["lru", "lfu", "distance_lfu"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_mc_ebc_every_eviction_policy_trains_as_stock_torchrec(world, policy, optimizer):
    _compare(world, policy, optimizer)


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
@pytest.mark.multiprocess
def test_an_mc_ec_trains_as_stock_torchrec_at_2_ranks():
    _compare(2, "lru", "sgd", bagged=False)


@pytest.mark.multiprocess
def test_evicted_rows_of_rowwise_adagrad_restart_their_optimizer_state():
    """FBGEMM resets an evicted row's momentum (and weight, before TorchRec's re-init) for exact row-wise
    Adagrad only (its CUDA reset_weight_momentum; no CPU kernel, so stock cannot run this on a CPU)."""
    (ours,) = run_ranks(run, 1, "tpurec", "lru", "rowwise_adagrad", True, STEPS)
    assert sum(ours["evicted"]) > 0 and ours["resets"]
    assert any(bool((before > 0).any()) for _, before, _ in ours["resets"])  # rows that had trained
    for table, _, after in ours["resets"]:
        assert torch.equal(after, torch.zeros_like(after)), table


@pytest.mark.slow  # a run at 1 and one at 2 ranks per policy (about 30 s each pair)
@pytest.mark.multiprocess
@pytest.mark.parametrize("policy", ["hash_zch", "hash_zch_ttl", "hash_zch_plain"])
def test_the_multi_probe_hash_remap_trains_alike_at_1_and_2_ranks(policy):
    """TorchRec's HashZchManagedCollisionModule trains under tpurec's DMP (ids inserted by tpurec's host
    insert; LRU or TTL eviction, on a clock moving 2 hours a step, or none): the global batch of 2 ranks
    at 1 rank gives each step's summed loss, every remapped id, the rows evicted, the tables and the
    remap's identities and metadata of the 2 ranks."""
    from .mc_cases import run_global_batch

    (one,) = run_ranks(run_global_batch, 1, policy, STEPS)
    two = run_ranks(run_global_batch, 2, policy, STEPS)
    for step, loss in enumerate(one["losses"]):
        both = two[0]["losses"][step] + two[1]["losses"][step]
        assert abs(loss - both) <= 1e-5 * max(1.0, abs(loss)), step
        for f in ("f0", "f1"):
            mine = torch.cat([two[0]["remapped"][step][f], two[1]["remapped"][step][f]])
            assert torch.equal(one["remapped"][step][f], mine), (step, f)
    evicted = [a + b for a, b in zip(two[0]["evicted"], two[1]["evicted"])]
    assert one["evicted"] == evicted
    assert (sum(evicted) > 0) == (policy != "hash_zch_plain"), evicted
    assert set(one["tables"]) == set(two[0]["tables"])
    for key, t in one["tables"].items():
        other = two[0]["tables"][key]
        if t.is_floating_point():
            assert torch.allclose(t, other, rtol=1e-5, atol=1e-6), key
        else:
            assert torch.equal(t, other), key
    identities = [t for k, t in one["tables"].items() if k.endswith("_hash_zch_identities")]
    assert len(identities) == 2
    # ids went in: every slot of the 32- and 16-row tables holds one (400 raw ids, 20 steps)
    assert [int((t != -1).sum()) for t in identities] == [32, 16]
    if policy != "hash_zch_plain":  # an hour (last seen, or expiry) per slot: set on every taken slot
        metadata = [t for k, t in one["tables"].items() if k.endswith("_hash_zch_metadata")]
        assert all(bool((m != -1).all()) for m in metadata)


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
@pytest.mark.multiprocess
@pytest.mark.parametrize("other", ["stock", "tpurec"])
def test_mc_state_travels_through_dcp_between_tpurec_and_stock(tmp_path, other):
    """Saved by one library at 2 ranks, loaded by the other: every tensor (tables, optimizer state, the
    remap's identities and eviction metadata) arrives bit for bit, and the loader then trains as it does
    from its own checkpoint. (Not as the uninterrupted run: TorchRec's MCH sizes its in-memory eviction
    history from the first batch a process sees and drops ids past it, so a resumed process, stock or
    tpurec, evicts differently from one that never stopped; docs/managed_collision.md.)"""
    from .mc_cases import run_dcp

    mine = "tpurec" if other == "stock" else "stock"
    crossed = run_ranks(run_dcp, 2, mine, other, str(tmp_path / "a"), "lru", "adagrad")
    own = run_ranks(run_dcp, 2, other, other, str(tmp_path / "b"), "lru", "adagrad")
    for a, b in zip(crossed, own):
        assert set(a["at_load"]) == set(a["at_save"])
        for key, saved in a["at_save"].items():
            assert torch.equal(a["at_load"][key], saved), key
        assert len(a["resumed"]) == 10
        for (loss, remap), (want_loss, want_remap) in zip(a["resumed"], b["resumed"]):
            assert torch.equal(remap, want_remap)
            assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))


@pytest.mark.slow  # two 4-rank runs
@pytest.mark.multiprocess
def test_an_mc_ebc_on_an_emulated_tpu_slice_remaps_on_the_host_and_equals_cpu_ranks():
    """The remap (its all-to-all, identities, eviction) stays on the host on the TPU path: no id reaches
    the device unremapped, the remap costs no device->host copy (the only one a step makes is the
    loss the program reads), and the 4 emulated ranks give the 4 CPU gloo ranks' losses."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    program = str(Path(__file__).parent / "mc_program.py")
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", TPUREC_NO_DIRECT="1")

    def last_json(cmd):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=repo)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    emulated = last_json([sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5p-8", program, "tpu"])
    cpu = last_json(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", program, "cpu"]
    )
    assert emulated["evicted"] > 0 and emulated["evicted"] == cpu["evicted"]
    assert emulated["remapped_on"] == ["cpu"]  # the remapped KJT: host ids, as the SparseCore input build takes them
    assert emulated["losses"] == cpu["losses"]
    assert emulated["recompiles_after_warmup"] == 0, emulated["late_programs"]
    assert set(emulated["device_to_host_copies"]) == {"__main__.main"}  # the program's float(loss) only


def test_evicted_rows_are_written_on_a_device_in_chunks_padded_with_their_first_row(monkeypatch):
    """`write_rows` to a device table: chunks of CHUNK rows (4 here), a short one padded by repeating its
    first row and value. The device is the meta device; a dispatch mode records each write's rows and
    values (keeping them on the host) instead of making it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpurec.sharding import evicted_rows

    aten = torch.ops.aten

    class Writes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten._to_copy.default and kwargs.get("device") == torch.device("meta"):
                return args[0]  # "to the device": kept on the host, readable
            if func is aten.index_put_.default:
                rows, values = args[1][0], args[2]
                self.writes.append((rows.tolist(), None if values.is_meta else values.tolist()))
                return args[0]
            return func(*args, **kwargs)

    monkeypatch.setattr(evicted_rows, "CHUNK", 4)
    target, rows = torch.empty(10, 2, device="meta"), torch.tensor([7, 2, 5, 9, 1, 3])
    with Writes() as w:
        evicted_rows.write_rows(target, rows, torch.arange(12.0).view(6, 2))
    assert w.writes == [
        ([7, 2, 5, 9], [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]),
        ([1, 3, 1, 1], [[8.0, 9.0], [10.0, 11.0], [8.0, 9.0], [8.0, 9.0]]),
    ]
    with Writes() as w:
        evicted_rows.write_rows(target, rows[:5], 0.0)
    assert w.writes == [([7, 2, 5, 9], None), ([1, 1, 1, 1], None)]
    # on the host: the rows at once
    host = torch.zeros(10, 2)
    evicted_rows.write_rows(host, rows, torch.arange(12.0).view(6, 2))
    assert host[:, 0].tolist() == [0.0, 8.0, 2.0, 10.0, 0.0, 4.0, 0.0, 0.0, 0.0, 6.0]
