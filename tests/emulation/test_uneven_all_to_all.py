"""The uneven all-to-all a TPU rank runs is an explicit choice: TorchRec's padding or TorchTPU's path."""

from __future__ import annotations

import pytest
import torch

from tests.sharding.multiprocess import run_ranks


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


@pytest.mark.multiprocess
def test_padded_is_torchrecs_padding_and_uneven_hands_the_call_back_to_the_backend():
    r0, r1 = run_ranks(_kjt_all_to_all, 2, "padded")
    assert r0 == ([0, 100, 101, 102], 1) and r1 == ([1, 103, 104, 105], 1)
    for out, calls in run_ranks(_kjt_all_to_all, 2, "uneven"):
        assert out is None and calls == 0  # TorchRec then calls all_to_all_single unpadded
    # Ids on the host go over gloo, which takes uneven splits: no padding even in "padded" mode.
    for out, calls in run_ranks(_kjt_all_to_all, 2, "padded", False):
        assert out is None and calls == 0


def test_unknown_mode_is_refused_naming_the_choices(monkeypatch):
    from tpurec.sharding import tpu_all_to_all

    monkeypatch.setenv(tpu_all_to_all.ENV, "even")
    with pytest.raises(ValueError, match="'even' .* must be one of padded, uneven"):
        tpu_all_to_all.select()
