"""TorchTPU's real `set_tpu_launch_env()` on each host of v5p-8, v5p-16 and v6e-16, against the
emulation's launch environment for the same host.

Runs only in the TorchTPU venv (scripts/tpu_schema_env.sh runs it); skipped everywhere else. Each host
is a child process (TorchTPU memoizes what it reads from the environment, once per process) in which
the PCI scan of `torch_tpu/_internal/utils/hardware.py` reports that host's devices; everything else is
torch-tpu 0.2.0's own code. The host is given what a Cloud TPU VM gives it, derived as tpurec's real
launch derives it (`cloud_tpu_host_env`, from the emulated metadata server). The emulation must then
agree on every variable but one: MASTER_PORT, which it pins from the outside to an unused port of this
machine (TorchTPU says 29500; several emulations may share the machine), and, on one host, the
`localhost:<unused port>` ports TorchTPU and the emulation each pick.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.torchtpu_venv import NO_TPU_ENV, skip_reason

_reason = skip_reason()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

from tpurec.emulation.launch_env import emulated_launch_env, emulated_metadata  # noqa: E402
from tpurec.planner.topology import parse_slice  # noqa: E402
from tpurec.runtime.tpu_vm import cloud_tpu_host_env  # noqa: E402

CHILD = """
import json, os, sys
devices, generation, nnodes = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
import torch_tpu
from torch_tpu._internal.utils import hardware
table = {"v5p": hardware._V5P_TOPOLOGY, "v6e": hardware._V6E_TOPOLOGY, "v7x": hardware._V7_TOPOLOGY}[generation]
hardware._scan_pci_tpus = lambda: (devices, table)  # this host's TPUs on PCI: the one stand-in
from torch_tpu._internal.distributed import distributed
before = dict(os.environ)
try:
    distributed.set_tpu_launch_env(nnodes=nnodes)
except ValueError as e:
    print("ERROR=" + str(e))
else:
    print("SET=" + json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))
"""
_LAUNCH = re.compile(r"^(TORCH_TPU_.*|TPU_WORKER_.*|JOB_COMPLETION_INDEX|NNODES|NODE_RANK|MASTER_ADDR|MASTER_PORT)$")


def real_set_tpu_launch_env(given: dict[str, str], devices: int, generation: str, nnodes: int) -> dict[str, str]:
    """What TorchTPU's set_tpu_launch_env(nnodes=) sets on a host with `given` in its environment
    (a ValueError's message under the key "ValueError")."""
    env = {k: v for k, v in os.environ.items() if not _LAUNCH.match(k)}
    env.update(given, **NO_TPU_ENV, PYTHONWARNINGS="ignore")
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(devices), generation, str(nnodes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in reversed(p.stdout.splitlines()) if x.startswith(("SET=", "ERROR=")))
    if line.startswith("ERROR="):
        return {"ValueError": line[len("ERROR=") :]}
    return json.loads(line[len("SET=") :])


@pytest.mark.parametrize("name", ["v5p-8", "v5p-16", "v6e-16"])
def test_each_emulated_host_has_what_torchtpu_sets_on_that_host(name):
    spec = parse_slice(name)
    emulated = emulated_launch_env(spec, session="42")
    assert len(emulated) == spec.hosts
    pinned = emulated[0].get("MASTER_PORT")
    for host, mine in enumerate(emulated):
        # What the Cloud TPU VM gives this host, as tpurec's real launch derives it.
        given = cloud_tpu_host_env(spec.hosts, {}, emulated_metadata(spec, host))
        real = real_set_tpu_launch_env(
            dict(given, TORCH_TPU_XPROF_SESSION_ID="42"), spec.devices_per_host, spec.generation.name, spec.hosts
        )
        real = dict(given, TORCH_TPU_XPROF_SESSION_ID="42", **real)
        if spec.hosts == 1:
            # localhost:<unused port> per rank: each side picks its own ports.
            for env in (real, mine):
                addresses = env.pop("TORCH_TPU_SLICEBUILDER_ADDRESSES").split(",")
                assert len(addresses) == spec.devices_per_host and all(
                    re.fullmatch(r"localhost:\d+", a) for a in addresses
                )
            assert "MASTER_PORT" not in real and "MASTER_PORT" not in mine
        else:
            assert real.pop("MASTER_PORT") == "29500"
            assert mine.pop("MASTER_PORT") == pinned  # pinned, the same on every host
        assert mine == real, f"{name} host {host}"


def test_torchtpu_keeps_the_emulations_pinned_master_port():
    spec = parse_slice("v5p-16")
    mine = emulated_launch_env(spec, session="42")[1]
    given = dict(cloud_tpu_host_env(2, {}, emulated_metadata(spec, 1)), TORCH_TPU_XPROF_SESSION_ID="42")
    given["MASTER_PORT"] = mine["MASTER_PORT"]
    assert dict(given, **real_set_tpu_launch_env(given, 4, "v5p", 2)) == mine


def test_without_the_worker_id_torchtpu_refuses_a_multi_host_launch():
    # What docs/tpu_vm.md's multi-host recipe used to give a host: only TPU_WORKER_HOSTNAMES.
    real = real_set_tpu_launch_env({"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"}, 4, "v5p", 2)
    assert "JOB_COMPLETION_INDEX" in real["ValueError"] and "to determine NODE_RANK" in real["ValueError"]
    # ... and one without the hostnames.
    real = real_set_tpu_launch_env({"JOB_COMPLETION_INDEX": "1"}, 4, "v5p", 2)
    assert "TPU_WORKER_HOSTNAMES" in real["ValueError"]


def test_a_completion_index_on_one_host_puts_torchtpu_on_its_multi_host_path():
    # Why cloud_tpu_host_env gives a single host nothing.
    assert cloud_tpu_host_env(1, {}, emulated_metadata(parse_slice("v5p-8"), 0)) == {}
    real = real_set_tpu_launch_env({"JOB_COMPLETION_INDEX": "0", "TPU_WORKER_HOSTNAMES": "10.0.0.1"}, 4, "v5p", 1)
    assert real["NODE_RANK"] == "0" and real["TORCH_TPU_SLICEBUILDER_ADDRESSES"].startswith("10.0.0.1:8070,")
