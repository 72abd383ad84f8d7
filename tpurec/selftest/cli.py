"""`tpurec selftest`: check the kernels on this machine in one command.

--device cpu: the CPU reference against independent oracles (tpurec/embedding/selftest.py).
--device tpu: the first-contact checklist on a TPU host (tpurec/selftest/tpu.py): the chip and its
SparseCore count, TorchTPU's environment, every op against the CPU reference, the module with a CPU
and a device KJT, three Adam steps with the number of programs compiled, a one-rank DMP step on
TorchTPU's backend and the HBM it used against its tables' bytes. tpurec has not run it on TPU
hardware yet.
--device auto: tpu when this host has a usable TPU, else cpu.
--emulate-tpu SLICE: the tpu checklist as one rank of SLICE on this machine's CPU, through TorchTPU's
stand-ins (tpurec.emulation): what the checklist exercises of tpurec, not of the chip.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import TYPE_CHECKING

from tpurec import strict_json
from tpurec.errors import UserError
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:
    from tpurec.embedding.selftest import Check


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="verify the kernels (CPU reference vs oracles, or the TPU first-contact list)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "tpu"],
        default="auto",
        help="cpu: the CPU reference vs oracles; tpu: the first-contact checklist; auto (default): tpu if usable",
    )
    p.add_argument(
        "--emulate-tpu",
        metavar="SLICE",
        default=None,
        help="run the tpu checklist as a rank of SLICE (e.g. v5p-8) emulated on this CPU (docs/tpu.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tables and ids (default 0)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tpurec.runtime import device as dev

    target = args.device
    if args.emulate_tpu:
        if target == DeviceKind.CPU:
            print("tpurec selftest: --emulate-tpu runs the tpu checklist; --device cpu contradicts it")
            return 2
        try:
            checks = _emulated_checks(args.emulate_tpu, args.seed)
        except UserError as e:
            raise UserError(f"--emulate-tpu: {e}") from None
        report(f"tpu (emulated {args.emulate_tpu})", checks, args.json)
        return 0 if all(c.passed for c in checks) else 1
    target = dev.resolve_choice(target)
    if target == DeviceKind.TPU:
        status = dev.tpu_status()
        if not status.usable:
            print(
                "tpurec selftest --device tpu: this host cannot run TPU kernels:\n  - "
                + "\n  - ".join(status.missing(cpu="--device cpu"))
            )
            return 2
        from tpurec.selftest.tpu import tpu_checks

        checks = tpu_checks("tpu", seed=args.seed)
    else:
        from tpurec.embedding.selftest import cpu_checks

        checks = cpu_checks(args.seed)
    report(target, checks, args.json)
    return 0 if all(c.passed for c in checks) else 1


def _emulated_checks(slice_name: str, seed: int) -> list[Check]:
    """The tpu checklist in this process, made rank 0 of one emulated host of `slice_name`."""
    import os

    from tpurec.emulation.launch_env import emulated_launch_env
    from tpurec.planner.topology import parse_slice
    from tpurec.runtime.device import EMULATE_ENV

    spec = parse_slice(slice_name)
    launch = emulated_launch_env(spec)[0]
    one_rank = launch["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[0]
    os.environ.update(
        {k: v for k, v in launch.items() if k.startswith("TORCH_TPU_")},
        TORCH_TPU_SLICEBUILDER_ADDRESSES=one_rank,  # this process is the only rank
        LOCAL_RANK="0",
        **{
            EMULATE_ENV: spec.name,
            "TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS": os.environ.get("TORCH_TPU_ALLOW_LEGACY_DEVICE_APIS", "1"),
        },
    )
    from tpurec.emulation.rank import activate
    from tpurec.selftest.tpu import tpu_checks

    activate(spec.name)
    return tpu_checks("tpu", generation=spec.generation.name, seed=seed)


def report(target: str, checks: list[Check], as_json: bool) -> None:
    if as_json:
        doc = {"device": target, "passed": all(c.passed for c in checks), "checks": [asdict(c) for c in checks]}
        print(strict_json.dumps(doc, indent=2))
        return
    print(f"tpurec selftest on {target}")
    print(f"{'check':<44} {'result':<6} {'max error':>10} {'tolerance':>10}  note")
    for c in checks:
        print(f"{c.name:<44} {'PASS' if c.passed else 'FAIL':<6} {c.max_error:>10.2e} {c.tolerance:>10.1e}  {c.note}")
    print("all passed" if all(c.passed for c in checks) else "FAILURES above")
