"""Host tables advised onto transparent huge pages (tpurec/embedding/huge_pages.py)."""

import sys
from pathlib import Path

import pytest
import torch

from tpurec.embedding import huge_pages
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised_kib(t: torch.Tensor) -> int:
    """KiB of t's memory in mappings advised onto huge pages ("hg" in /proc/self/smaps' VmFlags).

    The advice is what tpurec controls; how many huge pages Linux then grants (AnonHugePages)
    depends on the host's free, unfragmented memory (a CI host granted 5 of 12), so that is not
    asserted.
    """
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, overlap = 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            overlap = max(0, min(end, hi) - max(start, lo))
        elif head == "VmFlags:" and "hg" in line.split()[1:]:
            total += overlap // 1024
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [10, 70_000])  # 2.6 KB / 17.9 MB (float32): below and above MIN_BYTES
def test_filled_equals_torch_full(rows, dtype):
    got = huge_pages.filled((rows, 64), 0.25, dtype, "cpu")
    want = torch.full((rows, 64), 0.25, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off on this host",
)
def test_a_large_table_and_its_state_are_advised_onto_huge_pages():
    probe = torch.empty(5 << 20, dtype=torch.uint8)  # 5 MiB: one whole 2 MiB granule wherever it starts
    if not huge_pages.advise(probe):
        pytest.skip("this host refuses madvise(MADV_HUGEPAGE) (a sandbox's seccomp, say)")
    big = huge_pages.filled((100_000, 64), 0.0, torch.float32, "cpu")  # 25.6 MB = 12.2 granules: 11 whole ones at least
    assert _advised_kib(big) >= 11 * 2048, _advised_kib(big)
    # the kernels' own tables and optimizer state take that path
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    ebc = SparseCoreEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=100_000, feature_names=["f"])],
        torch.optim.Adagrad,
        {"lr": 0.1},
        device="cpu",
    )
    assert _advised_kib(ebc.kernel.stack_weight(0)) >= 11 * 2048
    state = ebc.kernel.stack_state(0, ebc.kernel.optimizer.state_names[0])
    assert state.numel() * state.element_size() >= huge_pages.MIN_BYTES
    assert _advised_kib(state) >= 11 * 2048


def test_switched_off_or_small_tables_are_never_advised(monkeypatch):
    def refuse(t):
        raise AssertionError("advised")

    monkeypatch.setattr(huge_pages, "advise", refuse)
    huge_pages.filled((10, 64), 0.0, torch.float32, "cpu")  # under MIN_BYTES
    monkeypatch.setenv("TPUREC_NO_HUGE_PAGES", "1")
    t = huge_pages.filled((100_000, 64), 1.5, torch.float32, "cpu")
    assert torch.equal(t, torch.full((100_000, 64), 1.5))


def test_advise_covers_only_whole_granules():
    tiny = torch.zeros(16)  # 64 bytes: no whole 2 MiB granule inside
    assert huge_pages.advise(tiny) is False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off on this host",
)
def test_move_onto_keeps_the_tensor_and_its_values_in_advised_memory():
    probe = torch.empty(5 << 20, dtype=torch.uint8)
    if not huge_pages.advise(probe):
        pytest.skip("this host refuses madvise(MADV_HUGEPAGE) (a sandbox's seccomp, say)")
    t = torch.nn.Parameter(torch.arange(100_000 * 64, dtype=torch.float32))  # 25.6 MB
    before, ident, where = t.detach().clone(), id(t), t.data_ptr()
    # (torch's allocator may hand out memory advised before, by an earlier test's tables: not asserted)
    assert huge_pages.move_onto(t) is True
    assert id(t) == ident and t.data_ptr() != where and torch.equal(t.detach(), before)
    assert _advised_kib(t) >= 11 * 2048
    small = torch.ones(10)
    assert huge_pages.move_onto(small) is False and torch.equal(small, torch.ones(10))


def test_the_fbgemm_peer_steps_from_memory_on_huge_pages_with_equal_work():
    """The kernels benchmark's FBGEMM side: its weights and state moved (huge_pages.move_onto), its
    step still equal to tpurec's on the same ids (equal_work), the moved memory what it reads."""
    from tpurec.bench import contenders, equal_work, matrix

    shape = matrix.Shape(tables=2, rows=40_000, dim=32, batch=64, zipf=False)  # 10.2 MB of weights
    ours, theirs = contenders.build(shape.tables, shape.rows, shape.dim, "adagrad")
    batch = matrix.make_batches(shape, 20, 1, 0)[0]
    upstream = equal_work.upstream_gradient(shape.batch, shape.tables * shape.dim, 0)
    assert equal_work.check(ours, theirs, batch, upstream)
    if sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text():
        weights = theirs.tables()[0]
        if huge_pages.advise(torch.empty(5 << 20, dtype=torch.uint8)):
            assert _advised_kib(weights) > 0
