"""Fused updates equal independent oracles: FBGEMM's CPU TBE, torch optimizers, finite differences."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding import csr_build, direct
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

from .helpers import make_tables, random_kjt

STEPS = 5


@pytest.fixture(params=["direct", "layout"])
def step_path(request, monkeypatch):
    """Each oracle test on both CPU update paths: with numba present every step here takes the
    direct step (tpurec/embedding/direct.py), so without the layout run the layout path's update
    code (the one TPUs run) would meet these oracles only through the direct-vs-layout comparison."""
    if request.param == "layout":
        monkeypatch.setenv("TPUREC_NO_DIRECT", "1")
    else:
        monkeypatch.delenv("TPUREC_NO_DIRECT", raising=False)
        if not csr_build.available():
            pytest.skip("numba not installed: no direct step")
    return request.param


def _check_path(sc, path: str) -> None:
    # every setting here, weight decay included, has a direct step: each run takes the path it names
    assert direct.applies(sc.kernel) == (path == "direct")


def fbgemm_tbe(tables, optim, **kw):
    specs = [
        (t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
        for t in tables
        for _ in t.feature_names
    ]
    # One FBGEMM table per feature keeps the comparison simple: use tables with one feature each.
    return SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=optim, pooling_mode=PoolingMode.SUM, **kw)


def single_feature_tables():
    return [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=30, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", embedding_dim=16, num_embeddings=7, feature_names=["fb"]),
        EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=100, feature_names=["fc"]),
    ]


@pytest.mark.parametrize(
    "torch_optim,kwargs,fbgemm_optim",
    [
        (torch.optim.SGD, {"lr": 0.3}, EmbOptimType.EXACT_SGD),
        (RowWiseAdagrad, {"lr": 0.3, "eps": 1e-4}, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-4}, EmbOptimType.EXACT_ADAGRAD),
    ],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_updates_equal_fbgemm_cpu_tbe(torch_optim, kwargs, fbgemm_optim, weighted, step_path):
    torch.manual_seed(3)  # the tables' initial values: the same whatever ran before in the process
    tables = single_feature_tables()
    gen = torch.Generator().manual_seed(3)
    sc = SparseCoreEmbeddingBagCollection(tables, torch_optim, kwargs, num_sparsecores=4, is_weighted=weighted)
    _check_path(sc, step_path)
    tbe = fbgemm_tbe(tables, fbgemm_optim, learning_rate=kwargs["lr"], eps=kwargs.get("eps", 1e-8))
    for w, t in zip(tbe.split_embedding_weights(), tables):
        w.data.copy_(sc.table_weight(t.name))
    for step in range(STEPS):
        kjt = random_kjt(tables, 16, gen, weighted=weighted, hot_ids=step % 2 == 0)
        ours = sc(kjt).values()
        theirs = tbe(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights_or_none())
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        upstream = torch.randn(ours.shape, generator=gen)
        (ours * upstream).sum().backward()
        (theirs * upstream).sum().backward()
    for w, t in zip(tbe.split_embedding_weights(), tables):
        torch.testing.assert_close(sc.table_weight(t.name), w, rtol=1e-5, atol=1e-6)
    if fbgemm_optim != EmbOptimType.EXACT_SGD:
        state = sc.fused_optimizer.state_dict()["state"]
        for s, t in zip(tbe.get_optimizer_state(), tables):
            ours = state[f"embedding_bags.{t.name}.weight"][f"{t.name}.momentum1"]
            torch.testing.assert_close(ours, s["sum"].view_as(ours), rtol=1e-5, atol=1e-7)


def _dense_step_model(tables, torch_optim, kwargs):
    ebc = EmbeddingBagCollection(tables)
    return ebc, torch_optim(ebc.parameters(), **kwargs)


@pytest.mark.parametrize(
    "optim,kwargs,dense",
    [
        (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}, torch.optim.Adam),
        (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-6, "initial_accumulator_value": 0.1}, torch.optim.Adagrad),
        # FBGEMM's Adam decays decoupled, w -= lr (step + wd w): AdamW's (optimizers/weight_decay.py)
        (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.5}, torch.optim.AdamW),
        # torch's own spelling of AdamW, accepted (it was refused)
        (
            torch.optim.Adam,
            {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.5, "decoupled_weight_decay": True},
            torch.optim.Adam,
        ),
    ],
)
def test_updates_equal_torch_optimizer_when_every_row_is_touched(optim, kwargs, dense, step_path):
    # With every row in every batch, a dense torch optimizer and the lazy sparse update coincide.
    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=6, feature_names=["f"])]
    sc = SparseCoreEmbeddingBagCollection(tables, optim, kwargs, num_sparsecores=2)
    _check_path(sc, step_path)
    ebc, opt = _dense_step_model(tables, dense, kwargs)
    ebc.load_state_dict(sc.state_dict())
    gen = torch.Generator().manual_seed(5)
    for step in range(1, STEPS + 1):
        values = torch.cat([torch.arange(6), torch.randint(0, 6, (10,), generator=gen)])
        kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=torch.tensor([4, 4, 4, 4]))
        upstream = torch.randn(4, 8, generator=gen)
        (sc(kjt).values() * upstream).sum().backward()
        opt.zero_grad()
        (ebc(kjt).values() * upstream).sum().backward()
        if optim is torch.optim.Adam:
            # Fused Adam keeps eps constant (TorchTPU compiles it in): torch's Adam with eps/sqrt(1-b2^t).
            opt.param_groups[0]["eps"] = kwargs["eps"] / (1 - kwargs["betas"][1] ** step) ** 0.5
        opt.step()
    torch.testing.assert_close(sc.table_weight("t"), ebc.state_dict()["embedding_bags.t.weight"], rtol=1e-5, atol=1e-6)


def test_adam_with_constant_epsilon_stays_within_a_hair_of_torch_adam():
    # The documented price of a constant epsilon: against torch.optim.Adam as is (eps constant in
    # v-hat space), the weights after 5 steps differ by < 1e-4 of how far they moved.
    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=6, feature_names=["f"])]
    kwargs = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.Adam, kwargs, num_sparsecores=2)
    ebc, opt = _dense_step_model(tables, torch.optim.Adam, kwargs)
    ebc.load_state_dict(sc.state_dict())
    start = sc.table_weight("t").clone()
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        values = torch.cat([torch.arange(6), torch.randint(0, 6, (10,), generator=gen)])
        kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=torch.tensor([4, 4, 4, 4]))
        upstream = torch.randn(4, 8, generator=gen)
        (sc(kjt).values() * upstream).sum().backward()
        opt.zero_grad()
        (ebc(kjt).values() * upstream).sum().backward()
        opt.step()
    theirs = ebc.state_dict()["embedding_bags.t.weight"]
    moved = float((theirs - start).abs().max())
    diff = float((sc.table_weight("t") - theirs).abs().max())
    assert 0 < diff < 1e-4 * moved, (diff, moved)


def test_adam_is_lazy_like_sparse_adam():
    # Rows outside the batch are untouched; touched rows follow torch.optim.SparseAdam (eps=0 makes the
    # two epsilon placements agree exactly).
    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=40, feature_names=["f"])]
    kwargs = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 0.0}
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.Adam, kwargs, num_sparsecores=4)
    bag = torch.nn.EmbeddingBag(40, 8, mode="sum", sparse=True)
    bag.weight.data.copy_(sc.table_weight("t"))
    opt = torch.optim.SparseAdam(bag.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-30)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        values = torch.randint(0, 20, (12,), generator=gen)  # rows 20..39 never touched
        kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=torch.tensor([3, 3, 3, 3]))
        upstream = torch.randn(4, 8, generator=gen)
        (sc(kjt).values() * upstream).sum().backward()
        opt.zero_grad()
        (bag(values, torch.tensor([0, 3, 6, 9])) * upstream).sum().backward()
        opt.step()
    torch.testing.assert_close(sc.table_weight("t"), bag.weight.data, rtol=1e-5, atol=1e-6)
    assert torch.equal(sc.table_weight("t")[20:], bag.weight.data[20:])


def test_sgd_update_matches_finite_differences():
    # For SGD, w_new = w - lr * dL/dw; estimate dL/dw by central differences of the forward.
    tables = [
        EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=9, feature_names=["f"], pooling=PoolingType.MEAN)
    ]
    torch.manual_seed(0)
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 1.0}, num_sparsecores=2)
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 1, 4, 8, 0, 4]), lengths=torch.tensor([3, 0, 3]))
    upstream = torch.randn(3, 8, dtype=torch.float64)
    w0 = sc.table_weight("t").double()

    def loss(w):
        sc.kernel.write_weight("t", w.float())
        with torch.no_grad():
            return float((sc(kjt).values().double() * upstream).sum())

    grad = torch.zeros_like(w0)
    h = 1e-2  # the loss is linear in w, so central differences are exact up to rounding
    for r in range(9):
        for c in range(8):
            e = torch.zeros_like(w0)
            e[r, c] = h
            grad[r, c] = (loss(w0 + e) - loss(w0 - e)) / (2 * h)
    sc.kernel.write_weight("t", w0.float())
    (sc(kjt).values() * upstream.float()).sum().backward()
    torch.testing.assert_close(sc.table_weight("t").double(), w0 - grad, rtol=1e-4, atol=1e-5)


def test_fused_optimizer_lr_scheduler_and_state_roundtrip():
    tables = make_tables()
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.Adam, {"lr": 0.1}, num_sparsecores=2)
    sched = torch.optim.lr_scheduler.StepLR(sc.fused_optimizer, step_size=1, gamma=0.0)
    gen = torch.Generator().manual_seed(0)
    kjt = random_kjt(tables, 8, gen)
    sc(kjt).values().sum().backward()
    saved_opt = {k: {s: v.clone() for s, v in d.items()} for k, d in sc.fused_optimizer.state_dict()["state"].items()}
    saved_w = {k: v.clone() for k, v in sc.state_dict().items()}
    sc.fused_optimizer.step()  # hands the group's lr to the kernel (0.1, as it was), as stock's does
    sched.step()  # lr -> 0: further backward passes must not move the weights...
    assert sc.fused_optimizer.param_groups[0]["lr"] == 0.0
    sc.fused_optimizer.zero_grad()  # ...once the fused optimizer hands it over (stock: set_learning_rate)
    sc(kjt).values().sum().backward()
    for k, v in saved_w.items():
        assert torch.equal(sc.state_dict()[k], v)
    # optimizer state did move (moments decay) and loading the saved state restores it exactly
    now = sc.fused_optimizer.state_dict()["state"]
    assert not torch.equal(
        now["embedding_bags.t1.weight"]["t1.momentum1"], saved_opt["embedding_bags.t1.weight"]["t1.momentum1"]
    )
    sc.fused_optimizer.load_state_dict({"state": saved_opt})
    again = sc.fused_optimizer.state_dict()["state"]
    for k, d in saved_opt.items():
        for s, v in d.items():
            assert torch.equal(again[k][s], v), (k, s)
    assert [sc.kernel.step_count(t) for t in sc.kernel.table_names] == [1] * len(tables)


def test_adam_step_count_written_in_place_reaches_the_kernel():
    """DCP's load writes into the "<table>.step" scalars state_dict() returned, with no
    load_state_dict call: the kernels must still take the step count before their next update."""
    tables = make_tables()
    gen = torch.Generator().manual_seed(1)
    kjts = [random_kjt(tables, 8, gen) for _ in range(3)]

    def trained(steps_written: int | None):
        torch.manual_seed(0)
        sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.Adam, {"lr": 0.1}, num_sparsecores=2)
        for kjt in kjts[:2]:
            sc(kjt).values().sum().backward()
        if steps_written is not None:
            for entry in sc.fused_optimizer.state_dict()["state"].values():
                for name, v in entry.items():
                    if name.endswith(".step"):
                        v.fill_(steps_written)  # in place, as dcp.load does
        sc(kjts[2]).values().sum().backward()
        return sc

    plain, rewound = trained(None), trained(0)
    assert [plain.kernel.step_count(t) for t in plain.kernel.table_names] == [3] * len(tables)
    assert [rewound.kernel.step_count(t) for t in rewound.kernel.table_names] == [1] * len(tables)
    # Adam's bias correction at step 1 vs step 3 moves the rows differently
    assert not torch.allclose(rewound.table_weight(tables[0].name), plain.table_weight(tables[0].name))
    # and writing back the count it already had changes nothing
    same = trained(2)
    torch.testing.assert_close(same.table_weight(tables[0].name), plain.table_weight(tables[0].name), rtol=0, atol=0)
