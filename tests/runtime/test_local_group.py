"""A one-process group that opens no socket (runtime/local_group.py): a TPU VM sandbox refuses every
internet socket, where gloo cannot start even alone. With sockets refused, the README program's
DistributedModelParallel trains on it to the same numbers as on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.dlrm.helpers import REPO
from tpurec.runtime import local_group

# A sitecustomize-free way to refuse sockets in a child: patch socket.socket before anything runs.
PROGRAM = textwrap.dedent("""
    import json, socket, sys
    if sys.argv[1] == "refused":
        real = socket.socket
        class Refused(real):
            def __init__(self, family=socket.AF_INET, *a, **k):
                if family in (socket.AF_INET, socket.AF_INET6):
                    raise OSError(97, "Address family not supported by protocol")
                super().__init__(family, *a, **k)
        socket.socket = Refused
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    import torch.distributed as dist
    import tpurec

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    model = EmbeddingBagCollection(tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.parameters(), {"lr": 0.1})
    dmp = tpurec.DistributedModelParallel(model, device="cpu")
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 100, (32,), generator=g)
        kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=ids, lengths=torch.full((16,), 2))
        loss = dmp(kjt).values().square().sum()
        loss.backward()
        losses.append(loss.item())
    print(json.dumps({"backend": dist.get_backend(), "losses": losses}))
""")


def _run(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", PROGRAM, mode], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_with_sockets_refused_a_one_process_dmp_trains_as_on_gloo():
    refused, gloo = _run("refused"), _run("normal")
    assert refused["backend"] == local_group.BACKEND and gloo["backend"] == "gloo"
    assert refused["losses"] == gloo["losses"] and len(set(gloo["losses"])) == 3  # the tables moved


COLLECTIVES = textwrap.dedent("""
    import torch, torch.distributed as dist
    from tpurec.runtime import local_group
    local_group.register()
    dist.init_process_group(local_group.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    x = torch.arange(6.0)
    outs = {}
    for name, call in {
        "all_to_all_single": lambda o: dist.all_to_all_single(o, x, [6], [6]),
        "all_gather_into_tensor": lambda o: dist.all_gather_into_tensor(o, x),
        "reduce_scatter_tensor": lambda o: dist.reduce_scatter_tensor(o, x),
    }.items():
        o = torch.empty(6)
        call(o)
        outs[name] = o.tolist()
    gathered = [torch.empty(6)]
    dist.all_gather(gathered, x)
    y = x.clone()
    dist.all_reduce(y)
    dist.broadcast(y, 0)
    dist.barrier()
    objs = [None]
    dist.all_gather_object(objs, {"a": 1})
    print(json.dumps({"outs": outs, "gathered": gathered[0].tolist(), "y": y.tolist(), "objs": objs}))
    dist.destroy_process_group()
""")


def test_every_collective_of_one_rank_is_its_input():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = "import json\n" + COLLECTIVES
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    x = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert got["outs"] == {"all_to_all_single": x, "all_gather_into_tensor": x, "reduce_scatter_tensor": x}
    assert got["gathered"] == got["y"] == x and got["objs"] == [{"a": 1}]


def test_the_probe_tells_a_refusing_host(monkeypatch):
    import socket

    def refuse(*a, **k):
        raise OSError(97, "Address family not supported by protocol")

    assert local_group.sockets_refused() is False
    monkeypatch.setattr(socket, "socket", refuse)
    assert local_group.sockets_refused() is True
