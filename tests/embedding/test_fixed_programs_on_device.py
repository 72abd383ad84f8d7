"""Weight decay and batches over their id limits compile nothing new on the emulated TPU device once
each kind of batch has been seen: every device op of the decay (tpurec/embedding/optimizers/
weight_decay.py, `DecayInput`) and of the over-limit passes (tpurec/embedding/multipass.py) has shapes
fixed by the limits, however many ids or passes a batch has (docs/tpu.md, "Weight decay";
docs/id_limits.md, section 4).

The device renames PrivateUse1 for the whole process, so the module trains in a fresh interpreter made
an emulated rank (as tests/emulation/test_emulated_device.py does), which prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import json, sys, torch
    import tpurec  # an emulated rank: the device is installed here
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
    from tpurec.emulation import device

    optimizer, mode = sys.argv[1], sys.argv[2]
    TABLES = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=300, feature_names=["fa", "fb"]),
        EmbeddingBagConfig(name="c", embedding_dim=16, num_embeddings=60, feature_names=["fc"]),
    ]
    KEYS = ["fa", "fb", "fc"]
    BATCH = 32
    if optimizer == "rowwise":
        cls, kwargs = RowWiseAdagrad, {"lr": 0.2, "eps": 1e-3}
    else:
        cls, kwargs = torch.optim.Adam, {"lr": 0.05}
    if mode != "none":
        kwargs |= {"weight_decay": 0.1} | ({"weight_decay_mode": mode} if optimizer == "rowwise" else {})
    # Step 1 fits the limits, step 2 is over them; then the id count and the number of passes vary.
    LENGTHS = [1, 9, 3, 14, 2, 6, 20, 1, 11, 4, 17, 2]
    HOT = [False, True, False, True, False, False, True, False, False, True, True, False]

    def batch(step, gen):
        lengths = torch.randint(0, LENGTHS[step] + 1, (len(KEYS) * BATCH,), generator=gen)
        values = []
        for k, rows in enumerate((300, 300, 60)):
            n = int(lengths[k * BATCH : (k + 1) * BATCH].sum())
            values.append(torch.randint(0, 4 if HOT[step] else rows, (n,), generator=gen))
        return KeyedJaggedTensor(keys=KEYS, values=torch.cat(values), lengths=lengths)

    def model(dev):
        torch.manual_seed(0)
        return SparseCoreEmbeddingBagCollection(
            TABLES, cls, kwargs, num_sparsecores=4, device=dev,
            max_ids_per_partition=16, max_unique_ids_per_partition=16, fixed_limits=True,
        )

    seen = {"passes": [], "new": {}}
    tables = {}
    for dev in ("cpu", "tpu"):
        m, gen = model(dev), torch.Generator().manual_seed(5)
        device.RECORD.reset()
        for step in range(len(LENGTHS)):
            if step == 2:
                warm = set(device.RECORD.programs)
            before = m.kernel.multipass_batches
            out = m(batch(step, gen)).values()
            (out * torch.randn(out.shape, generator=gen).to(out.device)).sum().backward()
            if dev == "tpu":
                seen["passes"].append(m.kernel.multipass_batches - before)
        if dev == "tpu":  # before reading the tables back
            new = [(kind, op, str(key)) for kind, op, key in device.RECORD.programs if (kind, op, key) not in warm]
        tables[dev] = {t.name: m.table_weight(t.name).cpu() for t in TABLES}
    seen["new"] = sorted({op for _, op, _ in new})
    seen["new_keys"] = sorted({op + " " + key[:300] for _, op, key in new})
    seen["programs"] = len(device.RECORD.programs)
    seen["max_diff"] = max(float((tables["tpu"][n] - tables["cpu"][n]).abs().max()) for n in tables["cpu"])
    print(json.dumps(seen))
    """
)


def _run(optimizer: str, mode: str) -> dict:
    env = dict(os.environ, TPUREC_EMULATE_TPU="v5p-8", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, optimizer, mode], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# two of row-wise Adagrad's cases in make test-all (default suite time: 5 s each here): every batch
# runs the over-limit passes in each case, so "L2" keeps row-wise Adagrad's (with a decay), Adam's
# case the decoupled decay
@pytest.mark.parametrize(
    "optimizer, mode",
    [
        pytest.param("rowwise", "none", marks=pytest.mark.slow),
        ("rowwise", "L2"),
        pytest.param("rowwise", "DECOUPLE", marks=pytest.mark.slow),
        ("adam", "DECOUPLE"),
    ],
)
def test_batches_of_any_id_count_and_pass_count_reuse_the_programs_of_the_first_two(optimizer, mode):
    seen = _run(optimizer, mode)
    # step 1 fit the limits, step 2 did not; later steps ran within and over them with 2-4x the ids
    assert seen["passes"][0] == 0 and seen["passes"][1] >= 1, seen["passes"]
    assert 0 in seen["passes"][2:] and sum(seen["passes"][2:]) >= 4, seen["passes"]
    # Before: the over-limit update's gradient had [passes x batch] rows and its gather a power of two
    # of entries (aten::new_zeros, index_add_, index_select, slices at each pass's offset), and weight
    # decay ran every batch in such passes: new programs whenever a batch had more ids or passes.
    assert seen["new"] == [], seen["new_keys"]
    # and the device trains as the CPU module does (float32 sums in another order)
    assert seen["max_diff"] <= 2e-6, seen["max_diff"]
