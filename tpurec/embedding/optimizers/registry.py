"""Finds the optimizer specs: every module of this package except the machinery is one optimizer.

A module's name is its optimizer's name (`rowwise_adagrad.py` -> "rowwise_adagrad"), so
`spec_names()` lists the package without importing anything (the CLIs build their choices from it
and must not import torch to print --help). Everything else imports the modules, whose spec classes
register themselves (`OptimizerSpec.__init_subclass__`), and answers from those classes. Adding an
optimizer is adding a module here; nothing in this file or elsewhere lists them.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys
from typing import TYPE_CHECKING, Any, Mapping

from tpurec.embedding.optimizers.defaults import FBGEMM_LEARNING_RATE
from tpurec.errors import UserError

if TYPE_CHECKING:
    from tpurec.embedding.optimizers.base import OptimizerSpec

_PACKAGE = __name__.rpartition(".")[0]
_MACHINERY = {"base", "defaults", "registry", "weight_decay"}


def _package_path() -> list[str]:
    # The package's __path__ once imported (tests may extend it), else this file's directory.
    package = sys.modules.get(_PACKAGE)
    return list(getattr(package, "__path__", None) or [os.path.dirname(__file__)])


def _module_names() -> list[str]:
    return [
        m.name
        for m in pkgutil.iter_modules(_package_path())
        if not m.ispkg and not m.name.startswith("_") and m.name not in _MACHINERY
    ]


def spec_names() -> tuple[str, ...]:
    """Every optimizer's name, sorted; imports no spec module (and so no torch)."""
    from_modules = set(_module_names())
    base = sys.modules.get(f"{_PACKAGE}.base")
    registered = set(base.registered()) if base is not None else set()
    return tuple(sorted(from_modules | registered))


def spec_classes() -> dict[str, type[OptimizerSpec]]:
    """name -> spec class of every optimizer (imports all spec modules, registering their ops)."""
    from tpurec.embedding.optimizers import base

    for name in _module_names():
        importlib.import_module(f"{_PACKAGE}.{name}")
    return dict(sorted(base.registered().items()))


def spec_class(name: str) -> type[OptimizerSpec]:
    from tpurec.embedding.optimizers import base

    # Registered already: the answer without listing the package (the planner's estimators ask once
    # per shard option, and listing the package took most of their time on 100-table plans).
    known = base.registered().get(name)
    if known is not None:
        return known
    classes = spec_classes()
    if name not in classes:
        raise UserError(f"unknown optimizer {name!r}; one of {sorted(classes)}")
    return classes[name]


def spec_from_torch(optimizer: type, kwargs: Mapping[str, Any] | None = None) -> OptimizerSpec:
    """The spec of a torch/TorchRec optimizer class and its kwargs, as apply_optimizer_in_backward takes them."""
    name = getattr(optimizer, "__name__", str(optimizer))
    classes = spec_classes().values()
    for cls in classes:
        if _resolves_to(cls, optimizer):
            return cls.from_torch_kwargs(kwargs, optimizer_name=name)
    paths = [cls.torch_optimizer_path for cls in classes]
    use = f"{', '.join(paths[:-1])} or {paths[-1]}" if len(paths) > 1 else paths[0]
    raise UserError(f"optimizer {name} has no fused SparseCore update; use {use}")


def _resolves_to(cls: type[OptimizerSpec], optimizer: type) -> bool:
    try:
        return cls.torch_optimizer() is optimizer
    except ImportError:  # pragma: no cover - a spec for an optimizer of a package not installed
        return False


# TorchRec's fused kernel (FBGEMM's SplitTableBatchedEmbeddingBagsCodegen) trains with these when the
# sharder's fused params name no optimizer (no apply_optimizer_in_backward): optimizer=EXACT_SGD,
# learning_rate=FBGEMM_LEARNING_RATE (fbgemm_gpu/split_table_batched_embeddings_ops_training.py defaults).
TORCHREC_DEFAULT_OPTIMIZER = "sgd"
_logged_default = False
# FBGEMM's EmbOptimType members its TBE refuses ("deprecated in the CPU + GPU modes",
# fbgemm_gpu/split_table_batched_embeddings_ops_training.py, SplitTableBatchedEmbeddingBagsCodegen.__init__)
FBGEMM_DEPRECATED = ("SGD", "ROWWISE_ADAGRAD")


def spec_from_fused_params(fused_params: Mapping[str, Any] | None, table: str) -> OptimizerSpec:
    """The spec from the per-table fused params TorchRec's sharder builds out of
    `apply_optimizer_in_backward(...)` (an FBGEMM `EmbOptimType` under "optimizer" plus the kwargs).
    No optimizer at all means what it means to TorchRec's fused kernel: EXACT_SGD (logged once)."""
    global _logged_default
    fp = dict(fused_params or {})
    opt = fp.get("optimizer")
    classes = spec_classes()
    if opt is None:
        fp.setdefault("learning_rate", FBGEMM_LEARNING_RATE)
        spec = _with_weight_decay(classes[TORCHREC_DEFAULT_OPTIMIZER].from_fused_params(fp), fp, table)
        if not _logged_default:
            logging.getLogger(__name__).warning(
                "table %r (and any other without one): no fused optimizer given (apply_optimizer_in_backward); "
                "training with EXACT_SGD, lr=%s, as TorchRec's fused kernel does",
                table,
                spec.lr,
            )
            _logged_default = True
        return spec
    if getattr(opt, "name", None) in FBGEMM_DEPRECATED:
        # TorchRec's fused kernel refuses them (FBGEMM's TBE asserts "Optimizer sgd is deprecated in
        # the CPU + GPU modes"): so does this one, naming what to use
        raise UserError(
            f"table {table!r}: optimizer EmbOptimType.{opt.name} is deprecated in FBGEMM (TorchRec's fused "
            f"kernel refuses it too); use EmbOptimType.EXACT_{opt.name}"
        )
    for cls in classes.values():
        if getattr(opt, "value", opt) in cls.fbgemm_names():
            # TorchRec passes the optimizer's kwargs through as fused params: an option the fused
            # update cannot honour is refused by name, as the standalone module refuses it, never
            # dropped (Adam(weight_decay=0.01) must not train as plain Adam).
            for key in cls.refused_torch_kwargs:
                if fp.get(key) not in (None, 0, 0.0, False):
                    raise UserError(
                        f"table {table!r}: {cls.torch_class_name()} option {key}={fp[key]!r} is not supported by "
                        "tpurec's fused SparseCore update (refused, not ignored); leave it out, or keep this "
                        "table off the SparseCore kernel"
                    )
            return _with_weight_decay(cls.from_fused_params(fp), fp, table)
    names = "|".join(cls.torch_class_name() for cls in classes.values())
    raise UserError(
        f"table {table!r}: optimizer={opt!r} has no fused SparseCore update; use "
        f"torchrec.optim.apply_optimizer_in_backward(<{names}>, params, kwargs) on the unsharded model"
    )


def _with_weight_decay(spec: OptimizerSpec, fused_params: Mapping[str, Any], table: str) -> OptimizerSpec:
    """`spec` with the fused params' weight_decay / weight_decay_mode (FBGEMM's meaning,
    `weight_decay.py`); what FBGEMM's kernel would not apply is refused naming the table."""
    try:
        return spec.with_weight_decay(fused_params)
    except UserError as e:
        raise UserError(f"table {table!r}: {e} (refused, not ignored)") from None


def spec_name_for(alias: str) -> str | None:
    """tpurec's name of an optimizer given as a torch/TorchRec class name ("RowWiseAdagrad"), an
    FBGEMM EmbOptimType value or alias ("exact_row_wise_adagrad"), or tpurec's name; None if none."""
    for name, cls in spec_classes().items():
        if alias == name or alias == cls.torch_class_name() or alias in cls.fbgemm_names():
            return name
    return None
