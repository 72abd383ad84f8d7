"""The process group DMP starts when the caller has none: gloo on CPU, gloo + TorchTPU's tpu_dist on a TPU."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from tpurec.sharding import dmp


def test_backend_per_device_type():
    assert dmp.process_group_backend("cpu") == "gloo"
    # gloo alone has no backend for tpu tensors; CPU tensors still need gloo.
    tpu = dmp.process_group_backend("tpu")
    assert BackendConfig(dist.Backend(tpu)).get_device_backend_map() == {"cpu": "gloo", "tpu": "tpu_dist"}


def test_tpu_device_starts_the_tpu_backend_with_a_store(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    dmp._ensure_process_group("tpu")
    ((backend, kw),) = calls
    assert backend == "cpu:gloo,tpu:tpu_dist"
    # TorchTPU's uneven all-to-all needs a c10d Store: an in-memory one, no socket for one process
    assert isinstance(kw["store"], dist.HashStore) and kw["world_size"] == 1 and kw["rank"] == 0


def test_a_host_that_refuses_sockets_gets_the_local_group_for_one_process(monkeypatch):
    from tpurec.runtime import local_group

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(local_group, "sockets_refused", lambda: True)
    dmp._ensure_process_group("tpu")
    ((backend, kw),) = calls
    assert backend == local_group.BACKEND and isinstance(kw["store"], dist.HashStore)


def test_dmp_leaves_torchrec_all_to_all_to_the_backend():
    """DMP never reroutes torch.distributed's collective (it once did, through a padded path, when asked
    by TPUREC_PADDED_ALL_TO_ALL=1 or on tpu_dist); on a TPU the padding is TorchRec's own, chosen
    explicitly (tpurec/sharding/tpu_all_to_all.py, tests/emulation/test_uneven_all_to_all.py)."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, torch.distributed as dist, tpurec\n"
        "from torchrec.modules.embedding_configs import EmbeddingBagConfig\n"
        "from torchrec.modules.embedding_modules import EmbeddingBagCollection\n"
        "from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward\n"
        "original = dist.all_to_all_single\n"
        "ebc = EmbeddingBagCollection([EmbeddingBagConfig(name='t', embedding_dim=8, num_embeddings=10,"
        " feature_names=['f'])], device=torch.device('meta'))\n"
        "apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {'lr': 0.1})\n"
        "tpurec.DistributedModelParallel(ebc, device='cpu')\n"
        "print('SAME' if dist.all_to_all_single is original else 'REROUTED')\n"
    )
    env = dict(os.environ, TPUREC_PADDED_ALL_TO_ALL="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "SAME"


def _exit_report(body: str) -> tuple[int, str]:
    """Run `body` after a DMP started its own one-rank group; report at exit (an atexit handler
    registered first runs last) whether the group was still initialized."""
    import os
    import subprocess
    import sys

    script = (
        "import atexit, torch, torch.distributed as dist, tpurec\n"
        "atexit.register(lambda: print('AT EXIT initialized:', dist.is_initialized(), flush=True))\n"
        "from torchrec.modules.embedding_configs import EmbeddingBagConfig\n"
        "from torchrec.modules.embedding_modules import EmbeddingBagCollection\n"
        "from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward\n"
        "ebc = EmbeddingBagCollection([EmbeddingBagConfig(name='t', embedding_dim=8, num_embeddings=10,"
        " feature_names=['f'])], device=torch.device('meta'))\n"
        "apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {'lr': 0.1})\n"
        "tpurec.DistributedModelParallel(ebc, device='cpu')\n" + body
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("AT EXIT")]
    return out.returncode, lines[-1] if lines else out.stderr[-2000:]


def test_a_group_tpurec_started_is_destroyed_at_normal_exit():
    # gloo threads outliving the interpreter abort the process after its last line (pytorch#190489)
    assert _exit_report("print('done')\n") == (0, "AT EXIT initialized: False")


def test_a_program_that_destroys_the_group_itself_exits_cleanly():
    assert _exit_report("dist.destroy_process_group()\n") == (0, "AT EXIT initialized: False")


def test_an_unhandled_exception_leaves_the_group_alone():
    # other ranks may still be inside a collective: destroying the group could hang them
    assert _exit_report("raise SystemError('boom')\n") == (1, "AT EXIT initialized: True")
