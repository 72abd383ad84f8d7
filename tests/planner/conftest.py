import logging

import pytest
import torch

from tpurec.data.catalog import get_table_set
from tpurec.dlrm.model import embedding_bag_configs

# torchrec warns that our Topology is not built by its TopologyFactory; not actionable in tests.
logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)


def ebc_for(name_or_tables):
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = embedding_bag_configs(get_table_set(name_or_tables)) if isinstance(name_or_tables, str) else name_or_tables
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def pooling_of(name):
    from tpurec.planner.planners import pooling_constraints

    return pooling_constraints({t.name: t.pooling_factor for t in get_table_set(name).tables})


@pytest.fixture
def mlperf():
    return ebc_for("mlperf-dcnv2"), pooling_of("mlperf-dcnv2")
