"""The emulated TPU device (tpurec/emulation/device.py): TorchTPU 0.2.0's device rules on CPU data.

The device renames PrivateUse1 for the whole process, so the checks run in a fresh interpreter made an
emulated rank (TPUREC_EMULATE_TPU set before `import tpurec`, as the slice launcher does), which
prints what it saw as JSON.
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
    import json, torch
    import tpurec  # an emulated rank: the device is installed here
    from tpurec.emulation import device
    from tpurec.emulation.rule_error import TorchTpuRuleError
    from tpurec.runtime.device import resolve_device

    seen = {}

    def refused(fn, kind):
        try:
            fn()
        except kind as e:
            return str(e)
        return None

    dev = resolve_device("tpu")
    seen["resolved"] = str(dev)
    seen["current_device"] = torch.tpu.current_device()
    a = torch.arange(12, dtype=torch.float32).view(3, 4).to("tpu")
    seen["type"] = type(a).__name__
    seen["device"] = str(a.device)
    seen["sum_device"] = str((a + a).device)
    seen["index_n"] = [str(torch.zeros(2, device="tpu:1").device), str(torch.ones(2).to("tpu:3").device)]
    host_index = torch.tensor([2, 0])
    seen["host_index"] = [str(a[host_index].device), a[host_index].cpu().tolist()]
    seen["host_index_select"] = refused(lambda: a.index_select(0, host_index), RuntimeError)
    seen["mixed"] = refused(lambda: a + torch.ones(3, 4), RuntimeError)
    seen["mixed_1d"] = refused(lambda: a[0] + torch.ones(4), RuntimeError)
    seen["scalar_ok"] = str((a * torch.tensor(2.0)).device)
    seen["numpy"] = refused(lambda: a.numpy(), TypeError)
    seen["factory"] = str(torch.tensor([1, 2], device="tpu").device)

    def read_back():
        return [a.sum().item(), a.tolist()[0][0], float(a[1, 1]), a.cpu().sum().item()]

    device.RECORD.reset()
    seen["values"] = read_back()
    seen["to_host"] = dict(device.RECORD.to_host)

    w = torch.ones(4, 2, device="tpu", requires_grad=True)
    (a @ w).sum().backward()
    seen["grad_device"] = str(w.grad.device)
    seen["grad"] = w.grad.cpu().tolist()

    import fbgemm_gpu  # noqa: F401
    lengths = torch.tensor([1, 2, 3]).to("tpu")
    seen["fbgemm_routed"] = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths).cpu().tolist()
    seen["fbgemm_missing"] = refused(
        lambda: torch.ops.fbgemm.permute_pooled_embs_auto_grad(
            a, *[torch.tensor(x).to("tpu") for x in ([0, 2, 4], [0, 2, 4], [1, 0], [1, 0])]
        ),
        NotImplementedError,
    )
    seen["aten_missing"] = refused(lambda: torch.unique(a, dim=0), NotImplementedError)

    # what the v5e chip aborts on (SIGABRT in XLA's compiler) is refused with its message on an emulated v5e
    table = torch.ones(10, 4, device="tpu", requires_grad=True)
    offsets = torch.tensor([0, 2]).to("tpu")

    def bag(dtype, grad=True):
        ids = torch.tensor([1, 2, 3], dtype=dtype).to("tpu")
        weight = table if grad else table.detach()
        return torch.nn.functional.embedding_bag(ids, weight, offsets.to(dtype), mode="sum")

    seen["bag_on_v5p"] = bag(torch.int64).cpu().tolist()
    device.set_generation("v5e")
    dtypes, grads = (torch.int64, torch.int32), (True, False)
    seen["bag_on_v5e"] = [refused(lambda: bag(d, g), TorchTpuRuleError) for d in dtypes for g in grads]
    device.set_generation("v5p")

    # Module.to of parameters already on the device: torch swaps a traceable wrapper subclass's
    # parameters (torch.utils.swap_tensors); each keeps its identity, attributes and hooks
    lin = torch.nn.Linear(2, 2, device="tpu")
    weight, fired = lin.weight, []
    weight.tag = "kept"
    weight.register_hook(lambda g: fired.append("hook") or g * 2)
    weight.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
    lin.to("tpu")
    lin(torch.ones(1, 2, device="tpu")).sum().backward()
    seen["swapped"] = [lin.weight is weight, getattr(lin.weight, "tag", None), fired, lin.weight.grad.cpu().tolist()]

    device.RECORD.reset()
    for shape in ((3, 4), (3, 4), (5, 4)):
        torch.ones(shape, device="tpu") * 3.0
    seen["programs"] = sorted({(op, str(key)) for _, op, key in device.RECORD.programs if op == "aten::mul.Tensor"})
    device.RECORD.reset()
    for dtype in (torch.float32, torch.float32, torch.float64):
        torch.ones(3, device="tpu", dtype=dtype) * 3.0
    seen["dtype_programs"] = sorted(str(key[0]) for _, op, key in device.RECORD.programs if op == "aten::mul.Tensor")

    # compiled (TorchTPU's backend, emulated): a mask made on the device inside the graph is part of its
    # one program; a host tensor copied to the device inside the graph is refused
    x = torch.arange(6, dtype=torch.float32).to("tpu")

    def masked(x):
        return (x * (torch.arange(x.shape[0], device=x.device) < 4)).sum()

    def from_host(x):
        return (x * (torch.arange(x.shape[0]) < 4).to(x.device)).sum()

    compiled = torch.compile(masked, fullgraph=True, dynamic=False, backend="tpu")
    compiled(x)
    device.RECORD.reset()
    out = compiled(x)
    seen["in_graph_programs"] = [kind for kind, _, _ in device.RECORD.programs]
    seen["in_graph_copies"] = sum(device.RECORD.to_host.values())
    seen["in_graph_factory"] = [out.cpu().item(), masked(x).cpu().item()]
    seen["in_graph_from_host"] = refused(
        lambda: torch.compile(from_host, fullgraph=True, dynamic=False, backend="tpu")(x), Exception
    )
    print(json.dumps(seen))
    """
)


@pytest.fixture(scope="module")
def seen() -> dict:
    env = dict(os.environ, TPUREC_EMULATE_TPU="v5p-8", LOCAL_RANK="3", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_rank_drives_tpu_0(seen):
    # LOCAL_RANK 3: TorchTPU still numbers this process's own device 0.
    assert seen["resolved"] == "tpu:0" and seen["current_device"] == 0
    assert seen["device"] == seen["sum_device"] == seen["factory"] == "tpu:0"
    assert seen["type"] == "TpuTensor"
    # tpu:N names tpu:0, as on the v5e chip (one device per process); the emulation refused it before
    assert seen["index_n"] == ["tpu:0", "tpu:0"]


def test_a_host_index_works_with_x_of_idx_and_not_with_index_select(seen):
    # as on the v5e chip: x[cpu_index] runs on the device, index_select refuses it with these words
    assert seen["host_index"] == ["tpu:0", [[8.0, 9.0, 10.0, 11.0], [0.0, 1.0, 2.0, 3.0]]]
    assert seen["host_index_select"] == "index_select(): expected tensor to be on tpu, got cpu"


def test_host_and_device_tensors_do_not_mix(seen):
    assert "Expected all tensors to be on the same device" in seen["mixed"]
    assert seen["scalar_ok"] == "tpu:0"  # a 0-dim CPU tensor is a scalar, as in torch
    # a 1-D host tensor is no scalar: it mixes as a 2-D one does
    assert "got a host tensor of shape (4,)" in seen["mixed_1d"]


def test_numpy_refused_and_copies_to_host_counted_where_made(seen):
    assert "can't convert tpu:0 device type tensor to numpy" in seen["numpy"]
    assert seen["values"] == [66.0, 0.0, 5.0, 66.0]
    assert seen["to_host"] == {"__main__.read_back": 4}  # item, tolist, float, cpu


def test_autograd_on_the_device(seen):
    assert seen["grad_device"] == "tpu:0"
    assert seen["grad"] == [[12.0, 12.0], [15.0, 15.0], [18.0, 18.0], [21.0, 21.0]]  # column sums of a


def test_ops_without_a_torchtpu_kernel_raise_torchtpus_error(seen):
    assert seen["fbgemm_routed"] == [0, 1, 3, 6]  # tpurec's host route (runtime/host_ops.py)
    # permute_pooled_embs_auto_grad reaches the device as the op it wraps, fbgemm::permute_pooled_embs.
    for key, op in (("fbgemm_missing", "fbgemm::permute_pooled_embs"), ("aten_missing", "aten::unique_dim")):
        assert seen[key] is not None and f"operator '{op}' is not implemented for TPU" in seen[key], seen[key]


def test_ops_the_v5e_chip_aborts_on_are_refused_with_its_message(seen):
    assert seen["bag_on_v5p"] == [[2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]]  # not measured there: it runs
    said = (
        "Unsupported conversion from vmreg/vreg to U64 (emulated TPU v5e: the chip's XLA compiler aborts the process "
        "compiling aten::{op}, torch_tpu 0.2.0; torch.nn.EmbeddingBag / F.embedding_bag cannot run there: use "
        "TorchRec's EmbeddingBagCollection, which tpurec shards)"
    )
    # int64 and int32 ids, a table that takes gradients (_embedding_bag) and one that does not (_forward_only)
    assert seen["bag_on_v5e"] == [said.format(op=op) for op in ("_embedding_bag", "_embedding_bag_forward_only") * 2]


def test_every_op_shape_is_a_program(seen):
    shapes = [key for _, key in seen["programs"]]
    assert len(shapes) == 2 and any("(3, 4)" in k for k in shapes) and any("(5, 4)" in k for k in shapes)


def test_the_same_shape_in_another_dtype_is_another_program(seen):
    # the float operand is a runtime value (as on the chip), the dtype part of the program
    assert seen["dtype_programs"] == [
        "(('tensor', (3,), 'torch.float32'), 'float')",
        "(('tensor', (3,), 'torch.float64'), 'float')",
    ]


def test_keyword_dtypes_make_programs_and_a_changing_python_float_does_not():
    import torch

    from tpurec.emulation.device import _key_part

    as32, as64 = ({"dtype": d, "pin_memory": False} for d in (torch.float32, torch.float64))
    assert _key_part(((3,), as32)) != _key_part(((3,), as64))  # `torch.ones(3, dtype=...)`
    assert _key_part(((3,), as32)) == ((3,), (("dtype", "torch.float32"), ("pin_memory", False)))
    x = torch.zeros(4)
    assert _key_part((x, 0.1)) == _key_part((x, 0.2)) == (("tensor", (4,), "torch.float32"), "float")


def test_a_program_key_names_each_tensors_shape_and_dtype():
    import torch

    from tpurec.emulation.device import _key_part

    key = _key_part(([torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32)], 7, torch.float16))
    assert key == ((("tensor", (2, 3), "torch.bfloat16"), ("tensor", (4,), "torch.int32")), 7, "torch.float16")


def _all_to_all_on_rank_0(monkeypatch, buffers: list[tuple[int, int]]) -> None:
    """`_check_symmetric_all_to_all` on rank 0 of len(buffers) ranks, each rank's (input, output) numel
    given: the all-gather of the sizes is faked, filling what each rank would send."""
    import types

    import torch

    from tpurec.emulation import device

    def all_gather(sizes, mine, group):
        assert mine.tolist() == list(buffers[0])
        for out, b in zip(sizes, buffers):
            out.copy_(torch.tensor(b))

    group = types.SimpleNamespace(size=lambda: len(buffers))
    fake = types.SimpleNamespace(ProcessGroup=types.SimpleNamespace(unbox=lambda boxed: group), all_gather=all_gather)
    monkeypatch.setattr(device, "dist", fake)
    inp, out = torch.zeros(buffers[0][0]), torch.zeros(buffers[0][1])
    device._check_symmetric_all_to_all((out, inp, object(), [1, 1], [2, 2]))


def test_the_all_to_all_rule_is_judged_on_the_input_and_the_output_buffers(monkeypatch):
    from tpurec.emulation.rule_error import TorchTpuRuleError

    # every rank's buffers of one size: accepted
    _all_to_all_on_rank_0(monkeypatch, [(6, 4), (6, 4)])
    # inputs of different sizes, equal outputs: refused, naming both sizes
    with pytest.raises(TorchTpuRuleError, match=r"this rank sends 4 elements, others \[4, 8\]\)$"):
        _all_to_all_on_rank_0(monkeypatch, [(4, 6), (8, 6)])
    # equal inputs, outputs of different sizes: refused too (was accepted)
    with pytest.raises(TorchTpuRuleError, match=r"^asymmetric .* this rank receives 4 elements, others \[4, 8\]\)$"):
        _all_to_all_on_rank_0(monkeypatch, [(6, 4), (6, 8)])


def test_moving_a_module_already_on_the_device_keeps_its_parameters(seen):
    # TpuTensor is traceable (torch.compile traces through it), so nn.Module.to swaps its parameters;
    # before it kept them as they were, and so must the swap: same object, attributes, hooks
    assert seen["swapped"] == [True, "kept", ["hook", "post"], [[2.0, 2.0], [2.0, 2.0]]]


def test_a_tensor_made_on_the_device_inside_a_compiled_graph_is_part_of_its_program(seen):
    # arange(device=x.device) inside the graph: FakeTensorMode makes it, not the device; the emulated
    # backend runs it on the CPU data with the rest of the graph (compiled._on_the_data)
    assert seen["in_graph_factory"] == [6.0, 6.0]  # 0 + 1 + 2 + 3, as eagerly
    assert seen["in_graph_programs"] == ["compiled"] and seen["in_graph_copies"] == 0  # no eager op, no copy
    assert "copied to the device inside a compiled graph" in seen["in_graph_from_host"]
