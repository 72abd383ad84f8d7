"""A checkpoint's own metadata is checked like flags before a resume trusts it (issue #29, family 2).

meta.json and rank-R.json are sealed by CHECKSUMS.json, but an edited file re-sealed (or written by
another tool) resumed with "step": -1 or "world_size": 0, and a missing field was a KeyError
traceback. Tables sized by other data than the checkpoint's were DCP's `Size mismatch` traceback.
Each is now one line naming the file and the field (or the table and both sizes), exit 2. Edits
are re-sealed with `write_checksums`, so what is tested is the field check, not the checksum.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.inproc import TINY_TRAIN, assert_refused, run_cli
from tpurec.data.catalog import get_table_set
from tpurec.dlrm.ckpt import checkpoint as ckpt
from tpurec.dlrm.ckpt.integrity import write_checksums

STEP4 = "step-00000004"
ERROR = "tpurec train: error"


@pytest.fixture
def step(checkpoints) -> Path:
    return checkpoints / STEP4


def _reseal(path: Path, edit) -> None:
    """Edit a JSON file of the checkpoint in place (or replace it with what `edit` returns) and
    re-seal the checkpoint: its checksums match again."""
    doc = json.loads(path.read_text())
    edited = edit(doc)
    path.write_text(json.dumps(doc if edited is None else edited))
    write_checksums(path.parent)


def _without(doc: dict, key: str) -> None:
    del doc[key]


def _resume(path, capsys, *more):
    return run_cli([*TINY_TRAIN, "--steps", 6, "--resume", path, *more], capsys)


META = [
    # (edit of meta.json, what the line says after "CKPT/meta.json: ")
    (lambda m: m.update(step=-1), '"step" is -1; must be an integer >= 0'),
    (lambda m: m.update(world_size=0), '"world_size" is 0; must be an integer >= 1'),
    (lambda m: _without(m, "step"), 'no "step" field'),
    (lambda m: m.update(step="4"), '"step" is "4"; must be an integer'),
    (lambda m: m.update(world_size=True), '"world_size" is true; must be an integer'),
    (lambda m: m.update(epoch_fraction=1.5), '"epoch_fraction" is 1.5; must be a number in [0.0, 1.0]'),
    (lambda m: m.update(config=None), '"config" is null; must be an object'),
    (lambda m: [m], "[{"),
]
META_IDS = ["step-1", "world_size0", "no_step", "step_str", "world_size_bool", "fraction", "config_null", "a_list"]


@pytest.mark.parametrize("edit,says", META, ids=META_IDS)
def test_edited_meta_json_is_refused_naming_the_file_and_field(step, capsys, edit, says):
    _reseal(step / "meta.json", edit)
    code, _, err = _resume(step, capsys)
    assert_refused(code, err, f"error: rank 0: resume: {step / 'meta.json'}: {says}", prefix=ERROR)


def test_resume_falls_back_past_a_checkpoint_with_edited_meta(step, capsys):
    _reseal(step / "meta.json", lambda m: m.update(step=-1))
    code, _, err = run_cli([*TINY_TRAIN, "--steps", 6, "--checkpoint-dir", step.parent, "--resume"], capsys)
    assert code == 0, err
    assert f'resume: {step / "meta.json"}: "step" is -1; must be an integer >= 0; trying the previous' in err
    assert "at step 2, exact" in err


TRAIN_STATE = [
    (lambda s: s["reader"].update(rows_consumed=-512), '"reader": "rows_consumed" is -512; must be an integer >= 0'),
    (lambda s: s["reader"].update(rows_consumed=10**6), '"reader": "rows_consumed" is 1000000, past the epoch'),
    (lambda s: _without(s["reader"], "epoch"), '"reader": no "epoch" field'),
    (lambda s: s.update(step=3), '"step" is 3, but meta.json says 4'),
    (lambda s: s["rng"].update(numpy=[1, 2]), '"rng": "numpy" has 2 entries, not 5'),
]


@pytest.mark.parametrize("edit,says", TRAIN_STATE, ids=["negative", "past_epoch", "no_epoch", "step", "rng"])
def test_edited_train_state_is_refused_naming_the_file_and_field(step, capsys, edit, says):
    _reseal(step / "rank-0.json", edit)
    code, _, err = _resume(step, capsys)
    assert_refused(code, err, f"error: rank 0: resume: {step / 'rank-0.json'}: {says}", prefix=ERROR)


def test_a_model_other_than_meta_json_says_is_refused_naming_the_tensor(step, capsys):
    """meta.json claims the dcn interaction the tensors were not trained with: DCP's `Missing key`."""
    _reseal(step / "meta.json", lambda m: m["config"].update(interaction="dcn"))
    code, _, err = _resume(step, capsys, "--interaction", "dcn")
    says = f"resume: checkpoint {step} holds no model.inter_arch.crossnet.V_kernels.0: it was written for another"
    assert_refused(code, err, says, prefix=ERROR)


@pytest.fixture(scope="module")
def other_sizes(tmp_path_factory) -> Path:
    """dlrm-tiny data whose _dataset.json gives t_C1 999 rows instead of 1,000."""
    from tpurec.bench.data import write_criteo_tsv
    from tpurec.cli import main

    d = tmp_path_factory.mktemp("other-sizes")
    write_criteo_tsv(str(d), str(d / "day_0"), 1200, seed=1)
    sizes = [t.num_embeddings for t in get_table_set("dlrm-tiny").tables]
    sizes[0] = 999
    argv = ["data", "convert", d / "day_0", "--out", d / "data", "--table-sizes", ",".join(map(str, sizes))]
    assert main([*map(str, argv), "--quiet", "--jobs", "1"]) == 0
    return d / "data"


def test_resuming_on_data_with_other_table_sizes_names_the_table_and_both_sizes(step, other_sizes, capsys):
    code, _, err = _resume(step, capsys, "--data", other_sizes)
    says = f"resume: checkpoint {step} has table t_C1 with 1,000 rows, this run's has 999 (tables take their sizes"
    assert_refused(code, err, says, prefix=ERROR)
    assert "Size mismatch" not in err


def test_a_checkpoint_refused_for_its_shapes_leaves_the_model_untouched(step):
    """The shapes are compared before DCP writes a byte into the model."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(3, 2)

    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"holds no dense.weight"):
        ckpt.load(step, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
