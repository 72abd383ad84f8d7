"""The end-of-run checks of a user's program under `tpurec launch`, as `tpurec train` reports its own.

`tpurec train` knows its steps; a user's program does not tell them. Here a training step is a
forward of `tpurec.DistributedModelParallel` in training mode with gradients on (an evaluation pass
any other forward):
the DMP calls `forward(training)` (`tpurec/sharding/dmp.py`), which counts them and hands each to the
hooks a layer above registered (the emulated TPU rank starts its phase there, `tpurec.emulation.rank`,
unless the program marks its steps itself). When the program ends, `tpurec.runtime.run_script` writes
this rank's figures (`write`) into the launcher's run directory (`tpurec.runtime.group_watch.WATCH_ENV`):
its training steps, tpurec's own device->host copies per step (`tpurec.runtime.host_copies`), and what
the registered providers add (the emulated device's programs, recompiles after warm-up and every copy
off it). The launcher reads them all (`collect`) and prints one line (`summary`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from tpurec import strict_json
from tpurec.runtime import host_copies
from tpurec.runtime.group_watch import WATCH_ENV

_PREFIX = "figures-"
_steps: Counter = Counter()  # forwards of tpurec's DMP by kind: "train", "eval"
_step_hooks: list[Callable[[str], None]] = []
_providers: list[Callable[[], dict[str, Any]]] = []


def on_step(hook: Callable[[str], None]) -> None:
    """Call `hook(kind)` at every DMP forward ("train" or "eval")."""
    if hook not in _step_hooks:
        _step_hooks.append(hook)


def provide(figures: Callable[[], dict[str, Any]]) -> None:
    """Add what `figures()` returns to this rank's figures at the end of the program."""
    if figures not in _providers:
        _providers.append(figures)


def forward(training: bool) -> None:
    """A forward of tpurec's DMP: a training step (`training`), or a pass of an evaluation."""
    kind = "train" if training else "eval"
    _steps[kind] += 1
    for hook in _step_hooks:
        hook(kind)


def figures() -> dict[str, Any]:
    """This rank's figures so far."""
    steps = _steps["train"]
    copies = host_copies.counts()
    out: dict[str, Any] = {
        "steps": steps,
        "eval_forwards": _steps["eval"],
        "device_to_host_copies_per_step": round(sum(copies.values()) / max(1, steps), 4),
        "device_to_host_copies": dict(sorted(copies.items())),
    }
    for provider in _providers:
        out.update(provider())
    return out


def write() -> None:
    """This rank's figures into the launcher's run directory (none outside a tpurec launcher)."""
    where, rank = os.environ.get(WATCH_ENV), os.environ.get("RANK")
    if not where or rank is None:
        return
    path = os.path.join(where, f"{_PREFIX}{rank}")
    try:  # whole or not at all
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(strict_json.dumps(figures()))
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher gone: nobody to tell


def collect(where: str) -> dict[int, dict[str, Any]]:
    """Every rank's figures in the run directory `where`, by rank."""
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(where)
    except OSError:
        return out
    for name in names:
        rank = name[len(_PREFIX) :]
        if not name.startswith(_PREFIX) or not rank.isdigit():
            continue
        try:
            with open(os.path.join(where, name), encoding="utf-8") as f:
                out[int(rank)] = json.load(f)
        except (OSError, ValueError):
            continue
    return out


def summary(command: str, by_rank: dict[int, dict[str, Any]], hosts: int, slice_name: str | None) -> str | None:
    """The launcher's end-of-run line, as `tpurec train`'s result reports them: ranks and hosts,
    training steps, programs compiled (rank 0's), recompiles after warm-up and device->host copies
    per step (the most of any rank); None when no rank reported."""
    if not by_rank:
        return None
    first = by_rank[min(by_rank)]
    where = f"emulated {slice_name}" if slice_name else "TPU"
    parts = [f"{len(by_rank)} rank(s) on {hosts} host(s) ({where}), {first['steps']} training step(s)"]
    programs = first.get("programs_compiled")
    if (
        programs is not None
        and not any(programs["sparsecore"].values())
        and not programs["tensorcore"]
        and not programs.get("compiled")
    ):
        return f"{command}: " + parts[0] + "; nothing ran on the emulated TPU (the program's device was not 'tpu')"
    if programs is None:
        parts.append("programs compiled and recompiles not measured (TorchTPU 0.2.0 exposes no count)")
    else:
        sc = sum(programs["sparsecore"].values())
        graphs = programs.get("compiled", 0)  # a torch.compile graph's programs (emulation/compiled.py)
        total = sc + programs["tensorcore"] + programs["collective"] + graphs
        parts.append(
            f"{total} programs compiled (sparsecore {sc}, tensorcore {programs['tensorcore']}, "
            f"collective {programs['collective']}" + (f", from compiled graphs {graphs}" if graphs else "") + ")"
        )
        if first.get("graphs_compiled"):
            parts.append(f"{first['graphs_compiled']} graph(s) compiled, {first.get('graph_breaks', 0)} graph break(s)")
        if first.get("handshake_stage"):  # emulation/handshake.py: graphs kept whole or split at collectives
            parts.append(
                f"handshakes ({first['handshake_stage']}): {first['handshakes_agreed']} agreed, "
                f"{first['handshakes_split']} split"
            )
        worst = max(r.get("recompiles_after_warmup", 0) for r in by_rank.values())
        ops = first.get("recompiled_ops") or {}
        parts.append(f"{worst} recompile(s) after warm-up" + (f" ({', '.join(ops)})" if ops else ""))
    most = max(by_rank.values(), key=lambda r: r["device_to_host_copies_per_step"])
    sites = ", ".join(f"{site} {n}" for site, n in most["device_to_host_copies"].items())
    parts.append(
        f"{most['device_to_host_copies_per_step']:g} device->host copies per step" + (f" ({sites})" if sites else "")
    )
    return f"{command}: " + "; ".join(parts)
