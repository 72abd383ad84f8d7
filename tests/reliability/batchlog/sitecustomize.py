"""Records what every training step of a real `tpurec train` process takes (issue #29, family 10).

Python imports `sitecustomize` at start-up from PYTHONPATH: a test puts this directory there and sets
TPUREC_TEST_BATCH_LOG=DIR, and every process of the run (the launcher, each rank of `--nproc`)
appends one fingerprint per training batch to DIR/rank-R.txt. The trainer's data part
(tpurec.dlrm.training.data) is wrapped when it is first imported (an import hook), so nothing is
imported early and processes without it are untouched.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import sys

LOG = os.environ.get("TPUREC_TEST_BATCH_LOG")


def fingerprint(batch) -> str:
    """What a batch holds, row for row: dense values, ids and labels."""
    h = hashlib.sha256()
    for t in (batch.dense_features, batch.sparse_features.values(), batch.sparse_features.lengths(), batch.labels):
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _recorded(stream, path: str):
    for batch in stream:  # what the pipeline hands the step: exactly the batches trained
        with open(path, "a") as f:
            f.write(fingerprint(batch) + "\n")
        yield batch


def _wrap(data_class) -> None:
    start = data_class.start_stream

    def start_stream(self, dmp) -> None:
        start(self, dmp)
        self.stream = _recorded(self.stream, os.path.join(str(LOG), f"rank-{self.run.rank}.txt"))

    data_class.start_stream = start_stream


class _WrapTrainingData(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "tpurec.dlrm.training.data":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _wrap(module.TrainingData)

        spec.loader.exec_module = exec_module
        return spec


if LOG:
    sys.meta_path.insert(0, _WrapTrainingData())
