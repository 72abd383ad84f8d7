"""The host tier through tpurec.DistributedModelParallel, in TorchRec's words: constraints naming
`fused_uvm_caching` with CacheParams, or a TorchRec plan on that kernel; training equal bit for bit to
the all-resident model, and DCP checkpoints between the two."""

from __future__ import annotations

import functools

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import CacheParams, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

import tpurec
from tpurec.errors import UserError
from tpurec.planner.kernel_choice import COMPUTE_KERNEL
from tpurec.sharding.dmp import _ensure_process_group

from . import host_tier_cases as c
from .multiprocess import run_ranks

STEPS = 300


@functools.cache
def _resident(optim: str, world_size: int = 1, steps: int = STEPS) -> list[dict]:
    if world_size == 1:
        _ensure_process_group()
        return [c.train(0, 1, optim, None, steps)]
    return run_ranks(c.train, world_size, optim, None, steps, timeout=600)


def assert_same_training(got: list[dict], want: list[dict]) -> None:
    """Per rank: the same losses, and the same shards (offsets and values) of every table and state."""
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g["losses"], w["losses"])
        assert sorted(g["shards"]) == sorted(w["shards"])
        for key, shards in w["shards"].items():
            assert [o for o, _ in g["shards"][key]] == [o for o, _ in shards], key
            for (_, a), (_, b) in zip(g["shards"][key], shards):
                assert torch.equal(a, b), key


def assert_cached_a_tenth(result: dict, algorithm: str) -> None:
    assert result["plan"]["t1"] == (COMPUTE_KERNEL, None)
    for table, rows in (("t0", 1000), ("t2", 2000)):
        kernel, cache = result["plan"][table]
        assert kernel == COMPUTE_KERNEL and cache.load_factor == 0.1 and cache.algorithm == CacheAlgorithm[algorithm]
        counters = result["counters"][f"{table}/0"]
        assert counters["hits"] > 0 and counters["evictions"] > 0
        assert result["cached"][f"{table}/0"] == rows // 10 == counters["misses"] - counters["evictions"]


@pytest.mark.parametrize("algorithm", ["LRU", "LFU"])
@pytest.mark.parametrize("optim", ["sgd", "rowwise_adagrad"])
def test_constraints_put_tables_on_the_host_tier_and_300_steps_equal_the_resident_run(optim, algorithm):
    _ensure_process_group()
    got = c.train(0, 1, optim, algorithm, STEPS)
    assert got["host_tier_kernels"] == 1
    assert_cached_a_tenth(got, algorithm)
    assert_same_training([got], _resident(optim))


def test_a_torchrec_plan_on_fused_uvm_caching_runs_on_the_host_tier():
    """A plan as TorchRec writes it (`table_wise(compute_kernel="fused_uvm_caching")`, CacheParams on
    the ParameterSharding; t2 with none: FBGEMM's load factor 0.2), t1 on FBGEMM's `fused`."""
    _ensure_process_group()
    kernels = {"t0": "fused_uvm_caching", "t1": "fused", "t2": "fused_uvm_caching"}
    module_plan = construct_module_sharding_plan(
        EmbeddingBagCollection(c.TABLES, device=torch.device("meta")),
        {name: table_wise(rank=0, compute_kernel=kernel) for name, kernel in kernels.items()},
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    module_plan["t0"].cache_params = CacheParams(load_factor=0.1, algorithm=CacheAlgorithm.LFU)
    model = c.build("rowwise_adagrad", None, plan=ShardingPlan({"": module_plan}))
    got = c.report(model, c.steps(model, 0, 1, c.batches(STEPS)))

    assert got["plan"]["t0"] == (COMPUTE_KERNEL, CacheParams(load_factor=0.1, algorithm=CacheAlgorithm.LFU))
    assert got["plan"]["t2"] == (COMPUTE_KERNEL, CacheParams())
    assert got["plan"]["t1"] == (COMPUTE_KERNEL, None)
    assert got["cached"] == {"t0/0": 100, "t2/0": 400}
    assert_same_training([got], _resident("rowwise_adagrad"))


@pytest.mark.parametrize(("save", "load"), [("LRU", None), (None, "LFU")], ids=["host_to_resident", "resident_to_host"])
def test_a_dcp_checkpoint_moves_between_host_tier_and_resident_runs(tmp_path, save, load):
    _ensure_process_group()
    got = c.save_then_load(0, 1, "rowwise_adagrad", save, load, str(tmp_path / "ckpt"), 200, STEPS - 200)
    assert_same_training([got], _resident("rowwise_adagrad"))


def test_cache_params_without_the_caching_kernel_leave_the_table_resident():
    """TorchRec copies a constraint's cache_params into the plan whatever the kernel; only
    `fused_uvm_caching` means the host tier."""
    _ensure_process_group()
    torch.manual_seed(0)
    constraints = {"t0": ParameterConstraints(cache_params=CacheParams(load_factor=0.1))}
    model = tpurec.DistributedModelParallel(EmbeddingBagCollection(c.TABLES), device="cpu", constraints=constraints)
    assert all(ps.cache_params is None for ps in model.plan.plan[""].values())
    assert not any(m.kernel.host_tier for m in model.module.sparsecore_lookups())


def test_an_embedding_collection_on_the_host_tier_is_refused_naming_its_tables():
    _ensure_process_group()
    ec = EmbeddingCollection([EmbeddingConfig(name="seq", embedding_dim=8, num_embeddings=100, feature_names=["s"])])
    constraints = {"seq": ParameterConstraints(compute_kernels=["fused_uvm_caching"])}
    with pytest.raises(UserError, match=r"tables \['seq'\]: the host tier .* EmbeddingBagCollection tables only"):
        tpurec.DistributedModelParallel(ec, device="cpu", constraints=constraints)


@pytest.mark.slow  # about 60 s of spawned ranks: `make test-all`
@pytest.mark.multiprocess
def test_two_ranks_train_and_resume_on_the_host_tier_as_resident_ones(tmp_path):
    """Table-wise over 2 ranks (t0 and t2 on the host tier, LRU): 300 steps equal to the resident run
    per rank; then a DCP checkpoint of the host-tier run after 200 steps, resumed all resident."""
    got = run_ranks(c.train, 2, "rowwise_adagrad", "LRU", STEPS, timeout=600)
    assert sum(r["host_tier_kernels"] for r in got) >= 1
    assert sorted(t for r in got for t in r["cached"]) == ["t0/0", "t2/0"]
    assert_same_training(got, _resident("rowwise_adagrad", 2))
    path = str(tmp_path / "ckpt")
    resumed = run_ranks(c.save_then_load, 2, "rowwise_adagrad", "LRU", None, path, 200, STEPS - 200, timeout=600)
    assert_same_training(resumed, _resident("rowwise_adagrad", 2))


def test_the_pipelined_step_refuses_host_tier_tables():
    from tpurec.sharding.step.pipelined import PipelinedStep

    _ensure_process_group()

    class Model(torch.nn.Module):  # a batch field feeding the EBC, as PipelinedStep finds it
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(c.TABLES)
            self.head = torch.nn.Linear(40, 1)  # a dense parameter for the step's dense optimizer

        def forward(self, features):  # pragma: no cover (not stepped)
            return self.head(self.ebc(features).values())

    model = tpurec.DistributedModelParallel(Model(), device="cpu", constraints=c.constraints("LRU"))
    with pytest.raises(UserError, match=r"PipelinedStep: tables \['t0', 't2'\] are on the host tier"):
        PipelinedStep(model, 0.1, compile=False)


def test_the_compiled_step_maps_ids_in_its_host_half():
    """CompiledStep (aot_eager; fixed id limits: the SparseCore layout path) over TorchRec's DLRM with
    table t0 on the host tier (half its 200 rows cached): its host half maps each batch's ids to the
    cache before the compiled lookup; with one id per bag (no summation order to differ) the losses
    equal the resident model's bit for bit."""
    from tests.helpers.dlrm_step import BATCH, DENSE_LR, dlrm_dmp
    from tpurec.sharding.step.compiled import CompiledStep

    from .dlrm_case import batches

    _ensure_process_group()
    half = CacheParams(load_factor=0.5)
    on_host = {"t0": ParameterConstraints(compute_kernels=["fused_uvm_caching"], cache_params=half)}
    losses, kernels = [], []
    for constraints in (None, on_host):
        torch._dynamo.reset()
        model = dlrm_dmp(1, None, constraints=constraints)
        step = CompiledStep(model, DENSE_LR, backend="aot_eager")
        losses.append(torch.stack([step.step(b) for b in batches(20, BATCH, 0, 1)]))
        kernels = [m.kernel for m in model.module.model.sparse_arch.embedding_bag_collection.sparsecore_lookups()]
    torch._dynamo.reset()
    assert torch.equal(losses[1], losses[0])
    (counters,) = [k.host_tier_counters()["t0/0"] for k in kernels if k.host_tier]
    assert counters.batches == 20 and counters.hits > 0 and counters.evictions > 0


@pytest.mark.slow  # one emulated rank, five models: about 30 s
@pytest.mark.multiprocess
def test_on_an_emulated_tpu_rank_the_host_tier_trains_and_checkpoints_as_resident(tmp_path):
    """`tpurec launch --emulate-tpu v5e-1` (device "tpu", the TensorCore kernel): t0 and t2 on the host tier
    with LRU and with LFU, 30 steps, against the model all resident on the same device; DCP checkpoints after
    20 steps from the host tier to resident and back, 10 steps more (host_tier_tpu_program.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    program = str(Path(__file__).parent / "host_tier_tpu_program.py")
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5e-1", program, str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = json.loads(p.stdout.strip().splitlines()[-1])
    want = runs["resident"]
    assert len(want["losses"]) == 30
    for name in ("LRU", "LFU", "host_to_resident", "resident_to_host"):
        got = runs[name]
        # The loss (sum of the pooled output times a fixed upstream gradient) within float32 rounding: on
        # the TPU path a bag's rows are summed in partition order, which follows the cache slots. The
        # gradient does not depend on the output, and each row's update sums its entries in sample order
        # whatever its slot: every table and state shard is the resident one bit for bit.
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-5), name
        assert sorted(got["shards"]) == sorted(want["shards"])
        for key, shards in want["shards"].items():
            assert [(o, v) for o, v, _ in got["shards"][key]] == [(o, v) for o, v, _ in shards], (name, key)
        # The host tier's shards are host tensors (the whole table in host memory); the rest on the device.
        on_host = name in ("LRU", "LFU", "resident_to_host")
        for key, shards in got["shards"].items():
            cpu = on_host and key.split(".")[1] in c.ON_HOST
            assert {d for _, _, d in shards} == {"cpu" if cpu else "tpu:0"}, (name, key)
    for name in ("LRU", "LFU"):
        for table in ("t0/0", "t2/0"):
            counters = runs[name]["counters"][table]
            assert counters["hits"] > 0 and counters["evictions"] > 0 and counters["writebacks"] > 0
        assert runs[name]["cached"] == {"t0/0": 100, "t2/0": 200}


@pytest.mark.slow  # one emulated rank, three models: about 40 s alone
@pytest.mark.multiprocess
def test_host_tier_auto_moves_what_does_not_fit_a_tpu_and_trains_as_resident():
    """`DistributedModelParallel(..., host_tier="auto")` on an emulated v5e-1 rank whose HBM is cut to
    40 MB: t0 (200,000 x 64 with row-wise Adagrad, 51 MB) is refused without it; with it the planner
    keeps t0 on the host tier behind a fifth of its rows (the update's stack copy counted at the cache's
    rows, planners.stack_transient) and the model trains 5 steps to the all-resident model's losses
    (host_tier_auto_program.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    program = str(Path(__file__).parent / "host_tier_auto_program.py")
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tpurec.cli", "launch", "--emulate-tpu", "v5e-1", program]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["refused"].startswith("plan does not fit on v5e-1 (1 device of 38.15 MiB")
    assert got["host_tier"] == ["t0"] and got["cache_load_factor"] == {"t0": 0.2}
    assert got["losses"] == pytest.approx(got["resident_losses"], rel=1e-6) and len(got["losses"]) == 5


def test_host_tier_auto_is_for_dmp_s_own_plan_on_a_tpu():
    """One line each: a value other than auto, auto with a plan given, auto on a CPU rank."""
    from tpurec.runtime.device import DeviceKind
    from tpurec.sharding.dmp import _host_tier_choice

    assert (
        _host_tier_choice(None, None, DeviceKind.TPU) is None and _host_tier_choice("off", None, DeviceKind.TPU) is None
    )
    assert _host_tier_choice("auto", None, DeviceKind.TPU) == "auto"
    with pytest.raises(UserError, match=r"^host_tier= takes 'auto' or None, got 'yes'$"):
        _host_tier_choice("yes", None, DeviceKind.TPU)
    with pytest.raises(UserError, match=r"the given plan holds its own$"):
        _host_tier_choice("auto", ShardingPlan({}), DeviceKind.TPU)
    with pytest.raises(UserError, match=r"on the CPU name them \(ParameterConstraints\)$"):
        _host_tier_choice("auto", None, DeviceKind.CPU)
