"""The step-time split of `tpurec bench tpu-train` (contender "split"), one process per round.

`python -m tpurec.bench.tpu_train_split WORKLOAD_JSON --warmup W --steps T --batches K --device D`
prints one JSON line. It runs tpurec's pieces of the DLRM-DCNv2 step one after another with the device
drained after each (a value read to the host), so that each piece's time is its own:
- `host_ms`: the host input half, in two parts: `host_build_ms` (ids into one CSR input per table
  stack, `KernelInput.preprocess_on_host`) and `host_copy_ms` (those inputs, the dense features and
  the labels to the device, `KernelInput.to_device`, drained);
- `lookup_ms`: the pooled lookup of every stack (`kernel.lookup`);
- `dense_ms`: the dense model's forward and backward (TorchRec's DLRM_DCN arches) down to the pooled
  embeddings' gradient;
- `update_ms`: the tables' fused row-wise Adagrad update (the lookup's backward);
- `dense_update_ms`: the dense Adagrad step.
Then the same step with no drain inside (`step_ms`, a loss read at the end of the T steps only), so
`sum_ms - step_ms` is what the device and the host overlap, and `device_busy_at_most` (the device
pieces' sum over `step_ms`) bounds the share of the step the chip is busy. Batches: the first K batches of the synthetic
data `tpurec train`'s side reads (tpu_train_jax.host_batches), cycled. The embedding module is tpurec's
own (SparseCoreEmbeddingBagCollection with fixed id limits, as DistributedModelParallel builds at one
rank); TorchRec's sharding, the trainer and its input pipeline are not in these figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from tpurec.bench.tpu_train_shapes import Workload

PHASES = ("host_ms", "lookup_ms", "dense_ms", "update_ms", "dense_update_ms")
# The dense arches as torch.compile programs on a TPU, as `tpurec train` runs them there by default (its
# dense_compiled); TPUREC_SPLIT_COMPILE_DENSE=0 keeps them eager there, =1 compiles them on a CPU too
COMPILE_DENSE_ENV = "TPUREC_SPLIT_COMPILE_DENSE"
HOST_PARTS = ("host_build_ms", "host_copy_ms")  # host_ms's two parts: the CSR build, the copies to the device


def _drain(t: Any) -> None:
    """Wait for the device: one element of `t` read to the host (the last op that wrote it is done)."""
    t.reshape(-1)[:1].cpu()


def build(w: Workload, device: Any) -> tuple[Any, Any, Any]:
    """(tpurec's embedding module, the dense arches as one callable module, the dense optimizer)."""
    import torch
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=w.dim, num_embeddings=r, feature_names=[f"C{i + 1}"])
        for i, r in enumerate(w.rows)
    ]
    torch.manual_seed(w.seed)
    ebc = SparseCoreEmbeddingBagCollection(
        tables, RowWiseAdagrad, {"lr": w.embedding_lr, "eps": w.eps}, device=device, fixed_limits=True
    )
    model = DLRM_DCN(
        EmbeddingBagCollection(tables, device=torch.device("meta")),
        dense_in_features=w.num_dense,
        dense_arch_layer_sizes=list(w.dense_arch),
        over_arch_layer_sizes=list(w.over_arch),
        dcn_num_layers=w.dcn_layers,
        dcn_low_rank_dim=w.dcn_rank,
        dense_device=torch.device("cpu"),
    )
    dense = torch.nn.ModuleDict({"dense": model.dense_arch, "inter": model.inter_arch, "over": model.over_arch})
    dense = dense.to(device)
    on_tpu = str(device).startswith("tpu")
    opt = torch.optim.Adagrad(dense.parameters(), lr=w.dense_lr, eps=w.eps)
    if os.environ.get(COMPILE_DENSE_ENV, "1" if on_tpu else "0") == "1":  # arches and update, as tpurec train's
        from tpurec.dlrm.training.dense_compile import compile_dense
        from tpurec.dlrm.training.dense_update_compile import compile_dense_update

        compile_dense(dense, "tpu" if on_tpu else "cpu")
        compile_dense_update(opt, dense, "tpu" if on_tpu else "cpu")
    return ebc, dense, opt


def _kjt(w: Workload, batch: dict[str, Any]) -> Any:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values = torch.cat([torch.from_numpy(ids).to(torch.int64) for ids in batch["ids"]])
    lengths = torch.cat([torch.full((w.batch,), h, dtype=torch.int32) for h in w.hots])
    return KeyedJaggedTensor([f"C{i + 1}" for i in range(len(w.rows))], values, lengths=lengths)


class Step:
    """One training step in its pieces (each a method), on batch i of the cycled batches."""

    def __init__(self, w: Workload, batches: list[dict[str, Any]], device: Any) -> None:
        import torch

        self.w, self.device = w, device
        self.ebc, self.dense, self.opt = build(w, device)
        self.kjts = [_kjt(w, b) for b in batches]  # the KJTs are the data loader's work, not timed
        self.host = [(torch.from_numpy(b["dense"]), torch.from_numpy(b["labels"])) for b in batches]
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def inputs(self, i: int) -> tuple[Any, Any, Any]:
        return self.copy(i, self.build(i))

    def build(self, i: int) -> Any:
        """The batch's CSR inputs on the host (the ids' preprocessing alone)."""
        return self.ebc.kernel.inputs.preprocess_on_host(self.kjts[i % len(self.kjts)])

    def copy(self, i: int, csrs: Any) -> tuple[Any, Any, Any]:
        """Those inputs, the dense features and the labels on the device."""
        dense, labels = (t.to(self.device) for t in self.host[i % len(self.kjts)])
        return self.ebc.kernel.inputs.to_device(csrs), dense, labels

    def lookup(self, csrs: Any) -> Any:
        return self.ebc.kernel.lookup(csrs, self.w.batch)

    def dense_step(self, pooled: Any, dense: Any, labels: Any) -> tuple[Any, Any]:
        """(the loss, the pooled embeddings' gradient): the dense forward and backward."""
        emb = pooled.detach().requires_grad_()
        x = self.dense["dense"](dense)
        z = self.dense["inter"](dense_features=x, sparse_features=emb.view(self.w.batch, len(self.w.rows), self.w.dim))
        loss = self.loss_fn(self.dense["over"](z).squeeze(-1), labels)
        loss.backward()
        return loss, emb.grad

    def dense_update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def whole(self, i: int) -> Any:
        csrs, dense, labels = self.inputs(i)
        pooled = self.lookup(csrs)
        loss, grad = self.dense_step(pooled, dense, labels)
        pooled.backward(grad)
        self.dense_update()
        return loss

    def table_state_bytes(self) -> int:
        """The stacks' stored rows and optimizer state, in bytes (what the planner counts as weights
        and state)."""
        k = self.ebc.kernel
        tensors = [t for i in range(len(k.stacks)) for t in (k.stack_weight(i), *self._states(i))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _states(self, i: int) -> list[Any]:
        return [self.ebc.kernel.stack_state(i, n) for n in self.ebc.kernel.optimizer.state_names]

    def some_table(self) -> Any:
        return self.ebc.kernel.stack_weight(0)

    def some_dense(self) -> Any:
        return next(self.dense.parameters())


def _device_bytes(device: Any) -> int | None:
    """The device allocator's bytes in use (torch.accelerator), None on the CPU or without statistics
    (docs/tpu.md: TorchTPU's peak figure is no reading; its bytes in use are compared here)."""
    import torch

    from tpurec.runtime.device import DeviceKind

    if device.type == DeviceKind.CPU:
        return None
    try:
        return int(torch.accelerator.memory_allocated())
    except Exception:  # an accelerator without statistics
        return None


def _timed(fn: Callable[[], Any], drain: Callable[[Any], None]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    drain(out)
    return out, (time.perf_counter() - t0) * 1e3


def split_step(
    s: Step, i: int, drain: Callable[[Any], None], in_use: Callable[[], int | None] = lambda: None
) -> tuple[dict[str, float], dict[str, int | None]]:
    """Step i with the device drained after each piece: each piece's milliseconds, and the device
    allocator's bytes in use after each (`in_use`; None where there is no reading): what the step holds
    beyond the tables, piece by piece (the planner's HBM figure is compared with it, issue #59)."""
    held: dict[str, int | None] = {}

    def drained(phase: str, wait: Callable[[Any], None]) -> Callable[[Any], None]:
        def then(out: Any) -> None:
            wait(out)
            held[phase] = in_use()

        return then

    host_csrs, build = _timed(lambda: s.build(i), lambda _: None)

    def drain_inputs(out: Any) -> None:  # the CSR copies (ids, gains) and the dense features'
        for t in (out[0][0].embedding_ids, out[0][0].gains, out[1]):
            drain(t)

    copied = drained("host_ms", drain_inputs)
    (csrs, dense, labels), copy = _timed(lambda: s.copy(i, host_csrs), copied)
    host = build + copy
    pooled, lookup = _timed(lambda: s.lookup(csrs), drained("lookup_ms", drain))
    step = lambda: s.dense_step(pooled, dense, labels)  # noqa: E731
    (_, grad), dense_ms = _timed(step, drained("dense_ms", lambda out: drain(out[1])))
    _, update = _timed(lambda: pooled.backward(grad), drained("update_ms", lambda _: drain(s.some_table())))
    _, dense_update = _timed(s.dense_update, drained("dense_update_ms", lambda _: drain(s.some_dense())))
    pieces = dict(zip(PHASES, (host, lookup, dense_ms, update, dense_update)))
    return {**pieces, "host_build_ms": build, "host_copy_ms": copy}, held


def run(w: Workload, batches: list[dict[str, Any]], warmup: int, steps: int, device: Any) -> dict:
    """Warm-up steps, T split steps (median of each piece), then T whole steps undrained."""
    s = Step(w, batches, device)
    in_use = lambda: _device_bytes(device)  # noqa: E731
    held: dict[str, int | None] = {"built": in_use()}
    t0 = time.perf_counter()
    for i in range(warmup):
        loss = s.whole(i)
        _drain(loss)
    first_s = time.perf_counter() - t0
    held["after_warmup"] = in_use()
    timed = [split_step(s, warmup + i, _drain, in_use) for i in range(steps)]
    splits = [t for t, _ in timed]
    if timed:  # the last split step's readings, each after its piece (keys: the pieces' names)
        held.update({f"after_{k.removesuffix('_ms')}": v for k, v in timed[-1][1].items()})
    t0 = time.perf_counter()
    for i in range(steps):
        loss = s.whole(warmup + steps + i)
    _drain(loss)
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    out: dict[str, Any] = {k: round(statistics.median(x[k] for x in splits), 3) for k in (*PHASES, *HOST_PARTS)}
    out["sum_ms"] = round(sum(out[k] for k in PHASES), 3)
    out["step_ms"] = round(step_ms, 3)
    # The device's share of the undrained step (issue #59: busy >= 80%), at most: each drained piece
    # also holds its own dispatch and the drain's round trip
    out["device_ms"] = round(sum(out[k] for k in PHASES if k != "host_ms"), 3)
    out["device_busy_at_most"] = round(out["device_ms"] / step_ms, 3) if step_ms > 0 else None
    out["samples_per_s"] = round(w.batch / step_ms * 1e3, 1)
    out["warmup_s"] = round(first_s, 3)
    out["stacks"] = len(s.ebc.kernel.stacks)
    out["table_state_bytes"] = s.table_state_bytes()
    out["device_bytes_in_use"] = _device_bytes(device)
    out["device_bytes_by_piece"] = held if any(v is not None for v in held.values()) else None
    out["loss"] = round(float(loss.detach()), 6)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from tpurec import strict_json
    from tpurec.bench.tpu_train_jax import host_batches

    p = argparse.ArgumentParser(prog="python -m tpurec.bench.tpu_train_split")
    p.add_argument("workload")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    w = Workload.from_json(a.workload)
    if a.device != "cpu":
        from tpurec.embedding.backend import load_tpu_backend

        load_tpu_backend()
    result = run(w, host_batches(w, a.batches), a.warmup, a.steps, torch.device(a.device))
    print(strict_json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
