"""The one place a kernel is picked (embedding/kernel_kinds.py): by device type and chip generation."""

from __future__ import annotations

import pytest

from tpurec.embedding import ops
from tpurec.embedding.kernel_kinds import SPARSECORE, TENSORCORE, kernel_classes, kernel_kind
from tpurec.embedding.optimizers import adagrad, adam, sgd


@pytest.mark.parametrize(
    ("device_type", "generation", "kind"),
    [
        ("tpu", "v5p", SPARSECORE),
        ("tpu", "v6e", SPARSECORE),
        ("tpu", "v7x", SPARSECORE),
        ("tpu", "v5e", TENSORCORE),  # no SparseCore
        ("tpu", "v4", TENSORCORE),  # SparseCores no public kernel drives
        ("cpu", "v5e", SPARSECORE),  # off the TPU path: the exact CPU reference
        (None, None, SPARSECORE),
    ],
)
def test_the_kind_follows_the_device_and_the_chip(device_type, generation, kind):
    assert kernel_kind(device_type, generation) == kind


def test_an_emulated_v5e_rank_takes_the_tensorcore_kernel(monkeypatch):
    monkeypatch.setenv("TPUREC_EMULATE_TPU", "v5e-8")  # the CPU of an emulated TPU rank is on the TPU path
    assert kernel_kind("cpu") == TENSORCORE
    monkeypatch.setenv("TPUREC_EMULATE_TPU", "v5p-8")
    assert kernel_kind("cpu") == SPARSECORE


def test_each_kind_brings_a_tpu_kernel_for_every_op():
    pytest.importorskip("jax")
    want = {ops.sparse_dense_matmul, sgd.op, adagrad.op, adam.op}
    for kind in (SPARSECORE, TENSORCORE):
        assert set(kernel_classes(kind).device_kernels()) == want
    tensorcore = kernel_classes(TENSORCORE).device_kernels()[sgd.op]
    assert tensorcore.__module__ == "tpurec.embedding.tensorcore.tpu_bridge"
    assert kernel_classes(SPARSECORE).device_kernels()[sgd.op].__module__ == "tpurec.embedding.optimizers.sgd"
    with pytest.raises(ValueError, match="unknown embedding kernel kind 'gpu'"):
        kernel_classes("gpu")
