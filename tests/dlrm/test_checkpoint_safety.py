"""Reading a checkpoint never runs code: train state is JSON, DCP's pickled .metadata is allow-listed."""

import json
import pickle
import random

import numpy as np
import pytest
import torch

from tests.dlrm.helpers import checkpoint_meta, train_state
from tpurec.dlrm.ckpt import checkpoint as ckpt
from tpurec.dlrm.ckpt.dcp_guard import UnsafeCheckpointError, check_metadata
from tpurec.dlrm.ckpt.integrity import write_checksums


def test_rng_states_round_trip_through_json():
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    np.random.normal()  # numpy caches a gaussian: part of its state
    state = json.loads(json.dumps(ckpt.rng_state()))
    want = (torch.rand(3), np.random.normal(size=3), random.random())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    ckpt.set_rng_state(state)
    got = (torch.rand(3), np.random.normal(size=3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


def test_real_dcp_metadata_is_accepted(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.randn(3, 4), "h": torch.zeros(2, dtype=torch.float16), "n": {"step": 3, "name": "x"}}
    with pytest.warns(UserWarning):  # DCP: no process group, one process assumed
        dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    check_metadata(tmp_path)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # creates the marker file if ever unpickled


def _crafted(tmp_path, payload) -> None:
    (tmp_path / ".metadata").write_bytes(payload)


@pytest.mark.parametrize(
    "kind",
    ["builtin call", "dotted name", "non-class from a dcp module"],
)
def test_crafted_metadata_is_refused_before_anything_runs(tmp_path, kind):
    marker = tmp_path / "ran"
    if kind == "builtin call":
        payload = pickle.dumps(_RunsCode(marker))
    elif kind == "dotted name":
        # protocol 4: STACK_GLOBAL "torch.distributed.checkpoint.filesystem" "os.system"
        payload = (
            b"\x80\x04\x8c'torch.distributed.checkpoint.filesystem\x94\x8c\tos.system\x94\x93\x94"
            + b"\x8c\x05touch\x94\x85\x94R\x94."
        )
    else:
        payload = b"\x80\x04\x8c'torch.distributed.checkpoint.filesystem\x94\x8c\x02os\x94\x93\x94."
    _crafted(tmp_path, payload)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refers to"):
        check_metadata(tmp_path)
    assert not marker.exists()


def test_resume_refuses_a_crafted_checkpoint_before_dcp_reads_it(tmp_path):
    step = tmp_path / "step-00000010"
    step.mkdir()
    (step / ckpt.MARKER).write_text("step 10\n")
    (step / "meta.json").write_text(json.dumps(checkpoint_meta(10)))
    marker = tmp_path / "ran"
    _crafted(step, pickle.dumps(_RunsCode(marker)))
    write_checksums(step)  # sealed as tpurec seals: what refuses it is the allow-list
    with pytest.raises(UnsafeCheckpointError):
        ckpt.load(tmp_path, dmp=None, optimizer=None)  # refused before the model is touched
    assert not marker.exists()


def test_truncated_metadata_is_named(tmp_path):
    _crafted(tmp_path, pickle.dumps({"a": 1})[:5])
    with pytest.raises(ValueError, match=r"\.metadata: unreadable checkpoint metadata"):
        check_metadata(tmp_path)


def test_train_state_is_json_and_an_old_pickle_is_never_read(tmp_path):
    step = tmp_path / "step-00000010"
    step.mkdir()
    (step / ckpt.MARKER).write_text("step 10\n")
    (step / "meta.json").write_text(json.dumps(checkpoint_meta(10)))
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save({"model": {}, "optim": {}}, checkpoint_id=str(step), no_dist=True)
    marker = tmp_path / "ran"
    (step / "rank-0.pt").write_bytes(pickle.dumps(_RunsCode(marker)))  # an old-style pickled train state
    write_checksums(step)

    class Empty:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(FileNotFoundError, match=r"rank-0\.json is missing"):
        ckpt.load(step, Empty(), Empty())
    assert not marker.exists()
    state = train_state(10)
    ckpt.train_state_file(step, 0).write_text(json.dumps(state))
    write_checksums(step)
    meta, loaded = ckpt.load(step, Empty(), Empty())
    assert meta["step"] == 10 and loaded == json.loads(json.dumps(state))
