"""The type checker's view of the TorchRec classes tpurec's sharded-module mixins are mixed into.

`SparseCoreShardedMixin` and `HostInputDistMixin` sit before TorchRec's ShardedEmbeddingBagCollection
or ShardedEmbeddingCollection in a class's bases and use what those provide. For the type checker
the mixins derive from `ShardedHost`, which declares exactly that; at run time `ShardedHost` is
`object`, so the real bases (and their method resolution order) are unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer

    class ShardedHost(nn.Module):
        module_sharding_plan: EmbeddingModuleShardingPlan
        _lookups: List[nn.Module]
        _table_name_to_config: Dict[str, Any]  # EmbeddingBagConfig (EBC) or EmbeddingConfig (EC)
        _sharding_type_to_sharding: Dict[str, Any]  # EmbeddingSharding of the module's context type
        _device: torch.device | None
        _dim_per_key: torch.Tensor | None  # the EBC's (its mean pooling)
        _embedding_dims: List[int]
        _env: ShardingEnv
        _optim: CombinedOptimizer

        def _initialize_torch_state(self, skip_registering: bool = False) -> None: ...

        def reset_parameters(self) -> None: ...

        def input_dist(self, ctx: Any, features: Any, *args: Any, **kwargs: Any) -> Any: ...

        def _create_input_dist(self, *args: Any, **kwargs: Any) -> None: ...

        def _init_mean_pooling_callback(self, *args: Any, **kwargs: Any) -> None: ...  # the EBC's

else:
    ShardedHost = object
