"""The uneven all-to-all a TPU rank runs: TorchRec's padding; TorchTPU's own uneven path ("uneven") is
refused on the TPU path with TorchTPU's reason (issue #36 item 6) and accepted on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli
from tests.sharding.multiprocess import run_ranks

REASON = "asymmetric input buffer sizes across ranks are not supported on TPU."


def _kjt_all_to_all(rank, world_size, mode, on_device=True):
    import torch.distributed as dist
    from torchrec.experimental.torch_tpu import uneven_all_to_all as hooks

    from tpurec.runtime import host_copies
    from tpurec.sharding import tpu_all_to_all

    assert tpu_all_to_all.select(mode) == mode
    before = tpu_all_to_all.padded_calls()
    # Rank 0 sends 1 id to each rank, rank 1 sends 3: uneven splits.
    sends = [1, 1] if rank == 0 else [3, 3]
    receives = [1, 3]
    ids = torch.arange(sum(sends)) + 100 * rank
    if on_device:
        host_copies.mark_on_device(ids)  # as on a TPU rank's device
    out = hooks.maybe_kjt_a2a_uneven_tpu(dist.group.WORLD, [ids], [sends], [receives], torch.device("cpu"))
    return (None if out is None else out[0].tolist()), tpu_all_to_all.padded_calls() - before


@pytest.mark.slow  # in make test-all since session 27: the default suite's 20 minutes
@pytest.mark.multiprocess
def test_padded_is_torchrecs_padding():
    r0, r1 = run_ranks(_kjt_all_to_all, 2, "padded")
    assert r0 == ([0, 100, 101, 102], 1) and r1 == ([1, 103, 104, 105], 1)
    # Ids on the host go over gloo, which takes uneven splits: no padding even in "padded" mode.
    for out, calls in run_ranks(_kjt_all_to_all, 2, "padded", False):
        assert out is None and calls == 0


def test_unknown_mode_is_refused_naming_the_choices(monkeypatch):
    from tpurec.sharding import tpu_all_to_all

    monkeypatch.setenv(tpu_all_to_all.ENV, "even")
    with pytest.raises(ValueError, match="'even' .* must be one of padded, uneven"):
        tpu_all_to_all.select()


def _dmp(rank, world_size, emulate, mode):
    """A one-table DMP on this rank's CPU (an emulated TPU rank's when `emulate` names a slice) with
    `uneven_all_to_all=mode`: ("refused", message, whether a process group was started) or
    ("built", the mode the DMP reports)."""
    import os

    import torch.distributed as dist
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.errors import UserError
    from tpurec.runtime.device import EMULATE_ENV

    if emulate:
        os.environ[EMULATE_ENV] = emulate
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=64, feature_names=["f"])],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    try:
        dmp = tpurec.DistributedModelParallel(ebc, device="cpu", uneven_all_to_all=mode)
    except UserError as e:
        return "refused", str(e), dist.is_initialized()
    return "built", dmp.uneven_all_to_all


@pytest.mark.multiprocess
def test_uneven_is_refused_on_an_emulated_tpu_rank_before_any_group_and_accepted_on_cpu():
    [(what, message, group)] = run_ranks(_dmp, 1, "v5p-8", "uneven", init_group=False)
    assert what == "refused" and not group, message
    assert message.startswith("uneven_all_to_all='uneven' is refused on a TPU: ") and "\n" not in message
    assert "ProcessGroupTpu::AllToAllBaseUnevenSplits" in message and REASON in message
    assert run_ranks(_dmp, 1, None, "uneven", init_group=False) == [("built", None)]  # CPU ranks: gloo


def test_uneven_is_refused_by_tpurec_train_on_the_tpu_path_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    from tpurec.sharding import tpu_all_to_all

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path))
    monkeypatch.setenv(tpu_all_to_all.ENV, "uneven")
    code, out, err = run_cli([*TINY_TRAIN, "--emulate-tpu", "v5p-8", "--steps", 1], capsys)
    assert_refused(code, err, f"tpurec train: error: {tpu_all_to_all.ENV}=uneven is refused on a TPU: ")
    assert REASON in err and out == ""
    assert tpu_all_to_all.check(None, "cpu") == "uneven"  # a CPU run takes the splits as they are


def test_uneven_is_refused_by_tpurec_launch_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    from tpurec.sharding import tpu_all_to_all

    program = tmp_path / "program.py"
    program.write_text("print('ran')\n")
    monkeypatch.setenv(tpu_all_to_all.ENV, "uneven")
    code, out, err = run_cli(["launch", "--emulate-tpu", "v5p-8", program], capsys)
    assert_refused(code, err, f"tpurec launch: error: {tpu_all_to_all.ENV}=uneven is refused on a TPU: ")
    assert REASON in err and "ran" not in out
