"""The first-contact checklist `tpurec selftest --device tpu` runs on a TPU host.

Each line is PASS/FAIL with its value, in the order a first TPU run would break: which chip and
how many SparseCores; whether TorchTPU's environment lets TorchRec call it; every SparseCore op
against the CPU reference; the module with a CPU and a device KeyedJaggedTensor; three Adam steps
with the number of programs TorchTPU is asked to compile (one per stack and op, or it recompiles);
a one-rank `tpurec.DistributedModelParallel` step on TorchTPU's process-group backend; the device
memory that step holds against the bytes of its (padded) tables. tpurec has not run it on TPU hardware yet.

`device` and `generation` are parameters so that tests can run the same list on CPU through the
TorchTPU stand-in (tests/tpu_standin.py).
"""

from __future__ import annotations

from tpurec.embedding.selftest import Check, _compare


def tpu_checks(device="tpu", *, generation: str | None = None, seed: int = 0) -> list[Check]:

    from tpurec import device as dev
    from tpurec.embedding.backend import select_device
    from tpurec.embedding.selftest import op_checks
    from tpurec.embedding.sparsecores import resolve_num_sparsecores

    target = select_device(device)
    generation = generation or dev.tpu_generation()
    try:
        num_sc = resolve_num_sparsecores(None, "tpu", generation=generation)
    except (RuntimeError, ValueError) as e:
        return [Check("chip and SparseCores", False, 0.0, 0.0, str(e))]
    checks = [Check("chip and SparseCores", True, 0.0, 0.0, f"TPU {generation}: {num_sc} SparseCores per device")]
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


def _kjt(gen, batch=32):
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
    kwargs = dict(num_sparsecores=num_sc, fixed_limits=True, allow_id_dropping=True, pad_dims=True)
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
    before = _device_bytes(target)
    try:
        dmp = DistributedModelParallel(ebc, device=target, sharders=default_sharders(num_sc))
        sd = dmp.state_dict()
        start = {k: v.local_shards()[0].tensor.detach().cpu().clone() for k, v in sd.items()}
        kjt = _kjt(torch.Generator().manual_seed(seed)).to(target)
        dmp(kjt).values().sum().backward()
        moved = any(
            not torch.equal(v.local_shards()[0].tensor.detach().cpu(), start[k]) for k, v in dmp.state_dict().items()
        )
    except Exception as e:  # the checklist reports, it does not stop at the first failure
        return [Check("1-rank DMP step", False, 0.0, 0.0, f"{type(e).__name__}: {e}")]
    backend = process_group_backend(target.type)
    checks = [Check("1-rank DMP step", moved, 0.0, 0.0, f"process group {backend}; tables updated: {moved}")]
    used = _device_bytes(target)
    if used is None or before is None:
        checks.append(Check("device memory vs tables", True, 0.0, 0.0, "skipped: no device allocator statistics"))
    else:
        planned = sum(t.num_embeddings * (-(-t.embedding_dim // 8) * 8) * 4 for t in _tables())
        held = used - before
        checks.append(
            Check(
                "device memory vs planner",
                held <= 1.5 * planned + 2**20,
                float(held),
                float(planned),
                f"held {held:,} B after the step; tables (padded) {planned:,} B",
            )
        )
    return checks


def _device_bytes(target) -> int | None:
    import torch

    if target.type == "cpu":
        return None
    allocated = getattr(torch.accelerator, "memory_allocated", None)
    try:
        return int(allocated()) if allocated is not None else None
    except Exception:  # an accelerator without statistics
        return None
