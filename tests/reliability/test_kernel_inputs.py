"""Kernel inputs out of their domain (issue #29 item 6), refused at the Python API with one ValueError
or TypeError naming the argument, the value and the valid range.

Before: `preprocess()` clamped a sample index past the batch onto the last sample and wrapped a
negative one, truncated float ids, took gains of another length; `device_batch_size=0` and
`num_sc_per_device=0` were IndexError / ZeroDivisionError; the raw op `torch.ops.tpurec.*` dropped an
entry of sample 1000 without a word. Ids outside int32 and inconsistent KeyedJaggedTensors are
tests/embedding/test_bad_inputs.py's.
"""

from __future__ import annotations

import pytest
import torch

import tpurec.embedding.optimizers.sgd  # noqa: F401  registers torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd
from tpurec.embedding.constraints import PADDING_ID
from tpurec.embedding.preprocess import preprocess, preprocess_tables

BATCH = dict(device_batch_size=4, num_sc_per_device=2)
IN_BATCH = r"sample_index must be in \[0, device_batch_size=4\), got "


def _pre(ids, samples, gains=None, **kw):
    gains = torch.ones(len(ids)) if gains is None else gains
    return preprocess(torch.as_tensor(ids), torch.as_tensor(samples), gains, table_name="t", **{**BATCH, **kw})


PREPROCESS = [
    ("sample past the batch", lambda: _pre([1, 2], [0, 4]), ValueError, rf"'t': {IN_BATCH}0\.\.4"),
    ("sample 1000", lambda: _pre([1, 2], [1000, 0]), ValueError, rf"{IN_BATCH}0\.\.1000"),
    ("negative sample", lambda: _pre([1, 2], [0, -1]), ValueError, rf"{IN_BATCH}-1\.\.0"),
    (
        "float ids",
        lambda: _pre([1.0, 2.5], [0, 1]),
        TypeError,
        r"'t': ids must be an integer tensor, got torch\.float32",
    ),
    (
        "float samples",
        lambda: _pre([1, 2], [0.0, 1.0]),
        TypeError,
        r"sample_index must be an integer tensor, got torch\.float32",
    ),
    ("bool ids", lambda: _pre([True, False], [0, 1]), TypeError, r"ids must be an integer tensor, got torch\.bool"),
    ("gains short", lambda: _pre([1, 2], [0, 1], torch.ones(1)), ValueError, r"one entry per id, got 2, 2 and 1"),
    (
        "device_batch_size 0",
        lambda: _pre([1], [0], device_batch_size=0),
        ValueError,
        r"^device_batch_size=0 must be a whole number >= 1$",
    ),
    (
        "device_batch_size -4",
        lambda: _pre([1], [0], device_batch_size=-4),
        ValueError,
        r"^device_batch_size=-4 must be",
    ),
    (
        "num_sc_per_device 0",
        lambda: _pre([1], [0], num_sc_per_device=0),
        ValueError,
        r"^num_sc_per_device=0 must be a whole number >= 1$",
    ),
    (
        "global_device_count 0",
        lambda: _pre([1], [0], global_device_count=0),
        ValueError,
        r"^global_device_count=0 must be",
    ),
    (
        "batch 2.5",
        lambda: _pre([1], [0], device_batch_size=2.5),
        ValueError,
        r"^device_batch_size=2\.5 must be a whole number",
    ),
]


@pytest.mark.parametrize("case,call,exc,match", PREPROCESS, ids=[c[0] for c in PREPROCESS])
def test_preprocess_refuses_inputs_outside_their_domain(case, call, exc, match):
    with pytest.raises(exc, match=match) as e:
        call()
    assert "\n" not in str(e.value)


def test_preprocess_tables_names_the_table_at_fault():
    good = (torch.tensor([1, 2]), torch.tensor([0, 3]), torch.ones(2))
    bad = (torch.tensor([5, 6]), torch.tensor([3, 9]), torch.ones(2))
    with pytest.raises(ValueError, match=rf"^table 'second': {IN_BATCH}3\.\.9$"):
        preprocess_tables([good, bad, good], **BATCH, table_names=["first", "second", "third"])


def test_the_edges_of_the_domain_are_accepted():
    csr, _ = _pre([0, 2**31 - 1], [0, 3])
    assert int((csr.embedding_ids != PADDING_ID).sum()) == 2


@pytest.fixture
def csr():
    """A valid SparseCore input of 3 ids over a 4-sample batch on 2 SparseCores (2 samples each)."""
    csr, _ = _pre([1, 2, 3], [0, 1, 3])
    return csr


def _lookup(csr, **change):
    args = dict(
        row_pointers=csr.row_pointers,
        embedding_ids=csr.embedding_ids,
        sample_ids=csr.sample_ids,
        gains=csr.gains,
        embedding_table=torch.ones(16, 8),
        device_batch_size=4,
        num_sc_per_device=2,
        num_partitions=2,
        max_ids_per_partition=csr.max_ids_per_partition,
        max_unique_ids_per_partition=csr.max_unique_ids_per_partition,
    )
    return torch.ops.tpurec.sparse_dense_matmul(**{**args, **change})


def _with_sample(csr, sample: int) -> torch.Tensor:
    smp = csr.sample_ids.clone()
    smp[int((csr.embedding_ids != PADDING_ID).nonzero()[0])] = sample
    return smp


def test_the_raw_op_refuses_sample_1000(csr):
    assert _lookup(csr).shape == (4, 8)
    says = r"^sparse_dense_matmul: sample_ids\[0\]=1000 is outside \[0, 2\) \(device_batch_size=4 / num_sc_per_device=2"
    with pytest.raises(ValueError, match=says):
        _lookup(csr, sample_ids=_with_sample(csr, 1000))
    with pytest.raises(ValueError, match=r"sample_ids\[0\]=-1 is outside \[0, 2\)"):
        _lookup(csr, sample_ids=_with_sample(csr, -1))


RAW_OP = [
    ("num_sc_per_device 0", dict(num_sc_per_device=0), ValueError, r"num_sc_per_device=0 must be a whole number >= 1"),
    ("num_partitions 0", dict(num_partitions=0), ValueError, r"num_partitions=0 must be a whole number >= 1"),
    ("device_batch_size 0", dict(device_batch_size=0), ValueError, r"device_batch_size=0 must be a whole number >= 1"),
    (
        "batch not a multiple",
        dict(device_batch_size=5),
        ValueError,
        r"device_batch_size=5 is not a multiple of num_sc_per_device=2",
    ),
    ("int64 ids", "ids64", TypeError, r"embedding_ids must be an int32 tensor .*, got torch\.int64"),
    (
        "row pointer past the slots",
        "rp",
        ValueError,
        r"row_pointers must be in \[0, \d+\] \(the COO slots .*\), got 0\.\.1000000",
    ),
    ("short sample_ids", "short", ValueError, r"embedding_ids, sample_ids and gains must have the same size"),
]


@pytest.mark.parametrize("case,change,exc,match", RAW_OP, ids=[c[0] for c in RAW_OP])
def test_the_raw_op_refuses_counts_and_buffers_that_disagree(csr, case, change, exc, match):
    if change == "ids64":
        change = dict(embedding_ids=csr.embedding_ids.long())
    elif change == "rp":
        rp = csr.row_pointers.clone()
        rp[1] = 1_000_000  # the compiled loops would read far past the buffer
        change = dict(row_pointers=rp)
    elif change == "short":
        change = dict(sample_ids=csr.sample_ids[:-2])
    with pytest.raises(exc, match=match):
        _lookup(csr, **change)


def test_the_update_op_refuses_sample_1000(csr):
    table = torch.ones(16, 8)
    args = [csr.row_pointers, csr.embedding_ids, _with_sample(csr, 1000), csr.gains, table, torch.ones(4, 8), 0.1]
    with pytest.raises(ValueError, match=r"^update: sample_ids\[0\]=1000 is outside \[0, 2\)"):
        torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd(*args, 4, 2, 2, 8, 8)
    assert bool((table == 1).all())  # refused before any row changed
