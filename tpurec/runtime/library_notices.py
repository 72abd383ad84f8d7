"""Library notices tpurec's own calls cause and a user cannot act on, dropped at their source.

torch logs, once per process, that `is_fx_tracing` also covers torch.export, as a `W...` line on
stderr: any TorchRec KeyedJaggedTensor built asks it (DistributedModelParallel, `tpurec data stats`,
`tpurec plan --model-module`). Dropped by its logger and its message only (docs/dmp.md, "Warnings").
"""

from __future__ import annotations

import logging


class _DropFxTracingNotice(logging.Filter):
    """Drops torch's one notice that `is_fx_tracing` covers torch.export too: torch's ProxyableClassMeta
    (the metaclass of TorchRec's KeyedJaggedTensor) calls it at every KJT built, so every TorchRec
    program logs it once per rank, whatever tpurec does (docs/dmp.md)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true for both")


def quiet_fx_tracing_notice() -> None:
    log = logging.getLogger("torch.fx._symbolic_trace")
    if not any(isinstance(f, _DropFxTracingNotice) for f in log.filters):
        log.addFilter(_DropFxTracingNotice())
