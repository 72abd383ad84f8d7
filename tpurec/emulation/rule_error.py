"""The error an emulated TPU rank raises where TorchTPU 0.2.0 would refuse what it was asked."""


class TorchTpuRuleError(RuntimeError):
    """A TorchTPU 0.2.0 rule the emulated rank broke (the real run would fail at the same point)."""
