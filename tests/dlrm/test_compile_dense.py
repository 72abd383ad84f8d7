"""`tpurec train --compile-dense` (tpurec/dlrm/training/dense_compile.py): the modules holding no embedding
table run as torch.compile programs, the rest eagerly; the same training, the same state_dict."""

from __future__ import annotations

import pytest
import torch
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.cli import main
from tpurec.dlrm.training.dense_compile import compile_dense

from .helpers import train, train_losses


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tpurec-cache")


def _dcn() -> DLRM_DCN:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"]) for i in (0, 1)
    ]
    ebc = EmbeddingBagCollection(tables)
    return DLRM_DCN(ebc, dense_in_features=3, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1],
                    dcn_num_layers=2, dcn_low_rank_dim=4)  # fmt: skip


def _kjt() -> KeyedJaggedTensor:
    ids, lengths = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.ones(8, dtype=torch.int64)
    return KeyedJaggedTensor(["f0", "f1"], ids, lengths=lengths)


def test_the_dcn_arches_are_compiled_and_the_tables_are_not():
    model = _dcn()
    keys = list(model.state_dict())
    dense, kjt = torch.randn(4, 3), _kjt()
    want = model(dense, kjt)
    assert compile_dense(model, "cpu") == ["dense_arch", "inter_arch", "over_arch"]
    assert list(model.state_dict()) == keys  # the modules stay; only their forward is compiled
    assert torch.equal(model(dense, kjt), want)
    assert "_torchdynamo_orig_callable" in dir(model.over_arch.forward)  # a Dynamo-compiled callable


def test_the_parameters_are_inputs_of_the_compiled_graphs_not_constants():
    """TorchTPU's backend turns a graph's `get_attr` tensors into constants (docs/tpu.md): a parameter
    reached that way would be frozen at its first value. Every AOTAutograd graph of the compiled arches
    takes the parameters as inputs and holds no get_attr, and a changed weight changes the output."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    model = _dcn()
    compile_dense(model, "cpu", backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    dense, kjt = torch.randn(4, 3), _kjt()
    model(dense, kjt).sum().backward()
    assert len(graphs) == 6  # each arch's forward and backward
    assert not [n for g in graphs for n in g.graph.nodes if n.op == "get_attr"]
    with torch.no_grad():
        before = model(dense, kjt)
        next(model.over_arch.parameters()).add_(1.0)
        assert not torch.equal(model(dense, kjt), before)


@pytest.mark.slow  # two CPU runs: about 30 s (the unit test above checks the outputs in the default suite)
@pytest.mark.multiprocess
def test_train_with_compiled_dense_modules_gives_the_eager_runs_losses(cache, tmp_path):
    common = ["--synth-rows", 30000, "--steps", 6, "--eval-every", 0, "--log-every", 1, "--curves-out", "none"]
    eager, _ = train(*common, "--metrics-out", tmp_path / "a.jsonl", cache=cache)
    compiled, p = train(*common, "--metrics-out", tmp_path / "b.jsonl", "--compile-dense", cache=cache)
    assert "--compile-dense: model.dense_arch, model.over_arch compiled" in p.stderr
    assert "--compile-dense: the dense update (" in p.stderr  # its optimizer too (dense_update_compile.py)
    losses = train_losses(tmp_path / "a.jsonl")
    assert len(losses) == 6 and train_losses(tmp_path / "b.jsonl") == losses
    assert compiled is not None and eager is not None and compiled["auc"] == eager["auc"]


def test_compile_dense_is_refused_with_a_compiled_step(capsys):
    assert main(["train", "--compile-dense", "--step", "pipelined"]) == 2
    err = capsys.readouterr().err
    assert "--compile-dense is for --step eager (--step pipelined compiles the dense part already)" in err


@pytest.mark.slow  # two emulated runs: about 40 s
@pytest.mark.multiprocess
def test_on_an_emulated_v5e_the_dense_modules_are_compiled_programs(cache, tmp_path):
    common = ["--emulate-tpu", "v5e-1", "--synth-rows", 30000, "--steps", 8, "--eval-every", 0, "--log-every", 1]
    common += ["--curves-out", "none"]
    eager, _ = train(*common, "--metrics-out", tmp_path / "a.jsonl", cache=cache)
    compiled, _ = train(*common, "--metrics-out", tmp_path / "b.jsonl", "--compile-dense", cache=cache)
    assert eager is not None and compiled is not None
    assert train_losses(tmp_path / "b.jsonl") == train_losses(tmp_path / "a.jsonl")
    # the arches' forward and backward (training, then evaluation's forward) as compiled programs, fewer
    # eager TensorCore programs; none compiled after the warm-up
    assert eager["programs_compiled"]["compiled"] == 0 and compiled["programs_compiled"]["compiled"] > 0
    assert compiled["programs_compiled"]["tensorcore"] < eager["programs_compiled"]["tensorcore"]
    assert compiled["recompiles_after_warmup"] == 0
    assert (eager["dense"], compiled["dense"]) == ("eager", "compiled")


@pytest.mark.parametrize(
    ("flags", "device", "emulated", "compiled"),
    [
        ([], "tpu", False, True),  # a real TPU: compiled by default
        ([], "tpu", True, False),  # the emulated one: eager, as its tests' programs are counted
        ([], "cpu", False, False),  # a CPU: aot_eager is slower than eager
        (["--compile-dense"], "cpu", False, True),
        (["--eager-dense"], "tpu", False, False),
        (["--step", "pipelined"], "tpu", False, False),  # the compiled steps compile the dense part anyway
    ],
)
def test_the_dense_modules_are_compiled_by_default_on_a_real_tpu_only(flags, device, emulated, compiled):
    from tpurec.dlrm.options import TrainOptions

    assert TrainOptions(**_parsed(flags)).dense_compiled(device, emulated) is compiled


def _parsed(flags: list[str]) -> dict:
    import argparse

    from tpurec.dlrm.options import TrainOptions

    parser = argparse.ArgumentParser()
    TrainOptions.add_arguments(parser)
    return vars(parser.parse_args(flags))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compile-dense", "--eager-dense"], "--compile-dense and --eager-dense: choose one"),
        (["--eager-dense", "--step", "pipelined"], "--eager-dense is for --step eager (--step pipelined"),
    ],
)
def test_contradictory_dense_flags_are_refused_in_one_line(capsys, flags, message):
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
