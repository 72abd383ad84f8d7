"""Fused optimizers of the SparseCore kernel: one module, one `OptimizerSpec` subclass, per optimizer.

`base.py` defines the spec; `registry.py` finds every other module of this package and answers
"which optimizers are there" and "which spec is this torch class / fused-params entry". Names are
lent lazily (a facade, no logic): modules import `tpurec.embedding.optimizers.registry` or `.base`.
"""

from typing import Any

_LENT = {
    "OptimizerSpec": "base",
    "spec_names": "registry",
    "spec_class": "registry",
    "spec_classes": "registry",
    "spec_from_torch": "registry",
    "spec_from_fused_params": "registry",
    "spec_name_for": "registry",
}
__all__ = sorted(_LENT)


def __getattr__(name: str) -> Any:
    if name in _LENT:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LENT[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
