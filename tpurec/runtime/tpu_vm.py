"""A Cloud TPU VM's place in its slice: this host's worker id and the slice's hosts, as TorchTPU's
launch needs them.

torch-tpu 0.2.0's `set_tpu_launch_env(nnodes=H)` (`torch_tpu/_internal/distributed/distributed.py`)
takes this host's rank from `JOB_COMPLETION_INDEX` (or from its chips' coordinates in a slice-wide
`TORCH_TPU_TOPOLOGY` set from the outside) and the hosts from `TPU_WORKER_HOSTNAMES`, and raises
ValueError without them. A VM made by `gcloud compute tpus tpu-vm create` has neither variable: its
metadata server holds them. GKE sets `TPU_WORKER_ID` and `TPU_WORKER_HOSTNAMES` (and
`JOB_COMPLETION_INDEX` in an Indexed Job). `cloud_tpu_host_env` turns whichever this host has into what
TorchTPU reads; the real launch (`tpurec.launch.hosts`) and the emulated one
(`tpurec.emulation.launch_env`, with a metadata server of its own) both use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from tpurec.errors import UserError

# Where a Cloud TPU VM keeps its place in the slice (what JAX reads: jax/_src/clusters/cloud_tpu_cluster.py,
# GceTpuCluster): the metadata server's instance attributes. GKE injects TPU_WORKER_ID and
# TPU_WORKER_HOSTNAMES as environment variables instead (and JOB_COMPLETION_INDEX in an Indexed Job).
_METADATA_URL = "http://{host}/computeMetadata/v1/instance/attributes/{key}"


def gce_metadata(key: str) -> str | None:
    """A Cloud TPU VM's metadata attribute `key`, or None (absent, no metadata server, or
    TPU_SKIP_MDS_QUERY set: JAX's GceTpuCluster does not ask then either)."""
    import urllib.error
    import urllib.request

    if os.environ.get("TPU_SKIP_MDS_QUERY"):
        return None
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(_METADATA_URL.format(host=host, key=key), headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.read().decode().strip() or None
    except (OSError, urllib.error.URLError):
        return None


def worker_hostnames(endpoints: str) -> str:
    """TPU_WORKER_HOSTNAMES from the metadata's `worker-network-endpoints`: bare hostnames, or the
    older `name:id:ip` triples (the ip), as JAX reads them."""
    names = []
    for worker in endpoints.split(","):
        parts = worker.split(":")
        if len(parts) not in (1, 3):
            raise UserError(f"unsupported worker-network-endpoints entry {worker!r} in the TPU VM's metadata")
        names.append(parts[-1])
    return ",".join(names)


def cloud_tpu_host_env(
    nnodes: int, environ: Mapping[str, str], metadata: Callable[[str], str | None] | None = None
) -> dict[str, str]:
    """What this host of an `nnodes`-host slice must give TorchTPU's `set_tpu_launch_env(nnodes=)`, which
    takes NODE_RANK from JOB_COMPLETION_INDEX (or the chips' coordinates in a slice-wide
    TORCH_TPU_TOPOLOGY set from the outside) and the hosts from TPU_WORKER_HOSTNAMES, and raises
    ValueError without them. A Cloud TPU VM sets neither: the worker id is TPU_WORKER_ID (GKE) or the
    metadata server's `agent-worker-number`, the hosts TPU_WORKER_HOSTNAMES (GKE) or its
    `worker-network-endpoints`. Variables already in `environ` are kept. One host: nothing (a
    JOB_COMPLETION_INDEX there would put TorchTPU on its multi-host path). `metadata(key)` answers for
    the metadata server (default `gce_metadata`)."""
    if nnodes <= 1:
        return {}
    metadata = metadata or gce_metadata
    out: dict[str, str] = {}
    if "TPU_WORKER_HOSTNAMES" not in environ:
        endpoints = metadata("worker-network-endpoints")
        if not endpoints:
            raise UserError(
                "this host's slice is unknown: TPU_WORKER_HOSTNAMES is unset and the TPU VM's metadata server "
                "gave no worker-network-endpoints; set TPU_WORKER_HOSTNAMES to the slice's hosts, comma-separated"
            )
        out["TPU_WORKER_HOSTNAMES"] = worker_hostnames(endpoints)
    if "NODE_RANK" not in environ and "JOB_COMPLETION_INDEX" not in environ:
        worker = environ.get("TPU_WORKER_ID") or metadata("agent-worker-number")
        if worker is None:
            raise UserError(
                "this host's index in the slice is unknown: JOB_COMPLETION_INDEX and TPU_WORKER_ID are unset and "
                "the TPU VM's metadata server gave no agent-worker-number; set TPU_WORKER_ID (0 on the first host)"
            )
        out["JOB_COMPLETION_INDEX"] = str(int(worker))
    return out
