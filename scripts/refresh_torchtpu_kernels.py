"""Regenerates tpurec/emulation/torchtpu_kernels.json: which ops TorchTPU serves on its device.

Runs in the TorchTPU venv (torch-tpu 0.2.0 + libtpu, never the repository's .venv), no TPU needed:

    bash scripts/tpu_schema_env.sh --co -q      # makes ../tpu-venv once (a few minutes, ~6 GB)
    ../tpu-venv/bin/python scripts/refresh_torchtpu_kernels.py [--out PATH]

How: with TORCH_DEVICE_BACKEND_AUTOLOAD=0 and TPU_SKIP_MDS_QUERY=1, `import torch_tpu` loads its glue
library, whose static initialisers register every TorchTPU kernel with the dispatcher (TORCH_LIBRARY_IMPL
in `csrc/eager/tpu_aten_kernels.cc`), without initialising a device. fbgemm_gpu and torchrec are then
imported so their ops exist too. For every operator, `torch._C._dispatch_dump_table(op)` prints the
kernel the dispatcher computed for the PrivateUse1 key (TorchTPU's "tpu" device), which says what a
call on a TPU tensor reaches:

* `kernel_ops`: a kernel registered for PrivateUse1 by TorchTPU itself (`csrc/...`);
* `torch_kernel_ops`: a PrivateUse1 kernel that torch registers for every backend (c10d's ops, which
  hand the call to the process group's backend for the device: tpu_dist's ProcessGroupTpu);
* `composite_ops`: no TPU kernel; torch's CompositeExplicitAutograd(NonFunctional) kernel serves every
  backend by calling other ops (for example `add.Tensor` calls `add.out`, which TorchTPU has), each of
  which is dispatched again;
* `decomposed_ops`: CompositeImplicitAutograd: decomposed into other ops above the backend;
* `fallback_ops`: TorchTPU's missing-op fallback (a boxed PrivateUse1 backend fallback): the call raises
  `fallback.message` while `enable_cpu_fallback` is False (the default).
An op of a library not imported here (tpurec's own, for instance) has no TPU kernel: it reaches the
fallback unless it registers a kernel of its own. The fallback's message is read by calling it on a
CPU tensor (`redispatch` to the PrivateUse1 key), which needs no device.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

for _key, _value in (("TORCH_DEVICE_BACKEND_AUTOLOAD", "0"), ("TPU_SKIP_MDS_QUERY", "1"), ("JAX_PLATFORMS", "cpu")):
    os.environ[_key] = _value
os.environ.setdefault("PYTHONWARNINGS", "ignore:<TorchTpu/Performance/TcMalloc/")

OUT = Path(__file__).resolve().parent.parent / "tpurec" / "emulation" / "torchtpu_kernels.json"
# The operator namespaces a TorchRec model on TPU reaches; the rest (quantized, prims, mkldnn, ...) are
# left out to keep the file small.
NAMESPACES = (
    "aten",
    "fbgemm",
    "c10d",
    "_c10d_functional",
    "_c10d_functional_autograd",
    "c10d_functional",
    "torchrec",
    "tpu",
)
_ENTRY = re.compile(
    r"^(?P<key>\w+): (?P<fallthrough>fallthrough )?registered (?:at|by) (?P<where>\S+)[^\[]*\[(?P<kind>[^\]]+)\]"
)
_PROBE_OP = "aten::unique_dim"


def _entry(table: str, key: str) -> dict[str, str] | None:
    for line in table.splitlines():
        m = _ENTRY.match(line)
        if m and m["key"] == key:
            return {"kind": ("fallthrough " if m["fallthrough"] else "") + m["kind"], "where": m["where"]}
    return None


def _own(where: str) -> bool:
    """Registered by TorchTPU's glue (its sources are named relative to its tree: `csrc/...`)."""
    return where.startswith("csrc/")


def _fallback_message() -> str:
    """The fallback's own words, from calling it: `redispatch` of a CPU tensor to the PrivateUse1 key."""
    import torch

    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
    try:
        torch.ops.aten.unique_dim.default.redispatch(keys, torch.arange(6).reshape(2, 3), 0)
    except RuntimeError as e:
        return str(e).replace(_PROBE_OP, "{op}")
    raise SystemExit(f"{_PROBE_OP} did not reach TorchTPU's missing-op fallback")


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else OUT
    import fbgemm_gpu  # noqa: F401  (the fbgemm:: ops TorchRec calls)
    import torch
    import torch_tpu  # noqa: F401  (registers TorchTPU's kernels; no device is initialised)
    import torchrec  # noqa: F401  (torchrec:: ops)
    from torch_tpu._internal import execution_mode

    groups: dict[str, list[str]] = {
        k: [] for k in ("kernel_ops", "torch_kernel_ops", "composite_ops", "decomposed_ops", "fallback_ops")
    }
    torch_kernel_sources: dict[str, str] = {}
    fallback_where: set[str] = set()
    autograd_kernels: list[str] = []
    autograd_fallback: set[str] = set()
    other: dict[str, str] = {}
    for op in sorted(torch._C._dispatch_get_all_op_names()):
        if op.split("::")[0] not in NAMESPACES:
            continue
        table = torch._C._dispatch_dump_table(op)
        e = _entry(table, "PrivateUse1")
        if e is None:
            other[op] = "no PrivateUse1 entry"
            continue
        kind, where = e["kind"], e["where"]
        if kind == "kernel" and _own(where):
            groups["kernel_ops"].append(op)
        elif kind == "kernel":
            groups["torch_kernel_ops"].append(op)
            torch_kernel_sources[op] = where.split("/pytorch/pytorch/")[-1].split("site-packages/")[-1]
        elif kind == "default backend kernel":
            groups["composite_ops"].append(op)
        elif kind == "math kernel":
            groups["decomposed_ops"].append(op)
        elif kind == "backend fallback" and _own(where):
            groups["fallback_ops"].append(op)
            fallback_where.add(where)
        else:
            other[op] = f"{kind} at {where}"
        a = _entry(table, "AutogradPrivateUse1")
        if a and _own(a["where"]):
            if a["kind"] == "kernel":
                autograd_kernels.append(op)
            elif a["kind"].endswith("backend fallback"):
                autograd_fallback.add(f"{a['kind']} at {a['where']}")

    keys = torch._C.DispatchKey
    versions = {
        name: importlib.metadata.version(name)
        for name in ("torch-tpu", "torch", "libtpu", "fbgemm-gpu-cpu", "torchrec")
    }
    data = {
        "source": (
            "scripts/refresh_torchtpu_kernels.py in the TorchTPU venv (scripts/tpu_schema_env.sh), on "
            f"{datetime.date.today().isoformat()}: import torch_tpu with TORCH_DEVICE_BACKEND_AUTOLOAD=0 and "
            "TPU_SKIP_MDS_QUERY=1 (no device initialised), then fbgemm_gpu and torchrec; for every op of the "
            "namespaces below, the PrivateUse1 entry of torch._C._dispatch_dump_table(op)"
        ),
        "versions": versions,
        "namespaces": list(NAMESPACES),
        "fallback": {
            "message": _fallback_message(),
            "registered_at": sorted(fallback_where),
            "privateuse1_backend_fallback": torch._C._dispatch_has_backend_fallback(keys.PrivateUse1),
            "enable_cpu_fallback_default": bool(execution_mode.enable_cpu_fallback),
            "with_cpu_fallback": (
                "torch_tpu._internal.execution_mode.enable_cpu_fallback = True: the op runs on CPU "
                "(at::native::cpu_fallback) after the logged warning \"operator '{op}' is not implemented for "
                'TPU. Falling back to CPU" (tpu_aten_kernels.cc:1142, seen by calling the fallback so)'
            ),
            "rule": "an op not listed in kernel_ops, torch_kernel_ops, composite_ops or decomposed_ops reaches it",
        },
        "autograd": {
            "fallback": sorted(autograd_fallback),
            "kernel_ops": autograd_kernels,
            "note": (
                "AutogradPrivateUse1: TorchTPU registers a fallthrough backend fallback, so ops keep torch's "
                "own autograd kernels (VariableType); kernel_ops here are TorchTPU's own autograd kernels"
            ),
        },
        "torch_kernel_sources": torch_kernel_sources,
        **groups,
    }
    if other:
        data["other"] = other
    if OUT.exists() and "chip_aborts" in json.loads(OUT.read_text()):
        # What a chip aborted on: measured on hardware, not in the dispatcher; kept as it was.
        data["chip_aborts"] = json.loads(OUT.read_text())["chip_aborts"]
    out.write_text(_dump(data))
    counts = ", ".join(f"{k} {len(v)}" for k, v in groups.items())
    print(f"wrote {out} ({counts})", file=sys.stderr)


def _dump(data: dict[str, object]) -> str:
    """JSON with one list item (one op) per line, so a refresh diffs op by op."""
    lines = ["{"]
    items = list(data.items())
    for i, (key, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if isinstance(value, list) and value:
            body = ",\n".join(f"    {json.dumps(v)}" for v in value)
            lines.append(f"  {json.dumps(key)}: [\n{body}\n  ]{comma}")
        elif isinstance(value, dict) and value:
            body = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f"  {json.dumps(key)}: {{\n{body}\n  }}{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    return "\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    main()
