"""Tables live once: a sharded table and its optimizer state are held once, not copied per view.

Peak RSS of a fresh process, measured around `tpurec.DistributedModelParallel` on a 4M x 64 table
with row-wise Adagrad (plan, shard, one training step, model and optimizer state_dict()), must
grow by at most 1.2x the bytes of weights + state. Before tables were stored in natural order the
same probe grew 5.5x (kernel storage + natural-order copies in both fused optimizers).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import sys
    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    import torch, tpurec
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    rows, dim = int(sys.argv[1]), 64
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows,
                                                     feature_names=["f"])], device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.randint(0, rows, (64,)), lengths=torch.full((32,), 2))
    base = rss("VmRSS:")
    dmp = tpurec.DistributedModelParallel(ebc, device="cpu")
    dmp(kjt).values().sum().backward()
    sd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()
    print("GROWTH", (rss("VmHWM:") - base) / (rows * dim * 4 + rows * 4))
""")


def test_a_sharded_table_and_its_state_are_held_once():
    out = subprocess.run([sys.executable, "-c", PROBE, "4000000"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    growth = float(lines["GROWTH"])
    assert growth <= 1.2, f"peak RSS grew {growth:.2f}x weights + state"
