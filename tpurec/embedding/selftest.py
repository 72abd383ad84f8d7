"""The embedding kernels' self-checks, run by `tpurec selftest` (tpurec/selftest.py).

`cpu_checks`: the CPU reference against independent oracles (torchrec's EmbeddingBagCollection,
FBGEMM's CPU TBE, torch.optim.Adam, jax-tpu-embedding's preprocessing when installed).
`op_checks`: the SparseCore ops on a device (TorchTPU on a TPU) against the CPU reference, forward
and every fused optimizer, on small random inputs; part of the TPU first-contact checklist
(tpurec/selftest/tpu.py). Not yet run on TPU hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Check:
    name: str
    passed: bool
    max_error: float
    tolerance: float
    note: str = ""


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, note: str = "") -> Check:
    import torch

    err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    ok = got.shape == want.shape and bool(torch.isfinite(got).all()) and err <= tol
    return Check(name, ok, err, tol, note)


def _tables(pooling: Any) -> list[Any]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=50, feature_names=["fa"], pooling=pooling),
        EmbeddingBagConfig(name="b", embedding_dim=16, num_embeddings=13, feature_names=["fb"], pooling=pooling),
    ]


def _batch(gen: torch.Generator, tables: list[Any], batch: int = 12, weighted: bool = False) -> KeyedJaggedTensor:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    lengths = torch.randint(0, 5, (len(keys) * batch,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, r, (int(lengths[k * batch : (k + 1) * batch].sum()),), generator=gen)
            for k, r in enumerate(rows)
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def cpu_checks(seed: int = 0) -> list[Check]:
    import torch
    from torchrec.modules.embedding_configs import PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    gen = torch.Generator().manual_seed(seed)
    checks = []
    for pooling, weighted in ((PoolingType.SUM, False), (PoolingType.MEAN, False), (PoolingType.SUM, True)):
        tables = _tables(pooling)
        sc = SparseCoreEmbeddingBagCollection(
            tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=4, is_weighted=weighted, device="cpu"
        )
        ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
        ebc.load_state_dict(sc.state_dict())
        kjt = _batch(gen, tables, weighted=weighted)
        checks.append(
            _compare(
                f"forward {pooling.name.lower()}{' weighted' if weighted else ''} vs torchrec EBC",
                sc(kjt).values().detach(),
                ebc(kjt).values().detach(),
                1e-5,
            )
        )
    for optim, kwargs in (
        (torch.optim.SGD, {"lr": 0.2}),
        (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-4}),
        (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-4}),
    ):
        checks.append(_vs_fbgemm(optim, kwargs, gen))
    checks.append(_adam_vs_torch(gen))
    checks.append(_preprocess_vs_jax(gen))
    return checks


def _vs_fbgemm(optim: Any, kwargs: dict[str, Any], gen: torch.Generator) -> Check:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from torchrec.modules.embedding_configs import PoolingType

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
    from tpurec.embedding.optimizers.registry import spec_from_torch

    spec = spec_from_torch(optim, kwargs)
    assert spec.fbgemm_optim is not None, f"{spec.name} has no fbgemm counterpart"
    kind, fb = spec.name, getattr(EmbOptimType, spec.fbgemm_optim)  # the oracle runs the same optimizer
    tables = _tables(PoolingType.SUM)
    sc = SparseCoreEmbeddingBagCollection(tables, optim, kwargs, num_sparsecores=4, device="cpu")
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
        optimizer=fb,
        learning_rate=kwargs["lr"],
        eps=kwargs.get("eps", 1e-8),
        pooling_mode=PoolingMode.SUM,
    )
    for w, t in zip(tbe.split_embedding_weights(), tables):
        w.data.copy_(sc.table_weight(t.name))
    for _ in range(3):
        kjt = _batch(gen, tables)
        up = torch.randn(kjt.stride(), 24, generator=gen)
        (sc(kjt).values() * up).sum().backward()
        (tbe(kjt.values(), kjt.offsets()) * up).sum().backward()
    got = torch.cat([sc.table_weight(t.name).flatten() for t in tables])
    want = torch.cat([w.detach().flatten() for w in tbe.split_embedding_weights()])
    return _compare(f"3 steps {kind} vs FBGEMM CPU TBE", got, want, 1e-5)


def _adam_vs_torch(gen: torch.Generator) -> Check:
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=6, feature_names=["f"])]
    kw: dict[str, Any] = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.Adam, kw, num_sparsecores=2, device="cpu")
    ebc = EmbeddingBagCollection(tables)
    ebc.load_state_dict(sc.state_dict())
    opt = torch.optim.Adam(ebc.parameters(), **kw)
    for t in range(1, 4):  # every row in every batch: dense Adam equals the lazy fused update
        values = torch.cat([torch.arange(6), torch.randint(0, 6, (2,), generator=gen)])
        kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=torch.tensor([4, 4]))
        up = torch.randn(2, 8, generator=gen)
        (sc(kjt).values() * up).sum().backward()
        opt.zero_grad()
        (ebc(kjt).values() * up).sum().backward()
        # The fused update keeps eps constant (TorchTPU compiles it in); that is torch's Adam with
        # eps / sqrt(1 - beta2^t) at step t (tpurec/embedding/optimizers/adam.py).
        opt.param_groups[0]["eps"] = kw["eps"] / (1 - kw["betas"][1] ** t) ** 0.5
        opt.step()
    return _compare(
        "3 steps adam vs torch.optim.Adam (epsilon-hat form)",
        sc.table_weight("t"),
        ebc.state_dict()["embedding_bags.t.weight"],
        1e-5,
    )


def _preprocess_vs_jax(gen: torch.Generator) -> Check:
    import os

    import numpy as np
    import torch

    from tpurec.embedding.preprocess import preprocess

    try:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax
        from jax_tpu_embedding.sparsecore.lib.core import input_preprocessing as ref
    except ImportError:
        return Check(
            "preprocess vs jax-tpu-embedding reference", True, 0.0, 0.0, "skipped: jax-tpu-embedding not installed"
        )
    batch, num_sc = 16, 4
    bags = [
        torch.randint(0, 100, (int(n),), generator=gen).numpy() for n in torch.randint(0, 5, (batch,), generator=gen)
    ]
    weights = [np.ones(len(b), np.float32) for b in bags]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    rp, emb, smp, gns = ref.preprocess_sparse_dense_matmul_input(
        np.array(bags, dtype=object),
        np.array(weights, dtype=object),
        mesh,
        max_ids_per_partition=32,
        max_unique_ids_per_partition=32,
        num_sc_per_device=num_sc,
    )
    ids = torch.from_numpy(np.concatenate(bags)).long()
    samples = torch.repeat_interleave(torch.arange(batch), torch.tensor([len(b) for b in bags]))
    csr, _ = preprocess(
        ids,
        samples,
        torch.ones(ids.numel()),
        device_batch_size=batch,
        num_sc_per_device=num_sc,
        max_ids_per_partition=32,
        max_unique_ids_per_partition=32,
    )
    same = (
        np.array_equal(np.asarray(rp), csr.row_pointers.numpy())
        and np.array_equal(np.asarray(emb), csr.embedding_ids.numpy())
        and np.array_equal(np.asarray(smp), csr.sample_ids.numpy())
    )
    return Check("preprocess vs jax-tpu-embedding reference", same, 0.0 if same else 1.0, 0.0)


def op_checks(device: torch.device | str, num_sc: int, seed: int = 0) -> list[Check]:
    """The SparseCore ops on `device` vs the CPU reference on the same inputs, with the chip's SparseCore
    count (TorchTPU's kernels use their own; a layout for another count would be wrong)."""
    from dataclasses import replace

    import torch

    from tpurec.embedding.optimizers.registry import spec_classes
    from tpurec.embedding.preprocess import preprocess

    tpu = device
    gen = torch.Generator().manual_seed(seed)
    batch, rows, dim = 16 * num_sc, 1024, 16
    n = 256
    ids, samples = torch.randint(0, rows, (n,), generator=gen), torch.randint(0, batch, (n,), generator=gen)
    csr, _ = preprocess(
        ids,
        samples,
        torch.rand(n, generator=gen),
        device_batch_size=batch,
        num_sc_per_device=num_sc,
        max_ids_per_partition=256,
        max_unique_ids_per_partition=256,
    )
    head = [csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains]
    tail = [batch, num_sc, num_sc, 256, 256]
    table = torch.randn(rows, dim, generator=gen)
    grad = torch.randn(batch, dim, generator=gen)

    def on(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to(tpu) for t in ts]

    checks = [
        _compare(
            "forward sparse_dense_matmul",
            torch.ops.tpurec.sparse_dense_matmul(*on(head), table.to(tpu), *tail).cpu(),
            torch.ops.tpurec.sparse_dense_matmul(*head, table, *tail),
            1e-4,
        )
    ]
    # Every optimizer's fused update, at step 1, from its spec's own state shapes and initial values.
    # Settings known to give a well-conditioned first step; any other spec runs with its defaults.
    settings = {
        "sgd": {"lr": 0.1},
        "rowwise_adagrad": {"lr": 0.1, "eps": 1e-8, "initial_accumulator_value": 0.1},
        "adagrad": {"lr": 0.1, "eps": 1e-8, "initial_accumulator_value": 0.1},
        "adam": {"lr": 0.01},
    }
    dev_csr = replace(
        csr, **{f: getattr(csr, f).to(tpu) for f in ("row_pointers", "embedding_ids", "sample_ids", "gains")}
    )
    for kind, cls in spec_classes().items():
        spec = cls.from_torch_kwargs(settings.get(kind, {}))
        states = [torch.full(spec.state_shape(s, rows, dim), spec.initial_value(s)) for s in spec.state_names]
        cpu_t, cpu_s = table.clone(), [s.clone() for s in states]
        dev_t, dev_s = table.to(tpu), [s.to(tpu) for s in states]
        spec.apply_update(csr, cpu_t, cpu_s, grad.clone(), spec.lr, 1, f"tpurec_selftest_{kind}")
        spec.apply_update(dev_csr, dev_t, dev_s, grad.to(tpu), spec.lr, 1, f"tpurec_selftest_{kind}")
        checks.append(_compare(f"fused {kind} update: table", dev_t.cpu(), cpu_t, 1e-4))
        for k, (c, d) in enumerate(zip(cpu_s, dev_s)):
            checks.append(_compare(f"fused {kind} update: state {k}", d.cpu(), c, 1e-4))
    return checks
