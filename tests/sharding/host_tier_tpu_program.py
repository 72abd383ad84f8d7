"""The host-tier DMP cases (host_tier_cases.py) on an emulated TPU rank, run by
tests/sharding/test_host_tier_dmp.py under `tpurec launch --emulate-tpu v5e-1 THIS DIR`: the model all
resident, with t0 and t2 on the host tier (LRU, then LFU), and DCP checkpoints moved between the two,
all on device "tpu". Prints one JSON line: per case, its losses, its shards' values and devices, and
its caches' counters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.sharding


def main(directory: str) -> None:
    from tests.sharding import host_tier_cases as c

    steps, first = 30, 20
    runs = {
        "resident": c.train(0, 1, "rowwise_adagrad", None, steps, device="tpu"),
        "LRU": c.train(0, 1, "rowwise_adagrad", "LRU", steps, device="tpu"),
        "LFU": c.train(0, 1, "rowwise_adagrad", "LFU", steps, device="tpu"),
    }
    for name, save, load in (("host_to_resident", "LRU", None), ("resident_to_host", None, "LFU")):
        path = str(Path(directory) / name)
        runs[name] = c.save_then_load(0, 1, "rowwise_adagrad", save, load, path, first, steps - first, device="tpu")
    out = {}
    for name, r in runs.items():
        out[name] = {
            "losses": r["losses"].cpu().tolist(),
            "shards": {
                k: [(o, v.cpu().flatten().tolist(), str(v.device)) for o, v in s] for k, s in r["shards"].items()
            },
            "counters": r["counters"],
            "cached": r["cached"],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
