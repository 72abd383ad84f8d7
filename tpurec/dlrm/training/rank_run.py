"""What every part of one rank's training run reads: the options, the rank's place in the group, its
device and emulation, the resolved config and catalog table set, the user's model (`--model-module`)
and the rank's log line (rank 0 says, the others stay quiet)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpurec.data.catalog import TableSet
    from tpurec.dlrm.configs import DLRMConfig
    from tpurec.dlrm.options import TrainOptions
    from tpurec.dlrm.training.emulation import Emulation
    from tpurec.dlrm.user_model import UserModel
    from tpurec.runtime.device import DeviceKind


@dataclass
class RankRun:
    """`cfg` is replaced once, when the data caps the batch to the rows a rank holds (data.py)."""

    options: TrainOptions
    rank: int
    world: int
    device: DeviceKind
    emulation: Emulation
    say: Callable[[str], None]
    cfg: DLRMConfig
    table_set: TableSet
    user: UserModel | None = None  # --model-module: the user's model (tpurec.dlrm.user_model)

    @property
    def model_name(self) -> str:
        """The model trained, as the result line and the reports name it: the config, or MOD:FN."""
        return self.options.model_module or self.cfg.name

    def remapped(self) -> bool:
        """Tables behind a managed-collision remap: --zch's, or a --model-module's own."""
        return self.options.zch or (self.user is not None and bool(self.user.remap_ranges()))

    def table_optimizer(self) -> str:
        """The tables' optimizer: a `--model-module` model's own when it set one, else the config's."""
        if self.user is not None and self.user.own_optimizer:
            from tpurec.planner.planners import infer_optimizer

            return infer_optimizer(self.user.module) or self.cfg.embedding_optimizer
        return self.cfg.embedding_optimizer
