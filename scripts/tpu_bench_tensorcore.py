"""Chip probe 3: the TensorCore kernel's torch ops on the chip at 1M x 128 (f32), ids from tpurec's preprocessing."""

import json
import os
import time

import torch

from tpurec.embedding import ops
from tpurec.embedding.backend import load_tpu_backend
from tpurec.embedding.constraints import round_up
from tpurec.embedding.optimizers import adagrad, adam, sgd
from tpurec.embedding.preprocess import preprocess
from tpurec.embedding.tensorcore import tpu_bridge

load_tpu_backend()
dev = torch.device("tpu")
R, D, B, H = 1_000_000, 128, 16_384, 8
g = torch.Generator().manual_seed(0)
N = B * H
ids = torch.randint(0, R, (N,), generator=g)
samples = torch.arange(B).repeat_interleave(H)
gains = torch.ones(N)
t0 = time.perf_counter()
csr, _ = preprocess(
    ids,
    samples,
    gains,
    device_batch_size=B,
    num_sc_per_device=1,
    global_device_count=1,
    max_ids_per_partition=round_up(N + 8, 8),
)
out = {"preprocess_s": time.perf_counter() - t0, "slots": csr.embedding_ids.numel()}
tail = (
    csr.device_batch_size,
    csr.num_sc_per_device,
    csr.num_partitions,
    csr.max_ids_per_partition,
    csr.max_unique_ids_per_partition,
)
head_cpu = (csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains)
head = tuple(t.to(dev) for t in head_cpu)
table_cpu = torch.randn(R, D, generator=g)
table = table_cpu.to(dev)


def sync(t):
    t.reshape(-1)[:1].cpu()


def tm(f, n=20):
    sync(f())
    t0 = time.perf_counter()
    for _ in range(n):
        r = f()
    sync(r)
    return (time.perf_counter() - t0) / n * 1e3


y = ops.sparse_dense_matmul(*head, table, *tail)
ref = ops.sparse_dense_matmul(*head_cpu, table_cpu, *tail)
out["lookup_max_abs_err"] = float((y.cpu() - ref).abs().max())
out["lookup_ms"] = tm(lambda: ops.sparse_dense_matmul(*head, table, *tail))
# the pooling's kernel: Pallas where JAX sees the chip's VMEM in this process, XLA's otherwise
out["vmem_capacity_seen_by_jax"] = tpu_bridge._vmem_capacity()
grad = torch.randn(B, D, generator=g).to(dev)
acc = torch.zeros(R, device=dev)
m, v = torch.zeros(R, D, device=dev), torch.zeros(R, D, device=dev)


def s():
    sgd.op(*head, table, grad, 0.01, *tail)
    return table


def a():
    adagrad.op(*head, table, acc, grad, 0.01, 1e-8, *tail)
    return table


def ad():
    adam.op(*head, table, m, v, grad, 0.001, 0.9, 0.999, 1e-8, *tail)
    return table


out["sgd_update_ms"] = tm(s)
out["rowwise_adagrad_update_ms"] = tm(a)
out["adam_update_ms"] = tm(ad)
out["rows_bytes_per_lookup"] = N * D * 4
out["lookup_GBps_rows"] = N * D * 4 / out["lookup_ms"] / 1e6
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe3_tc.json"), "w"), indent=1)
