"""A stand-in for TorchTPU 0.2.0's SparseCore ops, so the real TPU adapter runs on CPU (tests, and
every rank of `tpurec train --emulate-tpu`).

The meta-tensor schema check (tests/embedding/test_tpu_schema.py, in a venv with torch-tpu) proves
that the adapter's calls bind to TorchTPU's schemas; it cannot say whether each argument means what
TorchTPU takes it to mean. This module defines a `tpu` op namespace with TorchTPU 0.2.0's exact
schemas (docs/tpu_schema_check.md, read from the wheel) whose CPU kernels compute what the SparseCore
kernels compute, using tpurec's CPU reference, with TorchTPU's conventions where they differ from
tpurec's own ops:

* no SparseCore count in any schema: the kernels use the stand-in's "hardware" count (`sparsecores`),
  as TorchTPU's compiled kernel uses the chip's;
* the update ops return new tables/state (they do not write in place);
* learning rates and Adam's alpha_t are tensors (runtime values), while float hyper-parameters, the
  id limits and `computation_name` are compile-time constants: every call's tensor shapes/dtypes and
  non-tensor arguments form its compile key, recorded in `StandIn.calls`, so a test can count the
  programs a training run would compile;
* a partition holding more ids than `max_ids_per_partition` is an error (the kernel's buffers are
  sized by it);
* `preprocess_sparse_dense_matmul_input` reads `suggested_coo_buffer_size` as the COO entries of the
  whole device, split evenly over its SparseCores (TorchTPU computes it with jax-tpu-embedding's
  `ComputeCooBufferSizePerDevice`, docs/tpu.md); 0 means a 128-entry buffer, and what does not fit is
  dropped silently (docs/tpu.md);
* tables and optimizer state must be float32: TorchTPU's op builders type the lookup's output and the
  update functions f32, and jax-tpu-embedding refuses other tables for the same SparseCore call
  (docs/tpu.md). TorchTPU itself has no such check (what a non-f32 table does on the chip is
  unknown), so the stand-in refuses, and tpurec must never send one.

Only the emulation (`tpurec.emulation`) and tests import this, and only in processes that never load
the real torch_tpu (`install()` refuses where it is loaded).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tpurec.embedding import reference
from tpurec.embedding.constraints import PADDING_ID, SEGMENT_ALIGN, round_up
from tpurec.embedding.optimizers import adagrad, adam, sgd

# TorchTPU 0.2.0's schemas, verbatim (namespace `tpu`).
SCHEMAS = {
    "_sparse_dense_matmul": "(Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains, "
    "Tensor embedding_table, int device_batch_size, int max_ids_per_partition, int max_unique_ids_per_partition) "
    "-> Tensor",
    "_sparse_dense_matmul_grad_with_sgd": "(Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
    "Tensor gains, Tensor embedding_table, Tensor activations_grad, Tensor learning_rate, int device_batch_size, "
    "int max_ids_per_partition, int max_unique_ids_per_partition, str computation_name) -> Tensor",
    "_sparse_dense_matmul_grad_with_adagrad": "(Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
    "Tensor gains, Tensor embedding_table, Tensor accumulator, Tensor activations_grad, Tensor learning_rate, "
    "float epsilon, int device_batch_size, int max_ids_per_partition, int max_unique_ids_per_partition, "
    "str computation_name) -> (Tensor, Tensor)",
    "_sparse_dense_matmul_grad_with_adam": "(Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, "
    "Tensor gains, Tensor embedding_table, Tensor momentum, Tensor velocity, Tensor activations_grad, "
    "Tensor alpha_t, float beta_1, float beta_2, float epsilon, int device_batch_size, int max_ids_per_partition, "
    "int max_unique_ids_per_partition, str computation_name) -> (Tensor, Tensor, Tensor)",
    "preprocess_sparse_dense_matmul_input": "(Tensor input_indices, Tensor input_offsets, int max_ids_per_partition, "
    "int max_unique_ids_per_partition, int suggested_coo_buffer_size, int batch_size, str combiner, "
    "int local_device_count, int global_device_count, int num_sc_per_device, bool allow_id_dropping, "
    "str table_name) -> Dict(str, Tensor)",
}
DEFAULT_COO_BUFFER = 128  # what TorchTPU uses (per device) when suggested_coo_buffer_size is 0


def _key_part(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return value


@dataclass
class StandIn:
    sparsecores: int = 4  # the "chip's" SparseCores per device
    calls: list = field(default_factory=list)  # (op name, compile key)

    def record(self, op: str, args: tuple) -> None:
        self.calls.append((op, tuple(_key_part(a) for a in args)))

    def compile_keys(self, op_prefix: str = "_sparse_dense_matmul") -> Counter:
        """How often each distinct (op, key) was called: its length is the number of programs compiled."""
        return Counter(c for c in self.calls if c[0].startswith(op_prefix))

    def reset(self) -> None:
        self.calls.clear()


_STATE: StandIn | None = None


def _state() -> StandIn:
    assert _STATE is not None, "the TorchTPU stand-in ops run only once installed"
    return _STATE


_LIB = None


def install(sparsecores: int = 4) -> StandIn:
    """Define torch.ops.tpu.* (once per process) and set the hardware SparseCore count; returns the recorder."""
    global _STATE, _LIB
    if _STATE is None:
        if "torch_tpu" in sys.modules:
            raise RuntimeError("the TorchTPU stand-in cannot be installed where the real torch_tpu is loaded")
        _STATE = StandIn(sparsecores)
        _LIB = torch.library.Library("tpu", "DEF")
        for name, schema in SCHEMAS.items():
            _LIB.define(name + schema)
            _LIB.impl(name, _KERNELS[name], "CPU")
    _STATE.sparsecores = sparsecores
    _STATE.reset()
    return _STATE


def _decode(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, max_ids_per_partition):
    if table.dtype != torch.float32:
        raise RuntimeError(f"stand-in: embedding_table must be float32 (TorchTPU's SparseCore ops), got {table.dtype}")
    num_sc = parts = _state().sparsecores  # one device's shard: its rows MOD-partitioned over its SparseCores
    if table.shape[0] % parts:
        raise RuntimeError(f"stand-in: table rows {table.shape[0]} are not a multiple of {parts} partitions")
    ends = row_pointers.view(num_sc, -1)[:, :parts].to(torch.int64)
    # Segments start on 8-aligned offsets: each one's ids run from the previous end, rounded up, to its end.
    starts = torch.cat([torch.zeros(num_sc, 1, dtype=torch.int64), ends[:, :-1]], dim=1)
    seg_len = ends - (starts + SEGMENT_ALIGN - 1) // SEGMENT_ALIGN * SEGMENT_ALIGN
    if int(seg_len.max()) > round_up(max_ids_per_partition, SEGMENT_ALIGN):
        raise RuntimeError(
            f"stand-in: a partition holds {int(seg_len.max())} ids, more than "
            f"max_ids_per_partition={max_ids_per_partition} (the kernel's buffer)"
        )
    return reference.decode(
        row_pointers, embedding_ids, sample_ids, gains, table.shape[0] // parts, device_batch_size, num_sc, parts
    )


def _lookup(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, max_ids, max_uniq):
    _state().record(
        "_sparse_dense_matmul",
        (row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, max_ids, max_uniq),
    )
    d = _decode(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, max_ids)
    return reference.lookup(d, table, device_batch_size)


def _sgd(rp, ids, samples, gains, table, grad, lr, batch, max_ids, max_uniq, name):
    _state().record(
        "_sparse_dense_matmul_grad_with_sgd", (rp, ids, samples, gains, table, grad, lr, batch, max_ids, max_uniq, name)
    )
    rows, g = reference.row_gradients(_decode(rp, ids, samples, gains, table, batch, max_ids), grad)
    new = table.clone()
    sgd.reference_update(new, rows, g, float(lr))
    return new


def _adagrad(rp, ids, samples, gains, table, acc, grad, lr, eps, batch, max_ids, max_uniq, name):
    _state().record(
        "_sparse_dense_matmul_grad_with_adagrad",
        (rp, ids, samples, gains, table, acc, grad, lr, eps, batch, max_ids, max_uniq, name),
    )
    rows, g = reference.row_gradients(_decode(rp, ids, samples, gains, table, batch, max_ids), grad)
    new, new_acc = table.clone(), acc.clone()
    adagrad.reference_update(new, new_acc, rows, g, float(lr), eps)
    return new, new_acc


def _adam(rp, ids, samples, gains, table, m, v, grad, alpha_t, b1, b2, eps, batch, max_ids, max_uniq, name):
    _state().record(
        "_sparse_dense_matmul_grad_with_adam",
        (rp, ids, samples, gains, table, m, v, grad, alpha_t, b1, b2, eps, batch, max_ids, max_uniq, name),
    )
    rows, g = reference.row_gradients(_decode(rp, ids, samples, gains, table, batch, max_ids), grad)
    new, new_m, new_v = table.clone(), m.clone(), v.clone()
    adam.reference_update(new, new_m, new_v, rows, g, float(alpha_t), b1, b2, eps)
    return new, new_m, new_v


def _preprocess(*args):
    """TorchTPU's host preprocessing, as far as tests need it: tpurec's preprocessing of the same ids,
    with TorchTPU's COO buffer (128 entries when the suggestion is 0) and its silent truncation.
    Arguments: SCHEMAS["preprocess_sparse_dense_matmul_input"]'s, in order."""
    from tpurec.embedding.preprocess import preprocess

    _state().record("preprocess_sparse_dense_matmul_input", args)
    (indices, offsets, max_ids, max_uniq, suggested_coo, batch_size, combiner, _, _, num_sc, allow_dropping, _) = args
    lengths = torch.diff(offsets.long())
    samples = torch.repeat_interleave(torch.arange(batch_size), lengths)
    gains = {
        "sum": torch.ones(indices.numel()),
        "mean": 1.0 / lengths.clamp(min=1).float()[samples],
        "sqrtn": lengths.clamp(min=1).float().rsqrt()[samples],
    }[combiner]
    csr, stats = preprocess(
        indices.long(),
        samples,
        gains,
        device_batch_size=batch_size,
        num_sc_per_device=num_sc,
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_uniq,
        allow_id_dropping=allow_dropping,
    )
    buffer = (suggested_coo or DEFAULT_COO_BUFFER) // num_sc  # per device, split over its SparseCores
    per_sc = csr.embedding_ids.numel() // num_sc
    rp = csr.row_pointers.view(num_sc, -1)
    # Ids (not padding slots) past each SparseCore's share of the buffer are lost.
    dropped = stats.dropped_id_count + sum(
        int((csr.embedding_ids[sc * per_sc + buffer : sc * per_sc + int(rp[sc, -1])] != PADDING_ID).sum())
        for sc in range(num_sc)
    )
    out = {
        k: torch.full((num_sc * buffer,), fill, dtype=dtype)
        for k, fill, dtype in (
            ("embedding_ids", PADDING_ID, torch.int32),
            ("sample_ids", PADDING_ID, torch.int32),
            ("gains", float("nan"), torch.float32),
        )
    }
    for sc in range(num_sc):
        n = min(int(rp[sc, -1]), buffer)
        for key in ("embedding_ids", "sample_ids", "gains"):
            out[key][sc * buffer : sc * buffer + n] = getattr(csr, key)[sc * per_sc : sc * per_sc + n]
    out["row_pointers"] = torch.clamp(rp, max=buffer).flatten().to(torch.int32)
    out["dropped_id_count"] = torch.tensor([dropped], dtype=torch.int32)
    return out


_KERNELS = {
    "_sparse_dense_matmul": _lookup,
    "_sparse_dense_matmul_grad_with_sgd": _sgd,
    "_sparse_dense_matmul_grad_with_adagrad": _adagrad,
    "_sparse_dense_matmul_grad_with_adam": _adam,
    "preprocess_sparse_dense_matmul_input": _preprocess,
}


def route_adapter_to_cpu() -> dict:
    """Make the real SparseCore adapter's kernels (`tpurec.embedding.tpu.sparsecore_kernels()`) the CPU kernels of
    torch.ops.tpurec.*, so CPU tensors go adapter -> stand-in ops; returns the kernels replaced.
    Needs `install()` first (the adapter calls torch.ops.tpu.*)."""
    from tpurec.embedding import tpu

    saved = {}
    for op, kernel in tpu.sparsecore_kernels().items():
        saved[op] = op._backend_fns.get("cpu")
        op.register_kernel("cpu")(kernel)
    return saved


@contextlib.contextmanager
def adapter_on_cpu() -> Iterator[StandIn | None]:
    """`route_adapter_to_cpu()` for the duration of a `with` block."""
    saved = route_adapter_to_cpu()
    try:
        yield _STATE
    finally:
        for op, fn in saved.items():
            # Put the saved kernel back as it was: register_kernel would wrap it once more, and
            # `ops.reference_is_cpu_kernel` (so the direct CPU step) tells the reference by identity.
            if fn is not None:
                op._backend_fns["cpu"] = fn
