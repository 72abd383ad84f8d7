"""Out-of-domain inputs at the kernel's boundary are refused with one line, never cut or wrapped."""

import math

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.preprocess import preprocess

from .helpers import make_tables


def _module(optim=torch.optim.SGD, **kwargs):
    return SparseCoreEmbeddingBagCollection(make_tables(), optim, kwargs or {"lr": 0.1}, num_sparsecores=2)


def _good_kjt(module, batch=4):
    keys = list(module.kernel.feature_order)
    lengths = torch.ones(len(keys) * batch, dtype=torch.long)
    return KeyedJaggedTensor(keys=keys, values=torch.zeros(len(keys) * batch, dtype=torch.long), lengths=lengths)


@pytest.mark.parametrize(
    "case,match",
    [
        ("lengths sum above the values", r"lengths sum to \d+ but it has \d+ values"),
        ("lengths sum below the values", r"lengths sum to \d+ but it has \d+ values"),
        ("lengths count not keys x batch", r"has \d+ lengths, but \d+ keys x batch \d+ need \d+"),
        ("negative length", r"negative length"),
    ],
)
def test_inconsistent_kjt_is_refused_as_stock_torchrec_does(case, match):
    m = _module()
    good = _good_kjt(m)
    keys, values, lengths = good.keys(), good.values(), good.lengths().clone()
    if case == "lengths sum above the values":
        lengths[0] += 2
    elif case == "lengths sum below the values":
        lengths[0] = 0
    elif case == "negative length":
        lengths[0], lengths[1] = -1, 3
    if case == "lengths count not keys x batch":
        kjt = KeyedJaggedTensor(keys=keys, values=values[:-1], lengths=lengths[:-1], stride=4)
    else:
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    m(good)  # the consistent batch works
    with pytest.raises(ValueError, match=match):
        m(kjt)


@pytest.mark.parametrize("lr", [math.nan, math.inf, -0.1])
def test_learning_rate_out_of_domain_is_refused(lr):
    with pytest.raises(ValueError, match=r"lr=.* must be"):
        _module(lr=lr)


@pytest.mark.parametrize(
    "optim,kwargs,match",
    [
        (torch.optim.Adam, {"lr": 0.1, "eps": -1e-8}, r"eps=-1e-08 must be >= 0"),
        (torch.optim.Adam, {"lr": 0.1, "betas": (1.0, 0.999)}, r"beta1=1.0 must be in \[0, 1\)"),
        (torch.optim.Adagrad, {"lr": 0.1, "eps": math.nan}, r"eps=nan must be a finite number"),
    ],
)
def test_other_hyperparameters_out_of_domain_are_refused(optim, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _module(optim, **kwargs)


def test_learning_rate_set_to_nan_by_a_scheduler_stops_the_update():
    m = _module()
    m.fused_optimizer.param_groups[0]["lr"] = float("nan")
    m.fused_optimizer.zero_grad()  # the lr the next forward's update takes (stock's set_learning_rate)
    with pytest.raises(ValueError, match=r"\(param_groups\): lr=nan must be a finite number"):
        m(_good_kjt(m)).values().sum().backward()


@pytest.mark.parametrize("bad", [-1, 2**31, 2**40])
def test_public_preprocess_refuses_ids_outside_int32(bad):
    ids = torch.tensor([0, 3, bad])
    with pytest.raises(ValueError, match=r"table 'big': ids must be in \[0, 2\^31\)"):
        preprocess(
            ids,
            torch.tensor([0, 1, 2]),
            torch.ones(3),
            device_batch_size=4,
            num_sc_per_device=2,
            table_name="big",
        )


def test_variable_batch_per_feature_is_refused_by_the_sequence_kernel():
    """EmbeddingBagCollections take VBE batches (tests/embedding/test_vbe.py); the unpooled
    EmbeddingCollection's kernel does not, and says so rather than reading it as one batch."""
    from torchrec.modules.embedding_configs import EmbeddingConfig

    from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection

    tables = [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=10, feature_names=["a", "b"])]
    m = SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    lengths = torch.ones(5, dtype=torch.long)  # a: batch 2, b: batch 3
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.zeros(5, dtype=torch.long), lengths=lengths, stride_per_key_per_rank=[[2], [3]]
    )
    assert kjt.variable_stride_per_key()
    with pytest.raises(NotImplementedError, match=r"variable batch per feature \(VBE KeyedJaggedTensors\)"):
        m(kjt)
