"""pytest plugin: import tpurec (and name the "tpu" backend, as planning does) and build tpurec's
sharders (which wrap TorchRec's default perf and storage estimators for `customized_kernel`,
tpurec/planner/stock_estimates.py) before torchrec's own planner tests run, to show tpurec changes
nothing torchrec relies on.

  python -m pytest -p tests.sharding.torchrec_suite_plugin <torchrec>/distributed/planner/tests
"""

from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator

import tpurec  # noqa: F401
import tpurec.planner.estimators  # noqa: F401
import tpurec.planner.plan_io  # noqa: F401
import tpurec.planner.planners  # noqa: F401
import tpurec.planner.report  # noqa: F401
from tpurec.planner.stock_estimates import original_estimate
from tpurec.planner.topology import make_topology
from tpurec.sharding.sharder import SparseCoreEBCSharder

make_topology("v5p-8")  # side effect under test: PrivateUse1 renamed to "tpu"
SparseCoreEBCSharder()  # side effect under test: TorchRec's default estimators wrapped
for _estimator in (EmbeddingPerfEstimator, EmbeddingStorageEstimator):
    assert original_estimate(_estimator) is not _estimator.estimate, "the wrappers this run checks are not installed"
