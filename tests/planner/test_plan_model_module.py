"""`tpurec plan --model-module MODULE:FN`: the user's own model, planned by the planner DMP uses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.plans import run_plan

USER_MODEL = textwrap.dedent("""
    import torch
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    META = torch.device("meta")


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = nn.Module()
            self.sparse.ebc = EmbeddingBagCollection([
                EmbeddingBagConfig(name="users", embedding_dim=16, num_embeddings=5000, feature_names=["u"]),
                EmbeddingBagConfig(name="cats", embedding_dim=8, num_embeddings=100, feature_names=["c1", "c2"],
                                   pooling=PoolingType.MEAN),
            ], device=META)
            self.terms = EmbeddingBagCollection([
                EmbeddingBagConfig(name="terms", embedding_dim=16, num_embeddings=2000, feature_names=["q"]),
            ], is_weighted=True, device=META)
            self.dense = nn.Linear(13, 16, device=META)


    def build():
        m = Model()
        for ebc in (m.sparse.ebc, m.terms):
            apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.1})
        return m


    def build_steered():
        from torchrec.distributed.planner.types import ParameterConstraints

        return build(), {"users": ParameterConstraints(sharding_types=["row_wise"], pooling_factors=[5.0])}


    def not_a_model():
        return 42


    def build_with_sequence():
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection

        m = build()
        m.seq = EmbeddingCollection([
            EmbeddingConfig(name="hist", embedding_dim=16, num_embeddings=3000, feature_names=["h"]),
        ], device=META)
        return m


    def build_sequence_only():
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection

        m = nn.Module()
        m.seq = EmbeddingCollection([
            EmbeddingConfig(name="hist", embedding_dim=16, num_embeddings=3000, feature_names=["h", "h2"]),
        ], device=META)
        return m
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "tpurec_user_model.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tpurec_user_model"


def _plan(capsys, *args) -> dict:
    assert run_plan(*args, "--format", "json") == 0
    return json.loads(capsys.readouterr().out)


def test_every_ebc_of_the_model_is_planned_with_its_own_optimizer(user_module, capsys):
    r = _plan(capsys, "--model-module", f"{user_module}:build", "--topology", "v6e-4")
    assert r["optimizer"] == "adagrad"  # from apply_optimizer_in_backward, as DMP reads it
    assert set(r["plan"]["modules"]) == {"sparse.ebc", "terms"}
    t = {x["name"]: x for x in r["tables"]}
    assert (t["cats"]["features"], t["cats"]["pooling"], t["cats"]["pooling_factor"]) == (["c1", "c2"], "mean", 2.0)
    assert t["terms"]["weighted"] and not t["users"]["weighted"]
    assert {x["module"] for x in r["tables"]} == {"sparse.ebc", "terms"}
    # the dense Linear (13*16+16 floats, x4 for weights, grads and two Adam moments) is reserved
    pooled = 512 * (16 + 8 + 16) * 4 * 2  # batch 512 per device: DMP's default
    headroom = int(0.05 * 32 * 10**9)
    assert r["devices"][0]["reserved_bytes"] == (13 * 16 + 16) * 4 * 4 + pooled + headroom


def test_constraints_returned_with_the_model_steer_the_plan(user_module, capsys):
    r = _plan(capsys, "--model-module", f"{user_module}:build_steered", "--topology", "v6e-4")
    users = next(x for x in r["tables"] if x["name"] == "users")
    assert users["sharding_type"] == "row_wise" and users["pooling_factor"] == 5.0


def test_a_model_with_an_embedding_collection_is_planned_and_shown_again(user_module, tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ("--model-module", f"{user_module}:build_with_sequence", "--topology", "v6e-4", "--format", "json")
    assert run_plan(*args, "--out", str(out)) == 0
    r = json.loads(out.read_text())
    assert set(r["plan"]["modules"]) == {"sparse.ebc", "terms", "seq"}
    hist = next(x for x in r["tables"] if x["name"] == "hist")
    assert (hist["module"], hist["pooling"], hist["rows"]) == ("seq", "none", 3000)
    capsys.readouterr()
    # `plan show` reads the file back (three modules, each with its own tables) to the same report
    assert run_plan("show", str(out), "--format", "json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tables"] == r["tables"] and shown["devices"] == r["devices"]


def test_a_model_of_embedding_collections_only_is_planned(user_module, capsys):
    r = _plan(capsys, "--model-module", f"{user_module}:build_sequence_only", "--topology", "v6e-4")
    assert [(t["name"], t["module"], t["features"]) for t in r["tables"]] == [("hist", "seq", ["h", "h2"])]


def test_a_plan_file_missing_a_table_of_another_module_is_refused(user_module, tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ("--model-module", f"{user_module}:build_with_sequence", "--topology", "v6e-4", "--format", "json")
    assert run_plan(*args, "--out", str(out)) == 0
    doc = json.loads(out.read_text())
    del doc["plan"]["modules"]["seq"]
    out.write_text(json.dumps(doc))
    from tpurec.planner.report import report_from_file

    with pytest.raises(ValueError, match=r"no sharding for table\(s\) \['hist'\]"):
        report_from_file(out)


@pytest.mark.parametrize(
    "target,message",
    [
        ("tpurec_user_model", "expected MODULE:FUNCTION"),
        # refused before torch loads (parse_target), pointing at the path form
        ("no_such_module_xyz:build", "no module 'no_such_module_xyz' in "),
        ("no_such_pkg_xyz.models:build", "no module 'no_such_pkg_xyz.models' in "),
        ("./no_such_file.py:build", "--model-module './no_such_file.py:build': no file './no_such_file.py'"),
        ("tpurec_user_model:missing", "tpurec_user_model has no function 'missing'"),
        ("tpurec_user_model:not_a_model", "not_a_model() returned int, not an nn.Module"),
    ],
)
def test_bad_model_module_is_one_line(user_module, capsys, target, message):
    assert run_plan("--model-module", target, "--topology", "v6e-4") == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


DMP_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import tpurec
from tpurec.planner.plan_io import plan_to_dict
from tpurec_user_model import build_with_sequence
dmp = tpurec.DistributedModelParallel(build_with_sequence(), device="cpu", topology="cpu-1")  # its default batch
print("PLAN", json.dumps(plan_to_dict(dmp.plan)["modules"]))
"""


def test_the_plan_is_the_one_distributed_model_parallel_makes(user_module, tmp_path, capsys):
    r = _plan(capsys, "--model-module", f"{user_module}:build_with_sequence", "--topology", "cpu-1")
    out = subprocess.run([sys.executable, "-c", DMP_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    dmp_modules = json.loads(out.stdout.split("PLAN ", 1)[1])
    assert dmp_modules == r["plan"]["modules"]


def test_a_model_with_managed_collision_tables_is_planned_row_wise_on_the_sparsecore_kernel(capsys):
    # the remap's only sharding (TorchRec's MC sharders); over 4 devices, which TorchRec's own planner
    # refuses for a one-bucket remap (docs/managed_collision.md)
    r = _plan(capsys, "--model-module", "tests.sharding.mc_cases:build_lru", "--topology", "v6e-4")
    assert set(r["plan"]["modules"]) == {"mc"}
    assert {(t["name"], t["sharding_type"]) for t in r["tables"]} == {("t0", "row_wise"), ("t1", "row_wise")}


def test_a_model_file_path_is_planned_like_its_module(user_module, tmp_path, monkeypatch, capsys):
    """`./my_model.py:build` (a path where a module was expected) printed a TypeError traceback."""
    by_module = _plan(capsys, "--model-module", f"{user_module}:build", "--topology", "v6e-4")
    monkeypatch.chdir(tmp_path)
    by_path = _plan(capsys, "--model-module", f"./{user_module}.py:build", "--topology", "v6e-4")
    assert by_path["plan"] == by_module["plan"] and by_path["tables"] == by_module["tables"]


def test_the_remaps_host_memory_is_in_the_report_and_its_saved_plan(tmp_path, capsys):
    """MCHManagedCollisionModule with LRU holds, per slot, the id kept, the row it maps to and its last
    access (3 int64: 24 bytes), and per shard a few fixed buffers (1,025 output segments + 3
    counters, int64: 8,224 bytes). t0 (32 slots) and t1 (16) row-wise over 4 ranks: 8 and 4 slots each."""
    from tpurec.planner import report as I

    r = _plan(capsys, "--model-module", "tests.sharding.mc_cases:build_lru", "--topology", "v6e-4")
    t = {x["name"]: x for x in r["tables"]}
    assert [s["remap_host_bytes"] for s in t["t0"]["shards"]] == [8 * 24 + 8224] * 4
    assert [s["remap_host_bytes"] for s in t["t1"]["shards"]] == [4 * 24 + 8224] * 4
    assert r["host_remap_bytes_per_rank"] == [8 * 24 + 4 * 24 + 2 * 8224] * 4
    out = tmp_path / "r.json"
    out.write_text(json.dumps(r))
    again = I.report_from_file(out)  # `plan show` of the saved report: the same figures
    assert again["host_remap_bytes_per_rank"] == r["host_remap_bytes_per_rank"] and again["tables"] == r["tables"]
    assert run_plan("show", str(out)) == 0
    assert "managed-collision remaps of 2 table(s), up to 16.34 KiB per rank" in capsys.readouterr().out


def test_the_hash_remaps_host_memory_is_in_the_report(capsys):
    """HashZchManagedCollisionModule with LRU eviction holds, per slot, the id kept (int64, a frozen
    parameter its `buffers()` yields) and its eviction metadata (int32): 12 bytes; per shard its bucket
    (int64) and its input mapper's two per-training-rank vectors (4 buckets: 4 int64 each): 72 bytes."""
    r = _plan(capsys, "--model-module", "tests.sharding.mc_cases:build_hash_zch", "--topology", "v6e-4")
    t = {x["name"]: x for x in r["tables"]}
    assert [s["remap_host_bytes"] for s in t["t0"]["shards"]] == [8 * 12 + 72] * 4
    assert [s["remap_host_bytes"] for s in t["t1"]["shards"]] == [4 * 12 + 72] * 4
    assert r["host_remap_bytes_per_rank"] == [8 * 12 + 4 * 12 + 2 * 72] * 4


def test_a_hash_remap_whose_buckets_the_ranks_cannot_share_is_one_line(capsys):
    rc = run_plan("--model-module", "tests.sharding.mc_cases:build_hash_zch_2_buckets", "--topology", "v6e-4")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1, err
    assert "table t0's remap has 2 buckets, which 4 ranks cannot share evenly" in err[0]
    assert "Traceback" not in err[0]
