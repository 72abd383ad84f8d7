"""One default learning rate per optimizer spec, each the one its peer uses (issue 62): built from torch
kwargs, the torch optimizer's own default; from TorchRec's fused params, FBGEMM's TBE default. Read from
the installed torch, torchrec and fbgemm_gpu, so a change there fails here."""

from __future__ import annotations

import inspect

import pytest

from tpurec.embedding.optimizers import registry
from tpurec.embedding.optimizers.defaults import FBGEMM_LEARNING_RATE


def _specs() -> dict:
    return registry.spec_classes()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_a_spec_from_torch_kwargs_defaults_to_its_torch_optimizers_lr(name):
    cls = _specs()[name]
    torch_default = inspect.signature(cls.torch_optimizer()).parameters["lr"].default
    assert cls.default_lr() == torch_default
    assert registry.spec_from_torch(cls.torch_optimizer(), {}).lr == torch_default


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_a_spec_from_fused_params_without_one_defaults_to_fbgemms(name):
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    fbgemm_default = inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters["learning_rate"]
    assert FBGEMM_LEARNING_RATE == fbgemm_default.default
    assert _specs()[name].from_fused_params({}).lr == FBGEMM_LEARNING_RATE
    assert _specs()[name].from_fused_params({"lr": 0.5}).lr == 0.5
    assert _specs()[name].from_fused_params({"learning_rate": 0.25, "lr": 0.5}).lr == 0.25
