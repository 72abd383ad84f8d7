"""The process one rank runs in: logging, the process group, the device, and the host-memory check.

Kept apart from the Trainer because none of it is about training: it is what any `tpurec train`
rank sets up before (or instead of) building a model.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("tpurec.train")


def setup_logging(rank: int) -> None:
    # Our messages at INFO; everything else (fbgemm's "Successfully loaded" lines, torchrec, fx)
    # only from WARNING up, and torchrec's deprecation warnings not at all: the run's stderr is
    # meant to fit on a screen.
    import warnings

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s" if rank else "%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)
    for noisy in ("torchrec", "torch.fx", "torch.distributed", "fbgemm_gpu"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torchrec|fbgemm_gpu|torch)\b")


def init_distributed(device: str = "cpu"):
    """(rank, world_size): from torchrun's environment, else a single process.

    On TPU the ranks pair gloo (CPU tensors) with TorchTPU's `tpu_dist` (tpu tensors), as DMP does
    (`tpurec.sharding.dmp.process_group_backend`; not yet run on TPU hardware); elsewhere gloo.
    """
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        from tpurec.device import tpu_status
        from tpurec.sharding.dmp import process_group_backend

        # Without a usable TPU, stay on gloo: the device check later names what is missing.
        dist.init_process_group(process_group_backend("tpu" if device == "tpu" and tpu_status().usable else "cpu"))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_device(name: str) -> str:
    from tpurec.device import tpu_status

    if name == "auto":
        return "tpu" if tpu_status().usable else "cpu"
    return name


def check_host_memory(cfg, sizes: list[int], world: int) -> None:
    """Refuse at once, in one line, tables that cannot fit in this host's free memory on CPU
    (criteo-kaggle / mlperf-dcnv2 are sized for TPU slices): better than an OOM kill mid-setup."""
    from tpurec.catalog import get_table_set

    dims = [t.embedding_dim for t in get_table_set(cfg.table_set).tables]
    from tpurec.embedding.optimizers.registry import spec_class

    state_bytes = spec_class(cfg.embedding_optimizer).state_bytes_per_row
    total = sum(n * (d * 4 + state_bytes(d)) for n, d in zip(sizes, dims))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    need = total * local // max(1, world)  # this host's ranks hold their share of the tables
    free = available_bytes()
    if free is None:
        return
    if need > 0.8 * free:
        raise ValueError(
            f"the {cfg.table_set} tables need {need / 2**30:.1f} GiB of weights and optimizer state on "
            f"this host, which has {free / 2**30:.1f} GiB free; use --model dlrm-tiny, data converted "
            f"with smaller tables (tpurec data convert --tables dlrm-tiny), more hosts, or a TPU"
        )


def available_bytes() -> int | None:
    """MemAvailable (free + reclaimable page cache) on Linux, else free pages, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
