"""Oracles for tpurec.embedding.preprocess: jax-tpu-embedding 0.1.0's two preprocessing paths.

* `jax_reference`: the pure-Python reference `lib/core/input_preprocessing.py::
  preprocess_sparse_dense_matmul_input` (one device's batch, a mesh of N devices, raises ValueError
  when a partition exceeds a limit, fills every unused slot with padding).
* `jte_cpp`: the C++ path behind `lib/nn/embedding.py::preprocess_sparse_dense_matmul_input`
  (the batch of all local devices at once; `has_leading_dimension=True` gives one row per device).
  It writes padding only up to each SparseCore's last row pointer: slots after it are uninitialised
  memory, so only `[sc * slots, sc * slots + last_row_pointer)` is compared (`cpp_defined_slots`).
  Without allow_id_dropping it aborts the whole process (absl CHECK) when a limit is exceeded.

Batches are ragged: a list of per-sample int arrays of ids and a matching list of float weights.
jax is imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import torch

from tpurec.embedding.preprocess import PreprocessStats, SparseCoreInput, preprocess

PADDING_ID = 2**31 - 1


# ---------------------------------------------------------------------------------------- batches
@dataclass
class RaggedBatch:
    ids: list[np.ndarray]  # per sample, int32
    weights: list[np.ndarray]  # per sample, float32

    def __len__(self) -> int:
        return len(self.ids)

    def slice(self, start: int, stop: int) -> RaggedBatch:
        return RaggedBatch(self.ids[start:stop], self.weights[start:stop])

    def device(self, d: int, device_batch_size: int) -> RaggedBatch:
        return self.slice(d * device_batch_size, (d + 1) * device_batch_size)

    def as_object_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The ragged layout jax-tpu-embedding's C++ path reads: 1-D object arrays of arrays."""
        feats = np.empty(len(self), dtype=object)
        weights = np.empty(len(self), dtype=object)
        for i, (f, w) in enumerate(zip(self.ids, self.weights)):
            feats[i] = np.asarray(f, dtype=np.int32)
            weights[i] = np.asarray(w, dtype=np.float32)
        return feats, weights

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, sample_index, gains) as tpurec.preprocess takes them."""
        lengths = [len(x) for x in self.ids]
        if sum(lengths):
            ids = np.concatenate(self.ids).astype(np.int64)
            gains = np.concatenate(self.weights).astype(np.float32)
        else:
            ids, gains = np.zeros(0, np.int64), np.zeros(0, np.float32)
        sample = np.repeat(np.arange(len(self.ids)), lengths)
        return torch.from_numpy(ids), torch.from_numpy(sample), torch.from_numpy(gains)


def random_batch(
    rng: np.random.Generator,
    num_samples: int,
    *,
    vocab: int,
    max_bag: int = 6,
    p_empty: float = 0.2,
    hot_ids: int = 4,
    p_hot: float = 0.4,
    weights: str = "dyadic",
) -> RaggedBatch:
    """Random ragged bags with empty bags and ids repeated within and across bags.

    A fraction p_hot of ids comes from a few hot ids, so the same id recurs inside a bag (merged
    into one entry with summed gain) and across bags. weights: "ones", "dyadic" (k/8, k in 1..16:
    every sum of them is exact in float32, so gains compare bit for bit whatever the summation
    order) or "float" (arbitrary float32; compare gains with a tolerance).
    """
    hot = rng.integers(0, vocab, hot_ids)
    ids, ws = [], []
    for _ in range(num_samples):
        n = 0 if rng.random() < p_empty else int(rng.integers(1, max_bag + 1))
        bag = np.where(rng.random(n) < p_hot, rng.choice(hot, n), rng.integers(0, vocab, n)).astype(np.int32)
        if weights == "ones":
            w = np.ones(n, np.float32)
        elif weights == "dyadic":
            w = (rng.integers(1, 17, n) / 8).astype(np.float32)
        else:
            w = rng.uniform(-2, 2, n).astype(np.float32)
        ids.append(bag)
        ws.append(w)
    return RaggedBatch(ids, ws)


# ---------------------------------------------------------------------------------------- tpurec
def tpurec_device(
    batch: RaggedBatch,
    *,
    num_sc: int,
    num_devices: int,
    max_ids: int | None,
    max_uniq: int | None,
    allow_id_dropping: bool = False,
    table_name: str = "t",
) -> tuple[SparseCoreInput, PreprocessStats]:
    """tpurec's preprocess of one device's batch."""
    ids, sample, gains = batch.flat()
    return preprocess(
        ids,
        sample,
        gains,
        device_batch_size=len(batch),
        num_sc_per_device=num_sc,
        global_device_count=num_devices,
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_uniq,
        allow_id_dropping=allow_id_dropping,
        table_name=table_name,
    )


def as_numpy(csr: SparseCoreInput) -> dict[str, np.ndarray]:
    return {
        "row_pointers": csr.row_pointers.numpy(),
        "embedding_ids": csr.embedding_ids.numpy(),
        "sample_ids": csr.sample_ids.numpy(),
        "gains": csr.gains.numpy(),
    }


# ------------------------------------------------------------------------------- jax reference
def reference_mesh(num_devices: int):
    """A mesh of num_devices for the Python reference.

    The reference reads only `len(mesh.devices)` (and `mesh.devices.item(0)` when num_sc_per_device
    is not given, which the oracle always gives). A real `jax.sharding.Mesh` is used when this
    process has enough jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=N set before
    jax starts); otherwise a stand-in exposing just `.devices`, so the test process need not force
    a device count on every other jax user. `test_reference_real_mesh_subprocess` checks that a
    real 4-device mesh gives the same answer.
    """
    import jax

    devices = jax.devices()
    if len(devices) >= num_devices:
        return jax.sharding.Mesh(np.array(devices[:num_devices]), ("x",))
    return types.SimpleNamespace(devices=np.empty(num_devices, dtype=object))


def jax_reference(
    batch: RaggedBatch, *, num_sc: int, num_devices: int, max_ids: int, max_uniq: int
) -> dict[str, np.ndarray]:
    """The Python reference for one device's batch (raises ValueError over a limit)."""
    from jax_tpu_embedding.sparsecore.lib.core import input_preprocessing

    rp, emb, smp, gains = input_preprocessing.preprocess_sparse_dense_matmul_input(
        [list(map(int, x)) for x in batch.ids],
        [list(map(float, w)) for w in batch.weights],
        reference_mesh(num_devices),
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_uniq,
        num_sc_per_device=num_sc,
    )
    return {
        "row_pointers": np.asarray(rp),
        "embedding_ids": np.asarray(emb),
        "sample_ids": np.asarray(smp),
        "gains": np.asarray(gains),
    }


# ------------------------------------------------------------------------------------ C++ path
@dataclass
class CppResult:
    per_device: list[dict[str, np.ndarray]]  # device d's row_pointers / embedding_ids / ...
    max_ids_per_partition: np.ndarray  # [num_devices, P]: max over the device's SparseCores
    max_unique_ids_per_partition: np.ndarray  # [num_devices, P]
    required_buffer_sizes: np.ndarray  # [num_devices, num_sc]: 8-aligned slots each SC needs
    dropped_id_count: int  # over all devices; counts raw input ids (before merging duplicates)


def make_feature_spec(name: str, *, vocab: int, batch: int, num_devices: int, max_ids: int, max_uniq: int):
    """A prepared (self-stacked) FeatureSpec with combiner "sum", so gains are the raw weights.

    prepare_feature_specs_for_training only accepts real chips' SparseCore counts (2 or 4), so specs
    are prepared for 4 SparseCores per device: the only effect is a padded vocabulary that is a
    multiple of 32 x num_devices, which is also a multiple of 8 x P for num_sc 1 and 2.
    """
    from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec

    table = embedding_spec.TableSpec(
        name=name,
        vocabulary_size=vocab,
        embedding_dim=8,
        initializer=lambda *a, **k: None,
        optimizer=embedding_spec.SGDOptimizerSpec(),
        combiner="sum",
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_uniq,
    )
    feature = embedding_spec.FeatureSpec(name=name, table_spec=table, input_shape=[batch, 1], output_shape=[batch, 8])
    embedding.prepare_feature_specs_for_training([feature], global_device_count=num_devices, num_sc_per_device=4)
    return feature


def cpp_preprocess(features, weights, specs, *, num_devices: int, num_sc: int, allow_id_dropping: bool):
    """The pybind call `embedding.preprocess_sparse_dense_matmul_input` makes, minus its check that
    num_sc_per_device is a real chip's (2 or 4), so num_sc=1 can be compared too."""
    from jax_tpu_embedding.sparsecore.lib.core import pybind_input_preprocessing as pip

    *csr, _num_minibatches, stats = pip.preprocess_sparse_dense_matmul_input(
        features,
        weights,
        specs,
        num_devices,
        num_devices,
        num_sc_per_device=num_sc,
        sharding_strategy=pip.ShardingStrategy.MOD,
        has_leading_dimension=True,
        allow_id_dropping=allow_id_dropping,
        batch_number=0,
        enable_minibatching=False,
        all_reduce_interface=None,
    )
    return csr, stats


def jte_cpp(
    batch: RaggedBatch,
    *,
    num_sc: int,
    num_devices: int,
    max_ids: int,
    max_uniq: int,
    vocab: int,
    allow_id_dropping: bool = False,
) -> CppResult:
    """The C++ path on the batch of all num_devices local devices (single host)."""
    spec = make_feature_spec(
        "t", vocab=vocab, batch=len(batch), num_devices=num_devices, max_ids=max_ids, max_uniq=max_uniq
    )
    feats, weights = batch.as_object_arrays()
    (rp, emb, smp, gains), stats = cpp_preprocess(
        [feats], [weights], [spec], num_devices=num_devices, num_sc=num_sc, allow_id_dropping=allow_id_dropping
    )
    per_device = [
        {"row_pointers": rp["t"][d], "embedding_ids": emb["t"][d], "sample_ids": smp["t"][d], "gains": gains["t"][d]}
        for d in range(num_devices)
    ]
    return CppResult(
        per_device,
        np.asarray(stats.max_ids_per_partition["t"]).reshape(num_devices, -1),
        np.asarray(stats.max_unique_ids_per_partition["t"]).reshape(num_devices, -1),
        np.asarray(stats.required_buffer_sizes["t"]).reshape(num_devices, num_sc),
        int(stats.dropped_id_count["t"]),
    )


# ---------------------------------------------------------------------------------- comparison
def _same(name: str, ours: np.ndarray, theirs: np.ndarray, gains_rtol: float) -> None:
    assert ours.shape == theirs.shape, f"{name}: shape {ours.shape} != {theirs.shape}"
    if name == "gains" and gains_rtol:
        np.testing.assert_allclose(ours, theirs, rtol=gains_rtol, atol=1e-6, equal_nan=True, err_msg=name)
    else:
        np.testing.assert_array_equal(ours, theirs, err_msg=name)  # NaN == NaN here


def assert_same_as_reference(ours: SparseCoreInput, theirs: dict[str, np.ndarray], gains_rtol: float = 0.0) -> None:
    """Every slot equal: row pointers, ids, samples, gains, padding (2**31-1 / NaN) and sizes."""
    o = as_numpy(ours)
    for name in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
        _same(name, o[name], theirs[name], gains_rtol)


def cpp_defined_slots(row_pointers: np.ndarray, num_sc: int, slots_per_sc: int) -> np.ndarray:
    """Boolean mask of the COO slots the C++ path writes: per SC, up to its last row pointer."""
    rp = row_pointers.reshape(num_sc, -1)
    mask = np.zeros(num_sc * slots_per_sc, dtype=bool)
    for s in range(num_sc):
        mask[s * slots_per_sc : s * slots_per_sc + int(rp[s, -1])] = True
    return mask


def assert_same_as_cpp(ours: SparseCoreInput, theirs: dict[str, np.ndarray], gains_rtol: float = 0.0) -> None:
    """Row pointers and buffer sizes equal; ids/samples/gains equal on the slots C++ defines."""
    o = as_numpy(ours)
    _same("row_pointers", o["row_pointers"], theirs["row_pointers"], 0)
    assert o["embedding_ids"].shape == theirs["embedding_ids"].shape, (
        f"COO buffer size {o['embedding_ids'].shape} != C++ {theirs['embedding_ids'].shape}"
    )
    mask = cpp_defined_slots(
        o["row_pointers"], ours.num_sc_per_device, o["embedding_ids"].size // ours.num_sc_per_device
    )
    for name in ("embedding_ids", "sample_ids", "gains"):
        _same(name, o[name][mask], theirs[name][mask], gains_rtol)


def merged_entries(
    batch: RaggedBatch, *, num_sc: int, parts: int
) -> dict[tuple[int, int, int, int], tuple[float, int]]:
    """(sc, partition, local id, sample in slice) -> (summed gain, raw occurrences), plain Python."""
    per_sc = len(batch) // num_sc
    out: dict[tuple[int, int, int, int], tuple[float, int]] = {}
    for row, (bag, ws) in enumerate(zip(batch.ids, batch.weights)):
        for i, w in zip(bag, ws):
            k = (row // per_sc, int(i) % parts, int(i) // parts, row % per_sc)
            g, n = out.get(k, (0.0, 0))
            out[k] = (g + float(w), n + 1)
    return out
