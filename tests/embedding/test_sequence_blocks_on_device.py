"""A sequence batch over its fixed capacity on the emulated TPU device: it runs in capacity-sized blocks
(tpurec/embedding/sequence_kernel.py, multipass.stacked_blocks), each block a lookup of the fixed
shapes. Its output has blocks x capacity rows, so a batch of a block count not seen before compiles the
programs of that count once (inherent: the output is bigger); every later batch of a seen count,
within the capacity or over it, compiles nothing (docs/sequence.md, "Capacity").

The device renames PrivateUse1 for the whole process, so the module trains in a fresh interpreter made
an emulated rank (as tests/embedding/test_fixed_programs_on_device.py does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import json, torch
    import tpurec  # an emulated rank: the device is installed here
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection
    from tpurec.emulation import device

    TABLES = [EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=300, feature_names=["fa", "fb"])]
    KEYS, BATCH, CAP = ["fa", "fb"], 16, 24
    # the longest history per step: 1-2 fit CAP ids per feature, 4 needs about 2 blocks, 8 about 3
    LONGEST = [1, 2, 1, 4, 2, 4, 1, 8, 4, 8, 2]

    def batch(step, gen):
        lengths = torch.randint(0, LONGEST[step] + 1, (len(KEYS) * BATCH,), generator=gen)
        values = torch.randint(0, 300, (int(lengths.sum()),), generator=gen)
        return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)

    log, tables = [], {}
    for dev in ("cpu", "tpu"):
        torch.manual_seed(0)
        m = SparseCoreEmbeddingCollection(
            TABLES, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=4, device=dev, max_ids_per_feature=CAP,
            fixed_limits=True,
        )
        gen = torch.Generator().manual_seed(5)
        device.RECORD.reset()
        for step in range(len(LONGEST)):
            before = set(device.RECORD.programs)
            kjt = batch(step, gen)
            # the kernel's padded output, what the sharded path sends (tpurec/sharding/sequence_output.py)
            out, _ = m.kernel.forward_padded(kjt)
            weight = torch.arange(out.numel(), dtype=torch.float32).view(out.shape) / out.numel()
            (out * weight.to(out.device)).sum().backward()
            if dev == "tpu":
                blocks = -(-max(kjt.length_per_key()) // CAP)
                new = sorted({op for key in device.RECORD.programs if key not in before for op in [key[1]]})
                log.append({"blocks": blocks, "rows": out.shape[0], "new": new})
        tables[dev] = m.kernel.read_weight("a").cpu()
    print(json.dumps({"log": log, "max_diff": float((tables["tpu"] - tables["cpu"]).abs().max())}))
    """
)


def test_a_sequence_batch_over_its_capacity_compiles_only_for_a_block_count_not_seen_before():
    env = dict(os.environ, TPUREC_EMULATE_TPU="v5p-8", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    log = seen["log"]
    counts = [s["blocks"] for s in log]
    assert counts[:3] == [1, 1, 1] and {2, 3} <= set(counts), counts
    assert [s["rows"] for s in log] == [48 * s["blocks"] for s in log]  # blocks x capacity x 2 features
    first = {}
    for step, s in enumerate(log):
        if s["blocks"] in first:  # a block count seen before: its programs are reused
            assert s["new"] == [], (step, s)
        else:
            first[s["blocks"]] = step
            assert s["new"], (step, s)  # the first of its count compiles (the bigger output)
    assert len(log) - len(first) >= 7  # most steps repeat a count
    assert seen["max_diff"] <= 1e-6  # and trains as the CPU module does
