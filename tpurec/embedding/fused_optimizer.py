"""The torchrec `FusedOptimizer` view of a SparseCoreKernel's optimizer.

Updates happen inside backward, so step() and zero_grad() do nothing. What this object gives is
what TorchRec users expect of a fused optimizer: `param_groups` with a learning rate that LR
schedulers may change (the kernel reads it at every update), and a keyed `state_dict()` /
`load_state_dict()` for checkpoints. The SparseCore stores tables and state partition-major, so
state is exposed through natural-order copies, refreshed before every state_dict() and written
back after every load (`post_load_state_dict`), so nothing is lost either way.
"""
from __future__ import annotations

import torch
from torchrec.optim.fused import FusedOptimizer

from tpurec.embedding.kernel import SparseCoreKernel


class KernelStateOptimizer(FusedOptimizer):
    """A FusedOptimizer whose `state` holds natural-order copies of kernel storage.

    Subclasses set `_ready` once built and implement `_kernels_version()` (changes when the kernels
    update), `_refresh()` (kernel -> copies) and `_write_back()` (copies -> kernel). TorchRec's
    CombinedOptimizer, which DMP and the sharded EBC wrap us in, builds its state_dict from the
    children's `.state` and never calls our state_dict(), so the copies refresh on access, but only
    when the kernels moved since the last refresh: a state_dict handed to DCP shares our tensors, and
    refreshing between dcp.load and load_state_dict would overwrite what was loaded.
    """

    _ready = False

    @property
    def state(self):
        if self._ready:
            version = self._kernels_version()
            if version != getattr(self, "_refreshed_at", None):
                self._refresh()
                self._refreshed_at = version
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state = value

    def post_load_state_dict(self) -> None:
        self._write_back()
        self._refreshed_at = self._kernels_version()

    def step(self, closure=None) -> None:  # updates are fused into backward
        return None

    def zero_grad(self, set_to_none: bool = False) -> None:
        return None


class SparseCoreFusedOptimizer(KernelStateOptimizer):
    def __init__(self, kernel: SparseCoreKernel, param_prefix: str = "embedding_bags.", key_of=None) -> None:
        """key_of(kernel table name) -> "<name>.weight": how params are keyed (default: the table name)."""
        self._kernel = kernel
        key_of = key_of or (lambda name: f"{name}.weight")
        spec = kernel.optimizer
        params: dict[str, torch.Tensor] = {}
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._keys: list[tuple[str, torch.Tensor]] = []
        for t in kernel.tables:
            key = key_of(t.name)
            base = key[: -len(".weight")]
            snapshot = kernel.read_weight(t.name)
            params[param_prefix + key] = snapshot
            self._keys.append((t.name, base, snapshot))
            entry = {f"{base}.{s}": kernel.read_state(t.name, s) for s in spec.state_names}
            if spec.kind == "adam":
                entry[f"{base}.step"] = torch.tensor(0.0)
            state[snapshot] = entry
        group = {"params": list(params.values()), "lr": spec.lr}
        if spec.kind != "sgd":
            group["eps"] = spec.eps
        if spec.kind == "adam":
            group["betas"] = (spec.beta1, spec.beta2)
        super().__init__(params, state, [group])
        self._ready = True
        kernel._lr_group = group

    def _refresh(self) -> None:
        """Copy the kernel's current tables and state into the natural-order snapshots."""
        k = self._kernel
        with torch.no_grad():
            for name, base, snap in self._keys:
                snap.copy_(k.read_weight(name))
                entry = self._state[snap]
                for s in k.optimizer.state_names:
                    entry[f"{base}.{s}"].copy_(k.read_state(name, s))
                if f"{base}.step" in entry:
                    entry[f"{base}.step"].fill_(k.steps[k._locate(name)[0]])

    def _kernels_version(self) -> tuple:
        return tuple(self._kernel.steps)

    def _write_back(self) -> None:
        k = self._kernel
        for name, base, snap in self._keys:
            entry = self._state[snap]
            for s in k.optimizer.state_names:
                k.write_state(name, s, entry[f"{base}.{s}"])
            if f"{base}.step" in entry:
                k.steps[k._locate(name)[0]] = int(entry[f"{base}.step"].item())

