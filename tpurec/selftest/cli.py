"""`tpurec selftest`: check the kernels on this machine in one command.

--device cpu: the CPU reference against independent oracles (tpurec/embedding/selftest.py).
--device tpu: the first-contact checklist on a TPU host (tpurec/selftest/tpu.py): the chip and its
SparseCore count, TorchTPU's environment, every op against the CPU reference, the module with a CPU
and a device KJT, three Adam steps with the number of programs compiled, a one-rank DMP step on
TorchTPU's backend and the HBM it used against its tables' bytes. tpurec has not run it on TPU
hardware yet.
--device auto: tpu when this host has a usable TPU, else cpu.
"""

from __future__ import annotations

import json
from dataclasses import asdict


def register(sub) -> None:
    p = sub.add_parser("selftest", help="verify the kernels (CPU reference vs oracles, or the TPU first-contact list)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "tpu"],
        default="auto",
        help="cpu: the CPU reference vs oracles; tpu: the first-contact checklist; auto (default): tpu if usable",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tables and ids (default 0)")
    p.set_defaults(run=run)


def run(args) -> int:
    from tpurec import device as dev

    target = args.device
    if target == "auto":
        target = "tpu" if dev.tpu_status().usable else "cpu"
    if target == "tpu":
        status = dev.tpu_status()
        if not status.usable:
            print(
                "tpurec selftest --device tpu: this host cannot run TPU kernels:\n  - "
                + "\n  - ".join(status.missing())
            )
            return 2
        from tpurec.selftest.tpu import tpu_checks

        checks = tpu_checks("tpu", seed=args.seed)
    else:
        from tpurec.embedding.selftest import cpu_checks

        checks = cpu_checks(args.seed)
    report(target, checks, args.json)
    return 0 if all(c.passed for c in checks) else 1


def report(target: str, checks, as_json: bool) -> None:
    if as_json:
        doc = {"device": target, "passed": all(c.passed for c in checks), "checks": [asdict(c) for c in checks]}
        print(json.dumps(doc, indent=2))
        return
    print(f"tpurec selftest on {target}")
    print(f"{'check':<44} {'result':<6} {'max error':>10} {'tolerance':>10}  note")
    for c in checks:
        print(f"{c.name:<44} {'PASS' if c.passed else 'FAIL':<6} {c.max_error:>10.2e} {c.tolerance:>10.1e}  {c.note}")
    print("all passed" if all(c.passed for c in checks) else "FAILURES above")
