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
    assert set(check_metadata(tmp_path).state_dict_metadata) == {"w", "h", "n.step", "n.name"}


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


class _Holder:
    """A model or optimizer as `ckpt.load` sees one: a state dict of tensors, loaded in place."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd


def _checkpoint_with_a_planted_pickle(root, marker, key="optim.state.t0.momentum"):
    """A real tpurec-shaped checkpoint whose entry `key` an attacker re-declared as bytes holding a
    pickle appended to the shard, CHECKSUMS.json re-sealed: all anyone who can write the directory
    can do. The optimizer's param_groups hold a plain number, stored as bytes as DCP stores them."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    step = root / "step-00000010"
    step.mkdir()
    model = {"w": torch.ones(4, 2)}
    optim = {"state": {"t0.momentum": torch.zeros(4)}, "param_groups": [{"lr": 0.5}]}
    with pytest.warns(UserWarning):
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(step), no_dist=True)
    (step / ckpt.MARKER).write_text("step 10\n")
    (step / "meta.json").write_text(json.dumps(checkpoint_meta(10)))
    ckpt.train_state_file(step, 0).write_text(json.dumps(train_state(10)))
    metadata = pickle.loads((step / ".metadata").read_bytes())
    info = next(v for k, v in metadata.storage_data.items() if k.fqn.startswith("model."))
    shard = step / info.relative_path
    payload = io.BytesIO()
    torch.save(_RunsCode(marker), payload)
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = type(info)(info.relative_path, offset, len(payload.getvalue()))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    write_checksums(step)
    return step, model, optim


def _fresh(model, optim):
    zeros = {"state": {"t0.momentum": torch.full((4,), 7.0)}, "param_groups": [{"lr": 0.0}]}
    return _Holder({"w": torch.zeros(4, 2)}), _Holder(zeros if optim else {})


def test_resume_never_unpickles_a_bytes_entry_planted_in_the_optimizer_state(tmp_path):
    """The optimizer's tensor re-declared as bytes: refused before DCP reads a byte."""
    marker = tmp_path / "ran"
    step, model, optim = _checkpoint_with_a_planted_pickle(tmp_path, marker)
    fresh_model, fresh_optim = _fresh(model, optim)
    with pytest.raises(UnsafeCheckpointError, match=r"entry 'optim\.state\.t0\.momentum' is stored as BytesStorage"):
        ckpt.load(step, fresh_model, fresh_optim)
    assert not marker.exists()
    assert torch.equal(fresh_model.state["w"], torch.zeros(4, 2))  # nothing loaded


def test_a_pickle_planted_where_dcp_stores_bytes_is_refused_by_the_safe_reader(tmp_path):
    """param_groups' number is bytes in any DCP checkpoint of a torch optimizer: its planted pickle
    reaches the reader, which unpickles plain values only."""
    marker = tmp_path / "ran"
    step, model, optim = _checkpoint_with_a_planted_pickle(tmp_path, marker, key="optim.param_groups.0.lr")
    with pytest.raises(UnsafeCheckpointError, match=r"entry 'optim\.param_groups\.0\.lr' holds a pickle of something"):
        ckpt.load(step, *_fresh(model, optim))
    assert not marker.exists()


def test_a_checkpoint_with_plain_values_as_bytes_loads(tmp_path):
    """What DCP stores as bytes legitimately (a torch optimizer's param_groups) still loads."""
    step, model, optim = _checkpoint_with_a_planted_pickle(tmp_path, tmp_path / "ran", key="none")
    fresh_model, fresh_optim = _fresh(model, optim)
    ckpt.load(step, fresh_model, fresh_optim)
    assert torch.equal(fresh_model.state["w"], torch.ones(4, 2))
    assert fresh_optim.state["param_groups"] == [{"lr": 0.5}]
    assert torch.equal(fresh_optim.state["state"]["t0.momentum"], torch.zeros(4))
