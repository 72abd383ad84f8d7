"""tpurec's preprocess against jax-tpu-embedding 0.1.0: the Python reference and the C++ path.

Seeded random ragged batches (empty bags, ids repeated within and across bags, per-id weights) over
num_sc_per_device in {1, 2, 4} x global_device_count in {1, 2, 4} and tight / loose / 8-aligned
limits; the id-limit errors; allow_id_dropping against the C++ path's dropping. See
docs/kernels_preprocess.md for what is compared and the differences found.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jte_oracle as jo  # noqa: E402

from tpurec.embedding.constraints import round_up  # noqa: E402
from tpurec.embedding.preprocess import IdLimitExceededError, preprocess, preprocess_tables  # noqa: E402

pytest.importorskip("jax_tpu_embedding")

REPO = Path(__file__).resolve().parents[2]
GRID = [(s, n) for s in (1, 2, 4) for n in (1, 2, 4)]


def _observed(batch: jo.RaggedBatch, num_sc: int, num_devices: int) -> tuple[int, int]:
    """Largest (ids, unique ids) per partition over all devices, from a limit-free tpurec call."""
    bdev = len(batch) // num_devices
    ids = uniq = 1
    for d in range(num_devices):
        _, st = jo.tpurec_device(
            batch.device(d, bdev), num_sc=num_sc, num_devices=num_devices, max_ids=None, max_uniq=None
        )
        ids, uniq = max(ids, st.max_ids_per_partition), max(uniq, st.max_unique_ids_per_partition)
    return ids, uniq


def _check_cpp_stats(cpp: jo.CppResult, stats: list, num_sc: int) -> None:
    """C++ stats are per (device, global partition) = max over the device's SparseCores, and per
    (device, SparseCore) for the required buffer size; ours keep the full [num_sc, P] tables."""
    for d, st in enumerate(stats):
        np.testing.assert_array_equal(cpp.max_ids_per_partition[d], st.ids_per_partition.amax(0).numpy())
        np.testing.assert_array_equal(cpp.max_unique_ids_per_partition[d], st.unique_ids_per_partition.amax(0).numpy())
        aligned = (st.ids_per_partition + 7) // 8 * 8
        np.testing.assert_array_equal(cpp.required_buffer_sizes[d], aligned.sum(1).numpy())
        assert st.required_buffer_size_per_sc == int(cpp.required_buffer_sizes[d].max())


@pytest.mark.parametrize("num_sc,num_devices", GRID)
def test_matches_reference_and_cpp(num_sc, num_devices):
    rng = np.random.default_rng(1000 * num_sc + num_devices)
    for trial in range(6):
        bdev = num_sc * int(rng.integers(1, 7))
        vocab = int(rng.choice([8, 37, 5000]))  # tiny vocabularies force many repeats
        batch = jo.random_batch(rng, bdev * num_devices, vocab=vocab, max_bag=int(rng.integers(1, 9)))
        obs_ids, obs_uniq = _observed(batch, num_sc, num_devices)
        limits = [
            (obs_ids, obs_uniq),  # tight: some partition sits exactly at its limit
            (round_up(obs_ids, 8), round_up(obs_ids, 8)),
            (obs_ids + int(rng.integers(1, 20)), obs_ids + 64),  # unique limit above ids limit
        ]
        for max_ids, max_uniq in limits:
            cpp = jo.jte_cpp(
                batch, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq, vocab=vocab
            )
            stats = []
            for d in range(num_devices):
                dev = batch.device(d, bdev)
                ours, st = jo.tpurec_device(
                    dev, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq
                )
                ref = jo.jax_reference(dev, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq)
                ctx = f"trial {trial} device {d} limits {(max_ids, max_uniq)}"
                try:
                    jo.assert_same_as_reference(ours, ref)
                    jo.assert_same_as_cpp(ours, cpp.per_device[d])
                except AssertionError as e:
                    raise AssertionError(f"{ctx}: {e}") from None
                assert st.dropped_id_count == 0 and cpp.dropped_id_count == 0
                stats.append(st)
            _check_cpp_stats(cpp, stats, num_sc)


@pytest.mark.parametrize("num_sc,num_devices,weights", [(1, 1, "ones"), (2, 1, "float"), (1, 2, "dyadic")])
def test_long_segments(num_sc, num_devices, weights):
    """Segments of hundreds of entries (tpurec copies them as slices instead of scattering)."""
    rng = np.random.default_rng(17 + num_sc)
    bdev = 64 * num_sc
    batch = jo.random_batch(rng, bdev * num_devices, vocab=3000, max_bag=40, p_empty=0.05, weights=weights)
    max_ids, max_uniq = _observed(batch, num_sc, num_devices)
    from tpurec.embedding import preprocess as pp

    for d in range(num_devices):  # long enough for the slice path: >= _SLICE_COPY_MIN per segment
        _, st = jo.tpurec_device(
            batch.device(d, bdev), num_sc=num_sc, num_devices=num_devices, max_ids=None, max_uniq=None
        )
        assert int(st.ids_per_partition.sum()) >= pp._SLICE_COPY_MIN * st.ids_per_partition.numel()
    cpp = jo.jte_cpp(batch, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq, vocab=3000)
    for d in range(num_devices):
        dev = batch.device(d, bdev)
        ours, _ = jo.tpurec_device(dev, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq)
        ref = jo.jax_reference(dev, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq)
        rtol = 1e-5 if weights == "float" else 0.0
        jo.assert_same_as_reference(ours, ref, gains_rtol=rtol)
        jo.assert_same_as_cpp(ours, cpp.per_device[d], gains_rtol=rtol)


@pytest.mark.parametrize("num_sc,num_devices", [(1, 1), (2, 2), (4, 1), (4, 4)])
def test_float_weights(num_sc, num_devices):
    """Arbitrary float32 weights: gains agree to float32 rounding (summation order may differ)."""
    rng = np.random.default_rng(7 + num_sc)
    bdev = 8 * num_sc
    batch = jo.random_batch(rng, bdev * num_devices, vocab=30, max_bag=10, weights="float")
    max_ids, max_uniq = _observed(batch, num_sc, num_devices)
    cpp = jo.jte_cpp(batch, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq, vocab=30)
    for d in range(num_devices):
        dev = batch.device(d, bdev)
        ours, _ = jo.tpurec_device(dev, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq)
        ref = jo.jax_reference(dev, num_sc=num_sc, num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq)
        jo.assert_same_as_reference(ours, ref, gains_rtol=1e-5)
        jo.assert_same_as_cpp(ours, cpp.per_device[d], gains_rtol=1e-5)


def test_worked_example():
    """The docs' example: 8 samples with ids 0..7, 1 device, 2 SparseCores (P = 2), max_ids 16."""
    batch = jo.RaggedBatch([np.array([i], np.int32) for i in range(8)], [np.ones(1, np.float32)] * 8)
    ours, st = jo.tpurec_device(batch, num_sc=2, num_devices=1, max_ids=16, max_uniq=16)
    rp = [2, 10, 16, 16, 16, 16, 16, 16]
    assert ours.row_pointers.tolist() == rp + rp
    pad = [jo.PADDING_ID] * 6
    # SC 0 holds samples 0-3: partition 0 gets rows 0, 2 (local ids 0, 1), partition 1 rows 1, 3.
    assert ours.embedding_ids[:16].tolist() == [0, 1] + pad + [0, 1] + pad
    assert ours.sample_ids[:16].tolist() == [0, 2] + pad + [1, 3] + pad
    # Each SC owns round_up(16, 8) x P = 32 slots; the unused half is padding.
    assert ours.embedding_ids[16:32].tolist() == [jo.PADDING_ID] * 16 and ours.embedding_ids.numel() == 64
    assert ours.embedding_ids[32:48].tolist() == [2, 3] + pad + [2, 3] + pad  # SC 1: samples 4-7
    assert st.required_buffer_size_per_sc == 16
    jo.assert_same_as_reference(ours, jo.jax_reference(batch, num_sc=2, num_devices=1, max_ids=16, max_uniq=16))


# ------------------------------------------------------------------------------------- limits
def _hot_batch():
    """4 samples, 1 SparseCore, P = 2: partition 0 gets (id, sample) (2,0) (2,1) (4,1) (6,2) (8,3)."""
    ids = [[2, 2, 3], [2, 4], [6], [8]]
    return jo.RaggedBatch([np.array(x, np.int32) for x in ids], [np.ones(len(x), np.float32) for x in ids])


def test_max_ids_exceeded_raises():
    batch = _hot_batch()
    with pytest.raises(IdLimitExceededError) as e:
        jo.tpurec_device(batch, num_sc=1, num_devices=2, max_ids=4, max_uniq=64, table_name="clicks")
    msg = str(e.value)
    assert "'clicks'" in msg and "partition 0 of 2" in msg and "5 ids > max_ids_per_partition=4" in msg
    with pytest.raises(ValueError, match="too many ids. 5 > 4"):
        jo.jax_reference(batch, num_sc=1, num_devices=2, max_ids=4, max_uniq=64)


def test_max_unique_exceeded_raises():
    batch = _hot_batch()
    with pytest.raises(IdLimitExceededError) as e:
        jo.tpurec_device(batch, num_sc=1, num_devices=2, max_ids=8, max_uniq=3, table_name="clicks")
    msg = str(e.value)
    assert "'clicks'" in msg and "partition 0 of 2" in msg and "4 unique ids > max_unique_ids_per_partition=3" in msg
    with pytest.raises(ValueError, match="too many unique ids. 4 > 3"):
        jo.jax_reference(batch, num_sc=1, num_devices=2, max_ids=8, max_uniq=3)


def test_limit_error_names_the_sparsecore():
    """Partition 1 of SparseCore 1 overflows; the message says which samples that SC holds."""
    ids = [[0], [0], [1, 3], [5, 7, 9]]
    batch = jo.RaggedBatch([np.array(x, np.int32) for x in ids], [np.ones(len(x), np.float32) for x in ids])
    with pytest.raises(
        IdLimitExceededError,
        match=r"partition 1 of 2 .* SparseCore 1 of 2 \(samples 2-3 .*5 ids > max_ids_per_partition=4",
    ):
        jo.tpurec_device(batch, num_sc=2, num_devices=1, max_ids=4, max_uniq=8)


@pytest.mark.parametrize("num_sc,num_devices", [(1, 1), (2, 1), (1, 4), (4, 2), (2, 4)])
def test_dropping_matches_cpp(num_sc, num_devices):
    """allow_id_dropping: both keep, per (SC, partition), the first max_ids merged (id, sample)
    entries among the first max_unique distinct ids. Counting differs: tpurec counts dropped merged
    entries, the C++ path dropped input ids (a merged entry of k duplicates counts k)."""
    rng = np.random.default_rng(50 + 10 * num_sc + num_devices)
    parts = num_sc * num_devices
    for trial in range(5):
        bdev = num_sc * int(rng.integers(2, 9))
        batch = jo.random_batch(rng, bdev * num_devices, vocab=int(rng.choice([16, 200])), max_bag=8, p_hot=0.6)
        obs_ids, obs_uniq = _observed(batch, num_sc, num_devices)
        for max_ids, max_uniq in [
            (max(1, obs_ids // 2), 10_000),
            (obs_ids, max(1, obs_uniq // 2)),
            (max(1, obs_ids - 3), max(1, obs_uniq - 2)),
        ]:
            cpp = jo.jte_cpp(
                batch,
                num_sc=num_sc,
                num_devices=num_devices,
                max_ids=max_ids,
                max_uniq=max_uniq,
                vocab=200,
                allow_id_dropping=True,
            )
            merged_dropped = raw_dropped = 0
            stats = []
            for d in range(num_devices):
                dev = batch.device(d, bdev)
                ours, st = jo.tpurec_device(
                    dev,
                    num_sc=num_sc,
                    num_devices=num_devices,
                    max_ids=max_ids,
                    max_uniq=max_uniq,
                    allow_id_dropping=True,
                )
                try:
                    jo.assert_same_as_cpp(ours, cpp.per_device[d])
                except AssertionError as e:
                    raise AssertionError(f"trial {trial} device {d} limits {(max_ids, max_uniq)}: {e}") from None
                # What was kept, read back from our buffers, against the plain-Python merge.
                entries = jo.merged_entries(dev, num_sc=num_sc, parts=parts)
                kept = _kept_keys(ours, parts)
                assert kept <= set(entries)
                merged_dropped += len(entries) - len(kept)
                raw_dropped += sum(n for k, (_, n) in entries.items() if k not in kept)
                assert st.dropped_id_count == len(entries) - len(kept)
                stats.append(st)
            assert cpp.dropped_id_count == raw_dropped, (cpp.dropped_id_count, raw_dropped, merged_dropped)
            assert merged_dropped > 0
            _check_cpp_stats(cpp, stats, num_sc)  # stats describe the demand before dropping


def _kept_keys(csr, parts: int) -> set[tuple[int, int, int, int]]:
    rp = csr.row_pointers.view(csr.num_sc_per_device, -1)
    slots = csr.embedding_ids.numel() // csr.num_sc_per_device
    keys = set()
    for s in range(csr.num_sc_per_device):
        begin = 0
        for p in range(parts):
            end = int(rp[s, p])
            for j in range(s * slots + begin, s * slots + end):
                keys.add((s, p, int(csr.embedding_ids[j]), int(csr.sample_ids[j])))
            begin = round_up(end, 8)
    return keys


def test_dropping_keeps_first_entries_exactly():
    """The policy on a hand-checked case (P = 1): sorted merged entries (1,0) (1,1) (1,2) (3,0)
    (3,1) (3,3)x2 (5,0) (7,1) (9,2) (11,3); max_ids 5, max_unique 3 keeps the first five."""
    ids = [[5, 3, 1], [3, 7, 1], [9, 1], [11, 3, 3]]
    batch = jo.RaggedBatch([np.array(x, np.int32) for x in ids], [np.ones(len(x), np.float32) for x in ids])
    ours, st = jo.tpurec_device(batch, num_sc=1, num_devices=1, max_ids=5, max_uniq=3, allow_id_dropping=True)
    assert ours.row_pointers.tolist() == [5] + [8] * 7
    assert ours.embedding_ids[:5].tolist() == [1, 1, 1, 3, 3]
    assert ours.sample_ids[:5].tolist() == [0, 1, 2, 0, 1]
    assert st.dropped_id_count == 5  # merged entries; the C++ path reports 6 (3 twice in sample 3)
    assert st.max_ids_per_partition == 10 and st.max_unique_ids_per_partition == 6
    cpp = jo.jte_cpp(batch, num_sc=1, num_devices=1, max_ids=5, max_uniq=3, vocab=16, allow_id_dropping=True)
    assert cpp.dropped_id_count == 6
    jo.assert_same_as_cpp(ours, cpp.per_device[0])


def test_dropping_is_deterministic_and_bitwise_stable():
    rng = np.random.default_rng(3)
    batch = jo.random_batch(rng, 64, vocab=40, max_bag=12, weights="float")
    a, sa = jo.tpurec_device(batch, num_sc=4, num_devices=2, max_ids=3, max_uniq=2, allow_id_dropping=True)
    b, sb = jo.tpurec_device(batch, num_sc=4, num_devices=2, max_ids=3, max_uniq=2, allow_id_dropping=True)
    for name in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
        assert torch.equal(getattr(a, name).view(torch.int32), getattr(b, name).view(torch.int32))
    assert sa.dropped_id_count == sb.dropped_id_count > 0


# ------------------------------------------------------------------------ preprocess_tables
def _bitwise_equal(a, b) -> None:
    for name in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), name
    assert (a.max_ids_per_partition, a.max_unique_ids_per_partition) == (
        b.max_ids_per_partition,
        b.max_unique_ids_per_partition,
    )


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_preprocess_tables_equals_per_table(num_threads):
    """Several tables in one call (shared sort, thread groups) = one `preprocess` call per table,
    bit for bit, with per-table limits, float and uniform gains, dropping and stats."""
    rng = np.random.default_rng(90 + num_threads)
    for _ in range(8):
        num_sc, num_devices = int(rng.choice([1, 2, 4])), int(rng.choice([1, 3]))
        bdev = num_sc * int(rng.integers(1, 9))
        batches = [
            jo.random_batch(
                rng,
                bdev,
                vocab=int(rng.choice([5, 300, 70_000])),
                max_bag=int(rng.integers(1, 12)),
                weights=str(rng.choice(["ones", "float"])),
            )
            for _ in range(int(rng.integers(1, 9)))
        ]
        limits = [
            (None, None) if rng.random() < 0.3 else (int(rng.integers(1, 12)), int(rng.integers(1, 12)))
            for _ in batches
        ]
        kw = dict(
            device_batch_size=bdev, num_sc_per_device=num_sc, global_device_count=num_devices, allow_id_dropping=True
        )
        got = preprocess_tables(
            [b.flat() for b in batches],
            max_ids_per_partition=[m for m, _ in limits],
            max_unique_ids_per_partition=[u for _, u in limits],
            num_threads=num_threads,
            **kw,
        )
        for b, (mi, mu), (csr, st) in zip(batches, limits, got):
            ref, ref_st = preprocess(*b.flat(), max_ids_per_partition=mi, max_unique_ids_per_partition=mu, **kw)
            _bitwise_equal(csr, ref)
            assert torch.equal(st.ids_per_partition, ref_st.ids_per_partition)
            assert torch.equal(st.unique_ids_per_partition, ref_st.unique_ids_per_partition)
            assert (st.required_buffer_size_per_sc, st.dropped_id_count) == (
                ref_st.required_buffer_size_per_sc,
                ref_st.dropped_id_count,
            )


def test_preprocess_tables_error_names_the_first_failing_table():
    ok = jo.RaggedBatch([np.array([1], np.int32)] * 4, [np.ones(1, np.float32)] * 4)
    bad = jo.RaggedBatch([np.array([0, 2, 4], np.int32)] * 4, [np.ones(3, np.float32)] * 4)
    with pytest.raises(
        IdLimitExceededError, match=r"table 'second', partition 0 of 2 .*12 ids > max_ids_per_partition=8"
    ):
        preprocess_tables(
            [ok.flat(), bad.flat(), bad.flat()],
            device_batch_size=4,
            num_sc_per_device=1,
            global_device_count=2,
            max_ids_per_partition=8,
            table_names=["first", "second", "third"],
            num_threads=2,
        )


def test_results_do_not_alias_scratch_buffers():
    """Outputs stay intact across later calls (the scratch arrays are reused between calls)."""
    rng = np.random.default_rng(5)
    a = jo.random_batch(rng, 32, vocab=100, weights="float")
    first, _ = jo.tpurec_device(a, num_sc=2, num_devices=1, max_ids=64, max_uniq=64)
    snapshot = [t.clone() for t in (first.row_pointers, first.embedding_ids, first.sample_ids, first.gains)]
    for _ in range(3):
        jo.tpurec_device(
            jo.random_batch(rng, 32, vocab=100, weights="float"), num_sc=2, num_devices=1, max_ids=64, max_uniq=64
        )
    for before, now in zip(snapshot, (first.row_pointers, first.embedding_ids, first.sample_ids, first.gains)):
        assert torch.equal(before.view(torch.int32), now.view(torch.int32))


# ------------------------------------------------------------------------- in fresh processes
def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_reference_real_mesh_subprocess():
    """With a real 4-device CPU mesh the reference agrees with tpurec too (the in-process tests may
    use a stand-in mesh: the reference only reads len(mesh.devices))."""
    code = f"""
        import sys, numpy as np, jax
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import jte_oracle as jo
        assert len(jax.devices()) == 4
        assert isinstance(jo.reference_mesh(4), jax.sharding.Mesh)
        rng = np.random.default_rng(11)
        batch = jo.random_batch(rng, 16, vocab=50)
        ours, _ = jo.tpurec_device(batch, num_sc=2, num_devices=4, max_ids=32, max_uniq=32)
        jo.assert_same_as_reference(ours, jo.jax_reference(batch, num_sc=2, num_devices=4, max_ids=32, max_uniq=32))
        print("ok")
    """
    r = _python(code, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_cpp_aborts_over_limit_without_dropping():
    """Documented difference: over a limit the C++ path kills the process (absl CHECK), where
    tpurec raises IdLimitExceededError and the reference raises ValueError."""
    code = f"""
        import sys, numpy as np
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import jte_oracle as jo
        batch = jo.RaggedBatch([np.array([1, 2, 3], np.int32)] * 4, [np.ones(3, np.float32)] * 4)
        jo.jte_cpp(batch, num_sc=1, num_devices=1, max_ids=4, max_uniq=64, vocab=8)
        print("survived")
    """
    r = _python(code)
    assert r.returncode != 0 and "survived" not in r.stdout
    assert "greater than the set max ids per partition" in r.stderr
