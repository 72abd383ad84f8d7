"""`tpurec env`: versions and TPU readiness, for bug reports.

Reads installed versions from package metadata, so it never imports torch_tpu, libtpu or jax.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys

from tpurec import __version__, strict_json
from tpurec.runtime import device

_PACKAGES = (
    "torch",
    "torchrec",
    "fbgemm-gpu-cpu",
    "fbgemm-gpu",
    "torch-tpu",
    "libtpu",
    "jax",
    "numpy",
    "numba",
    "pyarrow",
)


# What torch-tpu 0.2.0 asks of libtpu: >= 0.0.50, in a major.minor.patch version its loader can parse.
LIBTPU_MIN = (0, 0, 50)


def libtpu_problem(version: str | None) -> str | None:
    """Why torch-tpu 0.2.0 would not take this libtpu version, or None (also when libtpu is not installed).
    On the v5e chip JAX's libtpu 0.0.42.1 was older and had 4 parts (../shared/tpu-vm/README.md)."""
    if version is None:
        return None
    found = re.match(r"\d+(?:\.\d+)*", version)
    parts = tuple(int(p) for p in found.group(0).split(".")) if found else ()
    why = []
    if parts[:3] < LIBTPU_MIN:
        why.append("is older than the 0.0.50 torch-tpu 0.2.0 asks")
    if len(parts) != 3:
        why.append(f"has {len(parts)} parts, where torch-tpu 0.2.0's loader parses only 3 (major.minor.patch)")
    if not why:
        return None
    return f"libtpu {version} " + " and ".join(why) + ": .venv/bin/pip install -r requirements/tpu.txt"


def collect() -> dict:
    status = device.tpu_status()
    return {
        "tpurec": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: device._installed(name) for name in _PACKAGES},
        "torch_tpu_installed": bool(status.torch_tpu),
        "libtpu_installed": bool(status.libtpu),
        "tpu_device_nodes": list(status.device_nodes),
        "tpu_usable": status.usable,
        "kernel_backend": device.kernel_backend(),
        "missing_for_tpu": status.missing(),
        "libtpu_problem": libtpu_problem(status.libtpu),
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print versions, TPU readiness and the kernel backend that would run")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(strict_json.dumps(info, indent=2))
        return 0
    print(f"tpurec        {info['tpurec']}")
    print(f"python        {info['python']} ({info['platform']})")
    for name, ver in info["packages"].items():
        print(f"{name:<13} {ver or 'not installed'}")
    print(f"TPU devices   {', '.join(info['tpu_device_nodes']) or 'none'}")
    print(
        f"kernels       {info['kernel_backend']}"
        + ("" if info["tpu_usable"] else "  (SparseCore needs: " + "; ".join(info["missing_for_tpu"]) + ")")
    )
    if info["libtpu_problem"]:
        print(f"warning: {info['libtpu_problem']}", file=sys.stderr)
    if info["packages"]["fbgemm-gpu"]:
        print(
            "warning: the CUDA fbgemm-gpu is installed; it shadows fbgemm-gpu-cpu (see docs/install.md)",
            file=sys.stderr,
        )
    return 0
