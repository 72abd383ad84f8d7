"""The sharders take a KernelSettings as well as its fields as keywords, and give the same fused params."""

import pytest

from tpurec.embedding.settings import SETTINGS_KEY, KernelSettings, TableLimits
from tpurec.errors import UserError
from tpurec.sharding.ec_sharder import SparseCoreECSharder
from tpurec.sharding.sharder import SparseCoreEBCSharder


@pytest.mark.parametrize("sharder", [SparseCoreEBCSharder, SparseCoreECSharder])
def test_settings_and_keywords_give_the_same_fused_params(sharder):
    loose = dict(max_ids_per_partition=16, allow_id_dropping=True, pad_dims=True, id_limits={"t": (8, 4)})
    by_keywords = sharder(num_sparsecores=2, **loose).fused_params
    carried = by_keywords[SETTINGS_KEY]
    assert carried.max_ids_per_partition == 16 and carried.id_limits == {"t": TableLimits(8, 4)}
    assert sharder(num_sparsecores=2, settings=KernelSettings(**loose)).fused_params == by_keywords
    with pytest.raises(UserError, match=r"not both \(got \['pad_dims'\]\)"):
        sharder(settings=KernelSettings(), pad_dims=True)
    with pytest.raises(UserError, match="stack_tables=False is not supported"):
        sharder(settings=KernelSettings(stack_tables=False))
