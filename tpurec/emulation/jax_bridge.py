"""A stand-in for TorchTPU's JAX bridge on the emulated device, so an emulated v5e runs the TensorCore
kernel's real TPU kernels (tpurec/embedding/tensorcore/tpu_bridge.py) on CPU.

It does what `torch_tpu._internal.pallas.jax_op` does in the 0.2.0 wheel (pallas.py), as far as a
caller can tell: refuses a function with an unannotated argument; takes `jax.Array` arguments as
runtime inputs and every other one as static (part of the program); runs the function on the device
tensors' data and hands back device tensors. Each call is a TensorCore program of the emulated
device, keyed by its shapes, dtypes and static arguments, as TorchTPU's eager mode keys its programs.
The JAX programs run on JAX's CPU backend (JAX_PLATFORMS=cpu in an emulated rank).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from tpurec.embedding.input_checks import check_distinct_ids
from tpurec.emulation import device

# The update programs size the rows they touch by their unique-id limit (tpu_bridge._row_gradients),
# so an input over it would lose updates on the chip, which cannot check it; here every input is.
_UPDATES = ("sgd", "adagrad", "adam")


def _to_jax(value: Any) -> Any:
    if isinstance(value, device.TpuTensor):
        value = value._data
    if isinstance(value, torch.Tensor):
        return jax.numpy.asarray(value.detach().contiguous().numpy())
    return value


def _host(value: Any) -> torch.Tensor:
    return value._data if isinstance(value, device.TpuTensor) else value


def _to_device(array: Any) -> torch.Tensor:
    return device.TpuTensor(torch.from_numpy(np.array(array)))  # a copy: JAX's buffers are read-only


def jax_op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`jax_op(name)(fn)`: `fn` as a callable on emulated device tensors."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn, eval_str=True).parameters.values())
        missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
        if missing:  # TorchTPU's _verify_signature refuses these
            raise TypeError(f"jax_op {name}: argument(s) {missing} have no type annotation")
        static = tuple(i for i, p in enumerate(params) if p.annotation is not jax.Array)
        jitted = jax.jit(fn, static_argnums=static)

        def call(*args: Any) -> Any:
            key = tuple(device._key_part(a) for a in args)
            device.RECORD.program("tensorcore", name, key)
            if name.rsplit("::", 1)[-1] in _UPDATES:  # (rp, emb, ..., batch, num_sc, parts, max unique)
                check_distinct_ids(_host(args[1]), _host(args[0]), *args[-3:])
            out = jitted(*(_to_jax(a) for a in args))
            return tuple(_to_device(o) for o in out) if isinstance(out, tuple) else _to_device(out)

        return call

    return wrap
