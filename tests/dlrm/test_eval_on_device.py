"""The final evaluation of `tpurec train --device tpu` (issue #36 item 2): it reads the device's logits
and labels through one counted device->host copy (never `.numpy()` on a device tensor, which TorchTPU
refuses), and the final checkpoint is written whatever the evaluation does."""

from __future__ import annotations

import pytest
import torch

from tests.reliability.inproc import TINY_TRAIN
from tpurec.cli import main
from tpurec.dlrm import metrics
from tpurec.runtime import host_copies


class DeviceOnly(torch.Tensor):
    """A tensor off the host as a TPU tensor is: its ops stay on the "device" (CPU data underneath),
    `.numpy()` raises torch's TypeError for a `tpu:0` tensor, and only a copy to the CPU gives a host
    tensor."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> DeviceOnly:
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=torch.device("meta"))
        r.elem = elem
        return r

    def numpy(self, *, force: bool = False):
        raise TypeError(
            "can't convert tpu:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            rest = {k: v for k, v in kwargs.items() if k != "device"}
            return func(args[0].elem, **rest)  # the one way to the host

        def unwrap(x):
            return x.elem if isinstance(x, DeviceOnly) else x

        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs))
        return torch.utils._pytree.tree_map(lambda x: DeviceOnly(x) if isinstance(x, torch.Tensor) else x, out)


@pytest.fixture(autouse=True)
def _fresh_counts():
    host_copies.reset()
    yield
    host_copies.reset()


def test_metrics_of_device_tensors_take_one_counted_copy_and_match_the_host_ones():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=gen)
    labels = (torch.rand(300, generator=gen) < torch.sigmoid(logits)).float()
    host = metrics.compute(*metrics.gather(logits, labels))
    assert host_copies.counts() == {}  # host tensors: nothing copied

    lo, la = DeviceOnly(logits), DeviceOnly(labels)
    with pytest.raises(TypeError, match="can't convert"):
        lo.numpy()  # what the final evaluation called on a TPU
    on_device = metrics.compute(*metrics.gather(lo, la))
    assert on_device == host and 0.5 < host["auc"] < 1 and host["rows"] == 300
    assert host_copies.counts() == {"eval": 1}  # logits and labels in one copy


def test_the_final_checkpoint_is_written_even_when_the_final_evaluation_fails(tmp_path, monkeypatch):
    from tpurec.dlrm.trainer import Trainer

    monkeypatch.setenv("TPUREC_CACHE", str(tmp_path / "cache"))

    def failing(self):
        raise TypeError("can't convert tpu:0 device type tensor to numpy")

    monkeypatch.setattr(Trainer, "evaluate", failing)
    ck = tmp_path / "ck"
    threads = torch.get_num_threads()  # a Trainer pins this process to one thread
    try:
        with pytest.raises(TypeError, match="tpu:0"):
            main([str(a) for a in [*TINY_TRAIN, "--steps", 2, "--checkpoint-dir", ck]])
    finally:
        torch.set_num_threads(threads)
    assert (ck / "step-00000002" / "COMPLETE").exists()
