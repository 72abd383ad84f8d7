"""pytest plugin: import tpurec (and name the "tpu" backend, as planning does) before torchrec's own
planner tests run, to show tpurec changes nothing torchrec relies on.

  python -m pytest -p tests.sharding.torchrec_suite_plugin <torchrec>/distributed/planner/tests
"""

import tpurec  # noqa: F401
import tpurec.sharding.estimators  # noqa: F401
import tpurec.sharding.inspect  # noqa: F401
import tpurec.sharding.plan_io  # noqa: F401
import tpurec.sharding.planner  # noqa: F401
from tpurec.sharding.topology import make_topology

make_topology("v5p-8")  # side effect under test: PrivateUse1 renamed to "tpu"
