"""`tpurec plan --model-module tests.emulation.every_sharding_type:dlrm_tiny`: dlrm-tiny's tables with
ParameterConstraints that make the plan use every sharding type the planner offers on a TPU."""

from __future__ import annotations

import torch
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tpurec.data.catalog import get_table_set
from tpurec.planner.kernel_choice import sharding_types_for


def dlrm_tiny():
    from tpurec.dlrm.model import embedding_bag_configs

    tables = embedding_bag_configs(get_table_set("dlrm-tiny"))
    kinds = sharding_types_for("tpu")  # table-wise, column-wise, table-column-wise, row-wise
    constraints = {t.name: ParameterConstraints(sharding_types=[kinds[i % len(kinds)]]) for i, t in enumerate(tables)}
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta")), constraints
