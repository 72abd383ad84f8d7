"""Put on PYTHONPATH of CPU ranks only (tests/emulation/test_emulated_train.py): every DDP of the run with
`static_graph=False`, the mode DDP runs in on the emulated device (tpurec/emulation/torchtpu_dist.py,
`ddp_without_pinned_host_memory`), so that the CPU ranks bucket and sum the dense gradients in the same
order as the emulated ranks."""

from torch.nn.parallel import DistributedDataParallel

_init = DistributedDataParallel.__init__


def _dynamic_graph_init(self, module, *args, **kwargs):
    kwargs["static_graph"] = False
    _init(self, module, *args, **kwargs)


DistributedDataParallel.__init__ = _dynamic_graph_init  # type: ignore[method-assign]
