"""TorchTPU's handshake of compiled collective graphs across ranks, emulated through the c10d store.

torch-tpu 0.2.0 (`_internal/compile/split_compiler.py`, `_internal/distributed/handshake.py`; docs/tpu.md):
when its backend compiles a graph holding collectives of the global group, and
`TORCH_TPU_SPMD_HANDSHAKE_STAGE` is set, every rank sends the graph's fingerprint and its running count of
compiled collectives to a coordinator on rank 0 and waits for the verdict. All equal: the graph is one
program, its collectives inside it; else it is split at each collective (what it always is with the
variable unset, `OFF`). `COMPILE_STAGE` handshakes once, when the graph compiles (fingerprint: its code);
`DISPATCH_STAGE` compiles it whole and handshakes at every run (fingerprint: the executables) until a
mismatch recompiles it split. A rank that never submits leaves the others waiting until their socket
times out (`TORCH_TPU_INTERNAL_HANDSHAKE_TIMEOUT_S`, 60 s).

Here each submission is a key of the default process group's store (`tpurec/handshake/<n>/<rank>`, n
counting this process's submissions), and the verdict is every rank's key being equal. What is not
emulated: the fingerprint itself (XLA's, of TorchTPU's graph after its own passes) is a hash of the
graph's code as this emulation traces it (and, for DISPATCH_STAGE, of its input shapes), so ranks agree
here exactly when their traced graphs are the same text.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import Counter
from datetime import timedelta

from tpurec.emulation.rule_error import TorchTpuRuleError
from tpurec.runtime.device import HANDSHAKE_STAGE_ENV

STAGE_ENV = HANDSHAKE_STAGE_ENV
TIMEOUT_ENV = "TORCH_TPU_INTERNAL_HANDSHAKE_TIMEOUT_S"
STAGES = ("OFF", "COMPILE_STAGE", "DISPATCH_STAGE")  # TorchTPU's HandshakeStage enum, values 0, 1, 2
DEFAULT_TIMEOUT_S = 60  # handshake.py `_get_handshake_timeout_s`

# This process's running count of compiled collectives (TorchTPU's `_RANK_COLLECTIVE_COUNTS`), its
# submissions so far, and their verdicts ("agreed", "split").
_COLLECTIVES = Counter[str]()
_ROUND = itertools.count()
VERDICTS = Counter[str]()


def stage() -> str:
    """The handshake stage this process runs with: the variable, `OFF` when unset. TorchTPU aborts the
    process on any other value (its C++ reader's "Invalid value for" check), the empty string included."""
    value = os.environ.get(STAGE_ENV)
    if value is None:
        return "OFF"
    if value not in STAGES:
        raise TorchTpuRuleError(
            f"Invalid value for {STAGE_ENV}: {value!r} (TorchTPU aborts the process; one of {', '.join(STAGES)}, "
            "or unset for OFF)"
        )
    return value


def timeout_s() -> int:
    """The handshake's wait, in seconds (`TORCH_TPU_INTERNAL_HANDSHAKE_TIMEOUT_S`, 60 by default)."""
    raw = os.environ.get(TIMEOUT_ENV)
    value = DEFAULT_TIMEOUT_S if raw is None else int(raw)
    if value < 0:  # TorchTPU's own check, word for word
        raise ValueError(f"{TIMEOUT_ENV} must be non-negative, got {value}.")
    return value


def fingerprint(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def submit(graph_fingerprint: str, collectives: int) -> bool:
    """One handshake: this rank's fingerprint and running collective count against every rank's. True
    when all are equal (the graph stays whole), False when any differs (it is split at its collectives)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    _COLLECTIVES["global"] += collectives
    n = next(_ROUND)
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _get_default_store()
    keys = [f"tpurec/handshake/{n}/{r}" for r in range(world)]
    store.set(keys[rank], f"{graph_fingerprint}/{_COLLECTIVES['global']}")
    wait = timeout_s()
    try:
        store.wait(keys, timedelta(seconds=wait))
    except Exception as e:  # the store's timeout: DistStoreError (a RuntimeError) on this torch
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TorchTpuRuleError(
            f"the compiled-collective handshake ({STAGE_ENV}={stage()}) of graph {n} on rank {rank} waited {wait} s "
            f"for rank(s) {missing}, which compiled or ran no such graph: every rank must compile and run the "
            f"same collective graphs in the same order (TorchTPU's handshake socket times out after {TIMEOUT_ENV} "
            f"seconds) [{type(e).__name__}]"
        ) from None
    seen = {store.get(key).decode() for key in keys}
    agreed = len(seen) == 1
    VERDICTS["agreed" if agreed else "split"] += 1
    return agreed


def figures() -> dict[str, object]:
    """The result line's handshake figures: none with the stage OFF (nothing is handshaken)."""
    if stage() == "OFF":
        return {}
    return {
        "handshake_stage": stage(),
        "handshakes_agreed": VERDICTS["agreed"],
        "handshakes_split": VERDICTS["split"],
    }
