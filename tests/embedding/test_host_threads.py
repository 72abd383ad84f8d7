"""The stacks' builds on a thread pool (host_threads.py, KernelInput.preprocess) give what one stack
after another gives: every array bit for bit, the same stats in the same order, the same counters;
TPUREC_HOST_THREADS=1 runs them in the calling thread."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from tests.embedding.helpers import make_tables, random_kjt
from tpurec.embedding import csr_build, host_threads
from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
from tpurec.embedding.optimizers.sgd import SGDSpec
from tpurec.errors import UserError


def _kernel(**kw):
    tables = make_tables()
    kt = [KernelTable(t.name, t.num_embeddings, t.embedding_dim, tuple(t.feature_names), "sum") for t in tables]
    # a stack per table: 3 stacks, one of two features
    return tables, SparseCoreKernel(kt, SGDSpec(lr=0.1), 2, stack_tables=False, **kw)


def _run(kernel, kjts, monkeypatch, threads: str):
    monkeypatch.setenv(host_threads.SWITCH, threads)
    out = []
    for kjt in kjts:
        inputs = kernel.preprocess(kjt)
        out.append((inputs, dict(kernel.last_stats)))
    return out, (kernel.dropped_id_count, kernel.multipass_batches)


def _assert_same(a, b, where: str = "") -> None:
    """Equal throughout: tensors bit for bit (the padding's gains are NaN), dataclasses field by field
    (SparseCoreInput, MultiPassInput, PreprocessStats), sequences and dicts item by item, in order."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        x, y = a.numpy(), b.numpy()
        if x.dtype.kind == "f":
            x, y = x.view(f"i{x.itemsize}"), y.view(f"i{y.itemsize}")
        assert np.array_equal(x, y), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{k}]")
    else:
        assert a == b, where


@pytest.mark.skipif(not csr_build.available(), reason="numba not installed")
@pytest.mark.parametrize("fixed", [True, False])  # limits fixed by the first batch (the TPU's case); per batch
def test_threaded_preprocess_equals_serial(fixed, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    tables = make_tables()
    kjts = [random_kjt(tables, batch, gen, max_len=6, hot_ids=k % 2 == 1) for k, batch in enumerate((16, 33, 16))]
    outs, counters, demands = {}, {}, {}
    for threads in ("1", "4"):
        _, kernel = _kernel(fixed_limits=fixed)
        kernel.inputs.table_demand = {}  # the demand bookkeeping too
        outs[threads], counters[threads] = _run(kernel, kjts, monkeypatch, threads)
        demands[threads] = dict(kernel.inputs.table_demand)
    assert len(outs["4"][0][0]) == 3  # three stacks
    assert any(type(x).__name__ == "MultiPassInput" for batch, _ in outs["4"] for x in batch) == fixed
    _assert_same(outs["1"], outs["4"])
    assert counters["1"] == counters["4"]  # dropped ids, multipass batches
    assert demands["1"] == demands["4"]


def test_one_thread_is_serial(monkeypatch):
    monkeypatch.setenv(host_threads.SWITCH, "1")
    assert host_threads.workers(8) == 1
    assert host_threads.map_tasks(lambda i: threading.get_ident(), 3) == [threading.get_ident()] * 3


def test_threads_run_in_order_on_the_pool(monkeypatch):
    monkeypatch.setenv(host_threads.SWITCH, "3")
    assert host_threads.workers(8) == 3 and host_threads.workers(2) == 2
    names = host_threads.map_tasks(lambda i: (i, threading.current_thread().name), 6)
    assert [i for i, _ in names] == list(range(6))
    assert all(n.startswith("tpurec-host") for _, n in names)
    sized = host_threads.map_tasks(lambda i: i * 10, 5, sizes=[1, 9, 3, 7, 5])  # largest first, results in order
    assert sized == [0, 10, 20, 30, 40]
    monkeypatch.delenv(host_threads.SWITCH)
    assert 1 <= host_threads.workers(100) <= 100


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_thread_count_is_refused(value, monkeypatch):
    monkeypatch.setenv(host_threads.SWITCH, value)
    with pytest.raises(UserError, match="TPUREC_HOST_THREADS"):
        host_threads.workers(4)


def test_a_program_that_used_the_pool_ends_when_its_ending_waits_for_its_threads(tmp_path):
    # `tpurec launch` ends a user's program waiting for its non-daemon threads; the pool's idle workers
    # are not daemon threads, and a rank that had built its stacks on them hung there (session 41)
    import subprocess
    import sys

    prog = tmp_path / "prog.py"
    prog.write_text(
        "import threading\n"
        "from tpurec.embedding import host_threads\n"
        "from tpurec.runtime.rank_exit import other_threads, run_and_exit\n"
        "def main():\n"
        "    assert host_threads.map_tasks(lambda i: i * i, 3) == [0, 1, 4]\n"
        "    assert any(t.name.startswith('tpurec-host') for t in threading.enumerate())\n"
        "    user = threading.Thread(target=lambda: print('user thread done', flush=True))\n"
        "    user.start()\n"
        "    print('pool workers waited for:', [t.name for t in other_threads() if t is not user], flush=True)\n"
        "run_and_exit(main, wait_for_threads=True)\n"
    )
    env = {**__import__("os").environ, "TPUREC_HOST_THREADS": "2"}
    p = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "pool workers waited for: []" in p.stdout and "user thread done" in p.stdout
