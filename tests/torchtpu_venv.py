"""Whether this interpreter is the TorchTPU venv (scripts/tpu_schema_env.sh): torch_tpu and libtpu
installed, and `import torch_tpu` works on this host without a TPU. Tests that need TorchTPU's own code
skip their module with `skip_reason()`; the repository's .venv never has torch_tpu, so there they skip."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

# What `import torch_tpu` needs on a host without a TPU: no autoload, no metadata server, jax on CPU.
NO_TPU_ENV = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPU_SKIP_MDS_QUERY": "1", "JAX_PLATFORMS": "cpu"}


def skip_reason(probe_code: str = "import torch, torch_tpu") -> str | None:
    """Why torch_tpu cannot be imported safely here (`probe_code` run in a child), or None. Never
    imports it in this process."""
    if "torch_tpu" in sys.modules:
        return None
    if importlib.util.find_spec("torch_tpu") is None:
        return "torch_tpu is not installed in this interpreter (run scripts/tpu_schema_env.sh)"
    try:
        importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "torch_tpu is installed but libtpu is not: importing torch_tpu would abort the process"
    # A crash or a hang must not take pytest down: try the import in a child first.
    env = dict(os.environ, **NO_TPU_ENV)
    try:
        probe = subprocess.run([sys.executable, "-c", probe_code], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "`import torch_tpu` hung for 300 s in a subprocess"
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return f"`import torch_tpu` failed in a subprocess (exit {probe.returncode}): {tail}"
    return None
