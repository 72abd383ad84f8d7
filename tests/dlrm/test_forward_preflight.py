"""A --model-module forward that calls an op TorchTPU 0.2.0 lacks is one line before any rank starts
(issue 63 item 2): the launcher runs the forward once on 2 samples (tpurec/dlrm/forward_preflight.py)."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from tests.reliability.inproc import assert_refused, run_cli

from .helpers import REPO

EXAMPLES = REPO / "examples"
MY_MODEL = f"{EXAMPLES / 'my_model.py'}:build"

PADDED = textwrap.dedent(
    """
    import sys

    import torch
    from torchrec import JaggedTensor

    sys.path.insert(0, {examples!r})
    import my_model


    class Padded(my_model.MyRanker):
        def forward(self, dense_features, sparse_features):
            jt = JaggedTensor(values=dense_features, lengths=torch.ones_like(dense_features[:, 0], dtype=torch.long))
            dense = jt.to_padded_dense(desired_length=1)[:, 0]
            return super().forward(dense, sparse_features)


    def build():
        return Padded(), my_model.CONSTRAINTS
    """
)

# The history of examples/history_ranker.py (an EmbeddingCollection's output) padded by TorchRec.
HISTORY_PADDED = textwrap.dedent(
    """
    import sys

    sys.path.insert(0, {examples!r})
    import history_ranker


    class Padded(history_ranker.HistoryRanker):
        @staticmethod
        def _history(jt):
            return jt.to_padded_dense(desired_length=history_ranker.HISTORY)


    def build():
        return Padded(), history_ranker.CONSTRAINTS
    """
)

# A managed-collision EBC (tables on the meta device) whose pooled output meets an op TorchTPU lacks.
MC_UNIQUE = textwrap.dedent(
    """
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
    )

    TABLES = [EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=1000, feature_names=["user_id"])]


    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense_in_features = 2
            meta = torch.device("meta")
            remap = MCHManagedCollisionModule(
                zch_size=1000, device=meta, eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1,
                input_hash_size=2**20,
            )
            ebc = EmbeddingBagCollection(tables=TABLES, device=meta)
            remaps = ManagedCollisionCollection({{"t_user": remap}}, TABLES)
            self.mc = ManagedCollisionEmbeddingBagCollection(ebc, remaps)
            self.top = torch.nn.Linear(10, 1, device=meta)

        def forward(self, dense, kjt):
            pooled, _ = self.mc(kjt)
            x = torch.cat([dense, pooled.values()], dim=1)
            return self.top(x).squeeze(-1) + torch.unique(x, dim=0, return_inverse=True)[1]


    def build():
        return Model()
    """
)

TORCHTPU_LACKS = "has no TorchTPU 0.2.0 kernel (its CPU fallback is off: on a TPU this line fails on every rank); "
GATHER = (
    "gather each sample's rows by offsets() with a fixed number of rows, the indices built on the device "
    "(torch.arange(n, device=offsets.device)), as examples/history_ranker.py does (docs/sequence.md)"
)


@pytest.fixture(scope="module")
def my_data(tmp_path_factory):
    """2,000 rows for examples/my_model.py's features (`data synth --model-module`, in this process)."""
    from tpurec.cli import main

    out = tmp_path_factory.mktemp("my-data") / "data"
    assert main(["data", "synth", "--model-module", MY_MODEL, "--rows", "2000", "--out", str(out)]) == 0
    return out


def _user(path, source: str):
    from tpurec.dlrm.user_model import load

    path.write_text(source.format(examples=str(EXAMPLES)))
    return load(f"{path}:build", 0)


def _meta(user) -> dict:
    """The metadata of data made for the model: its dense count and a column per feature."""
    dense = [f"I{i}" for i in range(user.dense_in_features)]
    return {"dense": dense, "sparse": [{"name": f.name} for f in user.features]}


def test_train_on_an_emulated_slice_refuses_the_op_before_any_rank_starts(my_data, tmp_path, capsys, monkeypatch):
    """Was: the 4 ranks started, built data and model and failed at step 1 (`ranks 0-3: ...`, ~20 s)."""
    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "padded.py").write_text(PADDED.format(examples=str(EXAMPLES)))
    argv = ["train", "--emulate-tpu", "v5p-8", "--model-module", f"{tmp_path / 'padded.py'}:build"]
    t0 = time.monotonic()
    code, _, err = run_cli([*argv, "--data", my_data, "--steps", 2], capsys)
    assert_refused(code, err, "to_padded_dense")
    line = f"{tmp_path / 'padded.py'}:14: JaggedTensor.to_padded_dense calls "
    line += "fbgemm::jagged_to_padded_dense_forward, which "
    assert err.strip().splitlines()[-1] == f"tpurec train: error: {line}{TORCHTPU_LACKS}{GATHER}", err
    assert time.monotonic() - t0 < 15  # the launcher's check: no rank started (measured about 3 s)


def test_the_launcher_checks_the_forward_for_a_tpu_only(my_data, tmp_path):
    """The op has a CPU kernel: the preflight of a CPU run passes the model, a TPU run's refuses it."""
    from tpurec.dlrm.options import TrainOptions
    from tpurec.dlrm.preflight import check_before_launch
    from tpurec.emulation.missing_op import MissingTpuKernel

    (tmp_path / "padded.py").write_text(PADDED.format(examples=str(EXAMPLES)))
    options = TrainOptions(model_module=f"{tmp_path / 'padded.py'}:build", data=str(my_data), seed=3)
    check_before_launch(options, 2, None, tpu=False)
    with pytest.raises(MissingTpuKernel, match=r"padded.py:14: JaggedTensor.to_padded_dense calls"):
        check_before_launch(options, 2, None, tpu=True)


def test_an_embedding_collections_output_padded_is_named_at_the_users_line(tmp_path):
    from tpurec.dlrm.forward_preflight import check_forward
    from tpurec.emulation.missing_op import MissingTpuKernel

    user = _user(tmp_path / "history.py", HISTORY_PADDED)
    with pytest.raises(MissingTpuKernel) as e:
        check_forward(user, _meta(user))
    start = f"{tmp_path / 'history.py'}:11: JaggedTensor.to_padded_dense calls fbgemm::jagged_to_padded_dense"
    assert str(e.value).startswith(start) and str(e.value).endswith(GATHER), e.value


def test_an_op_after_a_managed_collision_tables_output_is_named(tmp_path):
    """The meta-device model's remap and tables are stood in for; the op after them is reached."""
    from tpurec.dlrm.forward_preflight import check_forward
    from tpurec.emulation.missing_op import MissingTpuKernel

    user = _user(tmp_path / "mc.py", MC_UNIQUE)
    with pytest.raises(MissingTpuKernel) as e:
        check_forward(user, _meta(user))
    assert str(e.value).startswith(f"{tmp_path / 'mc.py'}:29: aten::unique_dim {TORCHTPU_LACKS}write it"), e.value
    # put back as it was: tables and remap on the meta device, no forward of the instance's own
    mc = user.module.model.mc
    assert "forward" not in mc.__dict__ and user.module.model.top.weight.is_meta


@pytest.mark.parametrize("example", ["my_model", "history_ranker", "two_ebcs", "position_weighted"])
def test_the_examples_forwards_pass(example, tmp_path):
    """Each example runs on a TPU (tests/dlrm/test_user_model.py, emulated): nothing is refused."""
    from tpurec.dlrm.forward_preflight import check_forward

    sys.path.insert(0, str(EXAMPLES))
    try:
        user = _user(tmp_path / "m.py", f"from {example} import build\n")
    finally:
        sys.path.remove(str(EXAMPLES))
    assert check_forward(user, _meta(user)) is True  # it ran to the end: False when skipped or failed
