"""The first-contact checklist `tpurec selftest --device tpu` runs on a TPU host.

Each line is PASS/FAIL with its value, in the order a first TPU run would break: which chip and
how many SparseCores; whether TorchTPU's environment lets TorchRec call it; every SparseCore op
against the CPU reference; the module with a CPU and a device KeyedJaggedTensor; three Adam steps
with the number of programs TorchTPU is asked to compile (one per stack and op, or it recompiles);
a one-rank `tpurec.DistributedModelParallel` step on TorchTPU's process-group backend; the device
memory that step holds (and its peak) against the planner's figure for the same plan and batch.
tpurec has not run it on TPU hardware yet.

`device` and `generation` are parameters so that tests can run the same list on CPU through the
TorchTPU stand-in (tpurec/emulation/torchtpu_ops.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpurec.embedding.selftest import Check, _compare
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from tpurec.sharding.dmp import DistributedModelParallel


def tpu_checks(device: str = "tpu", *, generation: str | None = None, seed: int = 0) -> list[Check]:

    from tpurec.embedding.backend import select_device
    from tpurec.embedding.selftest import op_checks
    from tpurec.embedding.sparsecores import resolve_num_sparsecores
    from tpurec.runtime import device as dev

    target = select_device(device)
    generation = generation or dev.tpu_generation()
    try:
        num_sc = resolve_num_sparsecores(None, "tpu", generation=generation)
    except (RuntimeError, ValueError) as e:
        return [Check("chip and SparseCores", False, 0.0, 0.0, str(e))]
    if dev.tensorcore_only(generation):
        note = f"TPU {generation}: no SparseCore; the TensorCore kernel, a layout of {num_sc} per device"
    else:
        note = f"TPU {generation}: {num_sc} SparseCores per device"
    checks = [Check("chip and SparseCores", True, 0.0, 0.0, note)]
    problems = dev.tpu_env_problems()
    checks.append(Check("TorchTPU environment for TorchRec", not problems, 0.0, 0.0, "; ".join(problems) or "ok"))
    checks += op_checks(target, num_sc, seed)
    checks += _module_checks(target, num_sc, seed)
    checks += _dmp_checks(target, num_sc, seed)
    return checks


def _tables():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name="a", embedding_dim=16, num_embeddings=500, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=300, feature_names=["fb", "fc"]),
    ]


def _kjt(gen, batch: int = 32):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.randint(0, 5, (3 * batch,), generator=gen)
    rows = [500, 300, 300]
    values = torch.cat(
        [torch.randint(0, r, (int(n),), generator=gen) for r, n in zip(rows, lengths.view(3, batch).sum(1))]
    )
    return KeyedJaggedTensor(keys=["fa", "fb", "fc"], values=values, lengths=lengths)


def _module_checks(target, num_sc: int, seed: int) -> list[Check]:
    import torch

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
    from tpurec.embedding.optimizers.base import record_tpu_calls

    gen = torch.Generator().manual_seed(seed)
    kwargs: dict[str, Any] = dict(num_sparsecores=num_sc, fixed_limits=True, allow_id_dropping=True, pad_dims=True)
    torch.manual_seed(seed)
    ref = SparseCoreEmbeddingBagCollection(_tables(), torch.optim.Adam, {"lr": 0.01}, device="cpu", **kwargs)
    mod = SparseCoreEmbeddingBagCollection(_tables(), torch.optim.Adam, {"lr": 0.01}, device=target, **kwargs)
    mod.load_state_dict(ref.state_dict())
    kjt = _kjt(gen)
    want = ref(kjt).values().detach()
    checks = [
        _compare("module forward, host KJT", mod(kjt).values().detach().cpu(), want, 1e-4),
        _compare("module forward, device KJT", mod(kjt.to(target)).values().detach().cpu(), want, 1e-4),
    ]
    steps = []
    for _ in range(3):
        kjt = _kjt(gen)
        out_ref = ref(kjt).values()
        upstream = torch.randn(out_ref.shape, generator=gen)
        (out_ref * upstream).sum().backward()
        steps.append((kjt, upstream))
    with record_tpu_calls() as calls:  # only the device module's calls: the programs it needs
        for kjt, upstream in steps:
            (mod(kjt.to(target)).values() * upstream.to(target)).sum().backward()
    for t in ("a", "b"):
        checks.append(_compare(f"3 adam steps: table {t}", mod.table_weight(t).cpu(), ref.table_weight(t), 1e-4))
    stacks = len(mod.kernel.stacks)
    programs = len({key for key in calls})
    expected = 2 * stacks  # one lookup and one update program per stack
    checks.append(
        Check(
            "programs compiled over 3 adam steps",
            programs == expected,
            float(programs),
            float(expected),
            f"{programs} distinct TorchTPU calls for {stacks} stacks (one lookup + one update each expected)",
        )
    )
    return checks


def _dmp_checks(target, num_sc: int, seed: int) -> list[Check]:
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tpurec.sharding.dmp import DistributedModelParallel, default_sharders, process_group_backend

    ebc = EmbeddingBagCollection(_tables(), device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    _reset_peak(target)
    before = _device_bytes(target)
    try:
        dmp = DistributedModelParallel(ebc, device=target, sharders=default_sharders(num_sc), batch_size=BATCH)
        sd = dmp.state_dict()
        start = {k: v.local_shards()[0].tensor.detach().cpu().clone() for k, v in sd.items()}
        kjt = _kjt(torch.Generator().manual_seed(seed)).to(target)
        out = dmp(kjt).values()
        out.sum().backward()
        resident = out.device.type == target.type
        placed = _placement_devices(dmp)
        new_programs = _programs_of_a_second_step(dmp, kjt)
        moved = any(
            not torch.equal(v.local_shards()[0].tensor.detach().cpu(), start[k]) for k, v in dmp.state_dict().items()
        )
    except Exception as e:  # the checklist reports, it does not stop at the first failure
        return [Check("1-rank DMP step", False, 0.0, 0.0, f"{type(e).__name__}: {e}")]
    from tpurec.runtime.device import device_kind

    backend = process_group_backend(device_kind(target.type))
    own = "cpu" if target.type == DeviceKind.CPU else f"{target.type}:0"
    checks = [
        Check("1-rank DMP step", moved, 0.0, 0.0, f"process group {backend}; tables updated: {moved}"),
        # TorchTPU numbers each process's own device 0: shards anywhere else are refused by torch.
        Check("shards on this process's device", placed == {own}, 0.0, 0.0, f"placed on {sorted(placed)}, want {own}"),
        Check("lookup output on the device", resident, 0.0, 0.0, f"pooled output on {out.device}"),
    ]
    if new_programs is None:
        checks.append(Check("no new program in a second step", True, 0.0, 0.0, "skipped: no program count to read"))
    else:
        checks.append(
            Check(
                "no new program in a second step",
                new_programs == 0,
                float(new_programs),
                0.0,
                f"{new_programs} device programs first asked for by an identical second step (every op counted)",
            )
        )
    used, peak = _device_bytes(target), _device_peak_bytes(target)
    if used is None or before is None:
        checks.append(Check("device memory vs planner", True, 0.0, 0.0, "skipped: no device allocator statistics"))
    else:
        planned = planned_figures(dmp)
        tables = sum(t.num_embeddings * t.embedding_dim * 4 for t in _tables())
        checks.append(memory_check(used - before, None if peak is None else peak - before, planned, tables))
    return checks


def _placement_devices(dmp: DistributedModelParallel) -> set[str]:
    """The devices the DMP's plan places this rank's shards on ("tpu:0")."""
    from tpurec.planner.plan_check import module_plans

    return {
        str(shard.placement.device())
        for module_plan in module_plans(dmp.plan).values()
        for ps in module_plan.values()
        for shard in getattr(ps.sharding_spec, "shards", ())
        if shard.placement is not None
    }


def _programs_of_a_second_step(dmp: DistributedModelParallel, kjt: Any) -> int | None:
    """Device programs (every op: tpurec.emulation.device) first asked for by a second, identical step
    (two steps: the first warms up); None where no count can be read (a real TPU: TorchTPU 0.2.0
    exposes none tpurec reads)."""
    import sys

    device = sys.modules.get("tpurec.emulation.device")
    if device is None or not device.installed():
        return None
    dmp(kjt).values().sum().backward()  # the second step; its programs are the steady state's
    before = len(device.RECORD.programs)
    dmp(kjt).values().sum().backward()
    return len(device.RECORD.programs) - before


# The selftest's batch: the DMP is planned for it, so buffers and activations are the planner's too.
BATCH = 32
# Allocator granularity and the step's small temporaries (ids, CSR buffers of one batch).
MEMORY_SLACK_BYTES = 2 * 2**20


def planned_figures(dmp: DistributedModelParallel) -> dict:
    """The planner's bytes for rank 0 of `dmp`'s plan, from the same cost model `tpurec plan` prints."""
    from tpurec.data.catalog import TableSpec
    from tpurec.planner.estimators import spec_of
    from tpurec.planner.report import build_report

    tables = [TableSpec(t.name, t.feature_names[0], t.num_embeddings, t.embedding_dim, 2.0) for t in _tables()]
    report = build_report(
        dmp.plan,
        tables,
        spec_of(dmp.topology),
        batch_size=BATCH,
        optimizer="sgd",
        compute_device=dmp.topology.compute_device,
    )
    return report["devices"][0]


def memory_check(held: int, peak: int | None, planned: dict, tables: int) -> Check:
    """PASS when the device holds no more than the planner counted: after the step, weights + state +
    buffers + activations; at the step's peak, that plus the update's transient new table and state.
    The held bytes must also cover the tables' unpadded bytes `tables` (else they are not on the device)."""
    steady = planned["hbm_used_bytes"] - planned["transient_bytes"] - planned["reserved_bytes"]
    full = steady + planned["transient_bytes"]
    capacity = planned.get("hbm_capacity_bytes")
    if peak is not None and capacity and peak > capacity:
        # Not a reading: on the v5e chip TorchTPU 0.2.0 reported a peak of 1.4e14 B (docs/tpu.md)
        peak_note = f"peak statistic {peak:,} B is more than the device holds ({capacity:,} B): not read"
        peak = None
    else:
        peak_note = "no peak statistics" if peak is None else f"peak {peak:,} B vs planned {full:,} B"
        peak_note += "" if peak is None else " with the transient"
    ok = tables <= held <= steady + MEMORY_SLACK_BYTES and (peak is None or peak <= full + MEMORY_SLACK_BYTES)
    return Check(
        "device memory vs planner",
        ok,
        float(held),
        float(steady),
        f"held {held:,} B after the step vs planned {steady:,} B (tables {tables:,} B); {peak_note}",
    )


def _reset_peak(target) -> None:
    import torch

    reset = getattr(torch.accelerator, "reset_peak_memory_stats", None)
    if target.type != DeviceKind.CPU and reset is not None:
        try:
            reset()
        except Exception:  # an accelerator without statistics
            pass


def _device_peak_bytes(target) -> int | None:
    import torch

    peak = getattr(torch.accelerator, "max_memory_allocated", None)
    if target.type == DeviceKind.CPU or peak is None:
        return None
    try:
        return int(peak())
    except Exception:  # an accelerator without statistics
        return None


def _device_bytes(target) -> int | None:
    import torch

    if target.type == DeviceKind.CPU:
        return None
    allocated = getattr(torch.accelerator, "memory_allocated", None)
    try:
        return int(allocated()) if allocated is not None else None
    except Exception:  # an accelerator without statistics
        return None
