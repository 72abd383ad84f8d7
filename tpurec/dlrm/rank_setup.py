"""The process one rank runs in: logging, the process group, the device, and the host-memory check.

Kept apart from the Trainer because none of it is about training: it is what any `tpurec train`
rank sets up before (or instead of) building a model.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind, resolve_choice
from tpurec.runtime.host_resources import RANK_OVERHEAD_BYTES, available_bytes

if TYPE_CHECKING:
    from tpurec.dlrm.configs import DLRMConfig

log = logging.getLogger("tpurec.train")


class _BarAwareHandler(logging.StreamHandler):
    """Writes through tqdm, which lifts an active progress bar off the line first, so messages
    ("checkpoint: ...") never end up glued to the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # never lose a message to the progress bar
            super().emit(record)


def setup_logging(rank: int) -> None:
    # Our messages at INFO; everything else (fbgemm's "Successfully loaded" lines, torchrec, fx)
    # only from WARNING up, and torchrec's deprecation warnings not at all: the run's stderr is
    # meant to fit on a screen.
    import warnings

    handler = _BarAwareHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s" if rank else "%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
    for noisy in ("torchrec", "torch.fx", "torch.distributed", "fbgemm_gpu"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torchrec|fbgemm_gpu|torch)\b")


def init_distributed(device: DeviceKind = DeviceKind.CPU, timeout: float | None = None) -> tuple[int, int]:
    """(rank, world_size): from torchrun's environment, else a single process.

    On TPU the ranks pair gloo (CPU tensors) with TorchTPU's `tpu_dist` (tpu tensors), as DMP does
    (`tpurec.sharding.dmp.process_group_backend`; not yet run on TPU hardware); elsewhere gloo.
    `timeout` (seconds) bounds every collective's wait: gloo's own default is 30 minutes.
    """
    from datetime import timedelta

    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        from tpurec.runtime import process_group
        from tpurec.sharding.dmp import process_group_backend

        # Without a usable TPU, stay on gloo: the device check later names what is missing.
        process_group.init(
            process_group_backend(resolve_choice("auto") if device == DeviceKind.TPU else DeviceKind.CPU),
            timeout=None if timeout is None else timedelta(seconds=timeout),
        )
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Tables and their optimizer state are held once (docs/dmp.md); 10% covers the step's temporaries
# (measured: 33.8 M rows x 16 with row-wise Adagrad, 2.30 GB of tables, peaked at 3.23 GB RSS, i.e.
# tables + 0.93 GB, the rest of a rank: `RANK_OVERHEAD_BYTES`).
TABLE_PEAK_FACTOR = 1.1


def projected_host_bytes(
    cfg: DLRMConfig,
    sizes: list[int],
    world: int,
    local: int,
    dims: list[int] | None = None,
    optimizer: str | None = None,
) -> tuple[int, int]:
    """(table bytes on this host, projected peak bytes of this host's ranks) for CPU training. `dims`,
    `optimizer`: a `--model-module` model's tables' (default: the config's)."""
    from tpurec.dlrm.configs import embedding_dims
    from tpurec.embedding.optimizers.registry import spec_class

    dims = dims or embedding_dims(cfg)
    state_bytes = spec_class(optimizer or cfg.embedding_optimizer).state_bytes_per_row
    total = sum(n * (d * 4 + state_bytes(d)) for n, d in zip(sizes, dims))
    tables = total * local // max(1, world)  # this host's ranks hold their share of the tables
    return tables, int(TABLE_PEAK_FACTOR * tables) + local * RANK_OVERHEAD_BYTES


def check_host_memory(
    cfg: DLRMConfig,
    sizes: list[int],
    world: int,
    source: str = "",
    user: tuple[str, list[int], str] | None = None,
) -> None:
    """Refuse at once, in one line, tables that cannot fit in this host's free memory on CPU
    (criteo-kaggle / mlperf-dcnv2 are sized for TPU slices): better than an OOM kill mid-setup.
    Runs before any data is generated or read. `source` says where the sizes came from. `user`: a
    `--model-module` model's (name, table dims, table optimizer); `sizes` are then its tables' rows."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dims, optimizer = (user[1], user[2]) if user else (None, None)
    tables, need = projected_host_bytes(cfg, sizes, world, local, dims, optimizer)
    free = available_bytes()
    if free is None or need <= free:
        return
    fix = (
        "give its tables fewer rows, more hosts, or a TPU"
        if user
        else "use --model dlrm-tiny, data converted with smaller tables (tpurec data convert --table-set dlrm-tiny), "
        "more hosts, or a TPU"
    )
    raise UserError(
        f"training {user[0] if user else cfg.table_set} on CPU needs about {need / 2**30:.1f} GiB on this host "
        f"({tables / 2**30:.1f} GiB of tables and optimizer state for {sum(sizes):,} rows{source}, plus ~1 GiB per "
        f"rank), which has {free / 2**30:.1f} GiB available; {fix}"
    )
