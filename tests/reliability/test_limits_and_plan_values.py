"""#43: values that were accepted without a word (or failed only at the first forward, or with a
traceback): `DistributedModelParallel(id_limits=...)` limits, limits files, and non-finite or
fractional numbers in plan files and reports. Each is refused where it is read, in one line naming
the table and field (or the JSON path)."""

from __future__ import annotations

import json

import pytest

from tests.reliability.inproc import assert_refused, run_cli
from tpurec.cli import main
from tpurec.errors import UserError


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "dlrm-tiny.json"
    assert main(["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--format", "json", "--out", str(path)]) == 0
    return path


def _ebc():
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    table = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])
    return EmbeddingBagCollection(tables=[table], device=torch.device("meta"))


BAD_DICT_LIMITS = [
    ((0, 8), "id_limits['t'] max_ids_per_partition: 0 is not a whole number in [1, 2,147,483,647]"),
    ((-3, 8), "max_ids_per_partition: -3 is not"),
    (("8", 8), "max_ids_per_partition: '8' is not"),
    ((8, float("nan")), "max_unique_ids_per_partition: nan is not"),
    ((10**12, 8), "max_ids_per_partition: 1000000000000 is not"),
    ((8.0, 8), "max_ids_per_partition: 8.0 is not"),
    ((8, 8, 16), "id_limits['t']: (8, 8, 16) is not (max ids, max unique ids per partition"),
    ("8", "id_limits['t']: '8' is not (max ids"),
]


@pytest.mark.parametrize("limits,says", BAD_DICT_LIMITS, ids=[repr(v) for v, _ in BAD_DICT_LIMITS])
def test_dmp_refuses_bad_id_limits_at_construction(limits, says):
    import tpurec

    with pytest.raises(UserError) as e:
        tpurec.DistributedModelParallel(_ebc(), id_limits={"t": limits})
    assert says in str(e.value)


def test_dmp_takes_good_id_limits():
    import tpurec

    tpurec.DistributedModelParallel(_ebc(), id_limits={"t": (64, 32)})


def _limits_file(tmp_path, text: str):
    path = tmp_path / "limits.json"
    path.write_text(text)
    return path


def _entry(ids: str) -> str:
    """A limits file for dlrm-tiny on v6e-4 (all 26 tables: another model's are refused) with `ids` as
    t_C1's max_ids_per_partition, as written in the JSON text."""
    others = "".join(
        f', "t_C{i}": {{"max_ids_per_partition": 8, "max_unique_ids_per_partition": 8}}' for i in range(2, 27)
    )
    return (
        '{"format": "tpurec-id-limits", "layout": {"world_size": 4, "sparsecores_per_device": 2, '
        '"batch_size_per_device": 512}, "tables": {"t_C1": '
        f'{{"max_ids_per_partition": {ids}, "max_unique_ids_per_partition": 8}}{others}}}}}'
    )


def test_plan_refuses_limits_of_another_models_tables(tmp_path, capsys):
    """`tpurec plan --limits` took a limits file of another model, and sized none of its tables."""
    path = _limits_file(tmp_path, _entry("8").replace('"t_C26"', '"t_other"'))
    code, _, err = run_cli(["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--limits", path], capsys)
    assert_refused(
        code,
        err,
        f"tpurec plan: --limits {path}: measured for other tables: no limits for the model's table(s) t_C26; "
        "table(s) t_other are not the model's (measure this model's: tpurec data stats --model/--plan)",
    )
    code, _, err = run_cli(
        ["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--limits", _entry_file(tmp_path)], capsys
    )
    assert code == 0, err


def _entry_file(tmp_path):
    return _limits_file(tmp_path, _entry("8"))


BAD_FILES = [
    ("Infinity", _entry("Infinity"), "table 't_C1' max_ids_per_partition: inf is not a whole number"),
    ("NaN", _entry("NaN"), "table 't_C1' max_ids_per_partition: nan is not a whole number"),
    ("1e12", _entry("1000000000000"), "table 't_C1' max_ids_per_partition: 1000000000000 is not"),
    ("fraction", _entry("8.5"), "table 't_C1' max_ids_per_partition: 8.5 is not"),
    ("string", _entry('"8"'), "table 't_C1' max_ids_per_partition: '8' is not"),
    ("deep", "[" * 100_000 + "]" * 100_000, "JSON nested deeper than Python's parser reads"),
]


@pytest.mark.parametrize("text,says", [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_a_bad_limits_file_is_one_line(tmp_path, capsys, text, says):
    path = _limits_file(tmp_path, text)
    code, _, err = run_cli(["plan", "--model", "dlrm-tiny", "--topology", "v6e-4", "--limits", path], capsys)
    assert_refused(code, err, f"--limits {path}")
    assert says in err, err


def _edited(plan_file, tmp_path, edit):
    doc = json.loads(plan_file.read_text())
    edit(doc)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))  # NaN / Infinity written as Python's json writes them
    return out


def _size(value):
    def edit(doc):
        doc["tables"][0]["shards"][0]["sizes"][0] = value

    return edit


BAD_PLANS = [
    ("nan_size", _size(float("nan")), "$.tables[0].shards[0].sizes[0]: nan"),
    ("frac_size", _size(1.5), "$.tables[0].shards[0].sizes[0]: 1.5"),
    ("inf_world", lambda d: d.update(world_size=float("inf")), "$.world_size: inf is not a whole number"),
    ("nan_free_form", lambda d: d["meta"].update(note=[{"x": float("nan")}]), "$.meta.note[0].x: nan is not a finite"),
    ("nan_time", lambda d: d.update(estimated_step_time_ms=float("nan")), "$.estimated_step_time_ms: nan is not"),
]


@pytest.mark.parametrize("edit,says", [c[1:] for c in BAD_PLANS], ids=[c[0] for c in BAD_PLANS])
def test_non_finite_or_fractional_plan_numbers_are_refused_when_read(plan_file, tmp_path, capsys, edit, says):
    path = _edited(plan_file, tmp_path, edit)
    code, _, err = run_cli(["plan", "show", path], capsys)
    assert_refused(code, err, f"tpurec plan: {path}: {says}")
    data = tmp_path / "data"
    data.mkdir()  # refused before the data is read
    argv = ["data", "stats", data, "--model", "dlrm-tiny", "--plan", path, "--out", tmp_path / "o.json", "--quiet"]
    code, _, err = run_cli(argv, capsys)
    assert_refused(code, err, f"{path}: {says}")
    assert not (tmp_path / "o.json").exists()
