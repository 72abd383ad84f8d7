"""state_dict hooks of the standalone modules: each table published in natural row order.

A module using these has a `kernel` (SparseCoreKernel, tables named as the module's configs) and a
`STATE_PREFIX`: "embedding_bags" for the EmbeddingBagCollection, "embeddings" for the
EmbeddingCollection, TorchRec's keys `<prefix>.<table>.weight`. The published tensors are views of
the live storage, so TorchRec's tools and DCP write into them in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpurec.errors import UserError

if TYPE_CHECKING:
    from torch import nn


def register(module: nn.Module) -> None:
    module._register_state_dict_hook(_emit_natural_weights)
    module._register_load_state_dict_pre_hook(_consume_natural_weights, with_module=True)


def _emit_natural_weights(
    module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> dict[str, Any]:
    for name in module.kernel.table_names:
        state_dict[f"{prefix}{module.STATE_PREFIX}.{name}.weight"] = module.kernel.read_weight(name)
    return state_dict


def _consume_natural_weights(
    module: Any,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    for name in module.kernel.table_names:
        key = f"{prefix}{module.STATE_PREFIX}.{name}.weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        try:
            module.kernel.write_weight(name, value)
        except UserError as e:
            error_msgs.append(f"{key}: {e}")
