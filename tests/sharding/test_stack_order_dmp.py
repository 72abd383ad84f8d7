"""ParameterConstraints' pooling factors reach the sharded kernels and place their stacks' tables
(tpurec/embedding/stack_order.py); one rank in this process, table-wise."""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.kernel import SparseCoreKernel
from tpurec.planner.planners import pooling_constraints
from tpurec.sharding.dmp import DistributedModelParallel, _pooling_factors, default_sharders

SPEC = [(f"hot{i}", 400, 8) for i in range(4)] + [(f"cold{i}", 1600, 1) for i in range(4)]


def _ebc():
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r, _ in SPEC
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _kernels(dmp):
    """The SparseCore kernels of the sharded EBC (TorchRec keeps its lookups in a plain list)."""
    lookups = dmp._dmp_wrapped_module._lookups
    return [e.kernel for lookup in lookups for e in lookup._emb_modules if isinstance(e.kernel, SparseCoreKernel)]


def test_pooling_factors_come_from_constraints_that_state_them():
    constraints = pooling_constraints({"hot0": 8.0, "cold0": 1.0})
    assert _pooling_factors(constraints) == {"hot0": 8.0, "cold0": 1.0}
    assert _pooling_factors(None) is None
    sharders = default_sharders(4, pooling_factors={"hot0": 8.0})
    assert dict(sharders[0].fused_params["pooling_factors"]) == {"hot0": 8.0}
    hash(sharders[0].fused_params["pooling_factors"])  # TorchRec groups tables by hashing fused params


def test_dmp_places_each_stack_by_the_constraints_pooling_factors():
    constraints = pooling_constraints({n: float(k) for n, _, k in SPEC})
    placed = DistributedModelParallel(_ebc(), device="cpu", constraints=constraints, batch_size=64)
    plain = DistributedModelParallel(_ebc(), device="cpu", batch_size=64)
    (kp,), (kn,) = _kernels(placed), _kernels(plain)
    hints = {t.source: t.expected_ids for t in kp.tables}
    assert hints == {n: float(k) for n, _, k in SPEC}
    assert all(t.expected_ids is None for t in kn.tables)
    order = [t.name.split("/")[0] for t in kp.stacks[0].layout.tables]
    assert order != [n for n, _, _ in SPEC] and sorted(order) == sorted(n for n, _, _ in SPEC)
    # the same lookups either way (state copied over), and the partitions now share the ids
    placed.load_state_dict(plain.state_dict())
    lengths = torch.cat([torch.full((64,), k) for _, _, k in SPEC])
    gen = torch.Generator().manual_seed(1)
    values = torch.cat([torch.randint(0, r, (64 * k,), generator=gen) for _, r, k in SPEC])
    kjt = KeyedJaggedTensor(keys=[f"f_{n}" for n, _, _ in SPEC], values=values, lengths=lengths)

    def lookup(dmp):
        out = dmp(kjt)
        return out.wait() if hasattr(out, "wait") else out

    a, b = lookup(plain), lookup(placed)
    torch.testing.assert_close(a.values(), b.values(), rtol=1e-6, atol=1e-6)
    loads = {}
    for name, k in (("plain", kn), ("placed", kp)):
        per = next(iter(k.last_stats.values())).ids_per_partition.sum(0).float()
        loads[name] = float(per.max() / per.mean())
    assert loads["plain"] > 3.0 and loads["placed"] < 1.1, loads
